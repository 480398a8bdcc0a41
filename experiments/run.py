"""The experiment CLI: train a model from a config file, then summarise, plot and sample.

    python -m experiments.run --config experiments/configs/quickstart.py --workdir runs/quick \
        --config.train.steps=300

Any config key can be overridden with `--config.<section>.<key>=<value>`. Outputs in the workdir:
config.json (the resolved config), data.json (corpus description and fingerprint), metrics.jsonl (one row per
log / eval), checkpoints/, summary.json, loss_curve.png, sample.txt, and history.jsonl when a resume accepted changed
hyper-parameters. Rerunning the same command resumes from the latest checkpoint (verified against the checksums it
was saved with); one run at a time holds a workdir (`.lock`). Exit codes: 0 done, 1 training stopped (non-finite
loss or state, unusable checkpoint, a lost process), 2 bad input (flags, config, data, a workdir that cannot be
used or is in use).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

from core import config as config_lib
from core import workdir as workdir_lib
from core.data import DataError

USAGE = (
    "usage: python -m experiments.run --config experiments/configs/<name>.py[:arg] --workdir <dir> "
    "[--config.<section>.<key>=<value> ...]"
)


class UsageError(ValueError):
    pass


def parse_args(argv: list[str]):
    """Parses the command line into (config, workdir). Raises UsageError with a clear message."""
    from experiments import build

    spec = build.schema()
    for arg in argv[1:]:
        if arg.startswith("--config."):
            key = arg[len("--config.") :].split("=", 1)[0]
            section, _, name = key.partition(".")
            if section not in spec or name not in spec[section]:
                known = [f"{s}.{k}" for s, fields in spec.items() for k in fields]
                raise UsageError(f"{arg}: {config_lib.unknown_key_error(key, known)}")
    fv = flags.FlagValues()
    config_flag = config_flags.DEFINE_config_file(
        "config", None, "experiment config file", flag_values=fv, lock_config=True, sys_argv=argv
    )
    workdir_flag = flags.DEFINE_string(
        "workdir", None, "output directory (resumes if it holds checkpoints)", flag_values=fv
    )
    try:
        fv(argv)
    except flags.Error as e:
        raise UsageError(f"{e}{_expected(str(e), spec)}\n{USAGE}") from None
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise UsageError(f"cannot apply the command line to the config: {e}\n{USAGE}") from None
    if fv["config"].value is None:
        raise UsageError(f"--config is required.\n{USAGE}")
    if not workdir_flag.value:
        raise UsageError(f"--workdir is required.\n{USAGE}")
    config = config_flag.value
    if not isinstance(config, ml_collections.ConfigDict):  # config_flags defers a load error to first access
        filename = config_flags.get_config_filename(fv["config"])
        try:
            config.to_dict()
        except Exception as e:
            raise UsageError(f"cannot load --config={filename}: {e}") from None
        raise UsageError(
            f"--config={filename}: get_config() must return an ml_collections.ConfigDict, got {type(config).__name__}"
        )
    return config, workdir_flag.value


def _expected(message: str, spec) -> str:
    """'; config key 'train.steps' takes int in [1, inf)' for a flag error about --config.train.steps."""
    match = re.search(r"--config\.(\w+)\.(\w+)", message)
    if match and match[1] in spec and match[2] in spec[match[1]]:
        return f"; config key '{match[1]}.{match[2]}' takes {spec[match[1]][match[2]].describe()}"
    return ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    try:
        config, workdir = parse_args(argv)
    except (UsageError, config_lib.ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from experiments.hf.config_map import HFConfigError
    from experiments.hf.weights import HFWeightsError

    try:
        return run(config, workdir)
    except (config_lib.ConfigError, DataError, workdir_lib.WorkdirError, HFConfigError, HFWeightsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(config, workdir: str, *, hooks: Sequence[Callable[[int, dict[str, float]], None]] = ()) -> int:
    """Validates, trains, and writes the summary, holding the workdir's lock (process 0). Returns the exit code.
    `hooks` are called after every step (`core.train.run`); an exception they raise stops the run as a crash would
    (tests use one). Raises ConfigError, DataError, WorkdirError, HFConfigError or HFWeightsError (a checkpoint
    of checkpoint.init_from that does not fit) for bad input."""
    from experiments import build

    build.validate(config)  # static checks: no JAX backend touched yet
    build.resolve(config)
    build.validate(config)  # with what init_from implies
    if config.mesh.process_id != 0:
        return _run(config, workdir, hooks)
    with workdir_lib.lock(workdir):
        return _run(config, workdir, hooks)


def write_records(workdir: str, config: ml_collections.ConfigDict, corpus) -> None:
    """The run's config.json (the resolved config) and data.json (the corpus's description and fingerprint), which
    `experiments.load` reads back."""
    workdir_lib.write_json(os.path.join(workdir, "config.json"), config.to_dict())
    workdir_lib.write_json(os.path.join(workdir, "data.json"), {"fingerprint": corpus.fingerprint, **corpus.info})


def _run(config, workdir: str, hooks: Sequence[Callable[[int, dict[str, float]], None]]) -> int:
    from core import mesh as mesh_lib
    from experiments import build

    _virtual_sites(config)
    mesh_lib.initialize_distributed(config)
    import jax

    build.validate(config, num_devices=jax.device_count())
    from core import checkpoint as checkpoint_lib
    from core import train as train_lib
    from experiments import report

    logging.getLogger("absl").setLevel(logging.WARNING)
    started = time.time()
    is_main = jax.process_index() == 0
    corpus, batches = build.build_data(config)
    mesh, sharder = build.build_mesh(config)
    model_fn = build.build_model_fn(config, sharder)
    num_params = report.count_params(model_fn)
    if is_main:
        print(
            f"model: {num_params:,} parameters | mesh {dict(mesh.shape)} on {mesh.devices.size} of "
            f"{jax.device_count()} {jax.devices()[0].platform} devices | corpus {corpus.info.get('source')} "
            f"({len(corpus.train):,} train / {len(corpus.val):,} held-out tokens, "
            f"fingerprint {corpus.fingerprint[:12]})",
            flush=True,
        )
        idle = jax.device_count() - mesh.devices.size
        if idle:
            print(
                f"warning: {idle} of the {jax.device_count()} devices idle: the mesh {dict(mesh.shape)} uses "
                f"{mesh.devices.size} (set an axis of config.mesh to -1 to use all)",
                file=sys.stderr,
                flush=True,
            )

    def write_records(resumed_from):  # only once any checkpoint in the workdir has been accepted
        if is_main:
            workdir_lib.write_json(os.path.join(workdir, "config.json"), config.to_dict())
            workdir_lib.write_json(
                os.path.join(workdir, "data.json"), {"fingerprint": corpus.fingerprint, **corpus.info}
            )

    federated = config.mesh.site > 1
    from experiments import federated as federated_lib

    common: dict[str, Any] = dict(
        workdir=workdir,
        batches=batches,
        compat=build.checkpoint_compat(config, corpus.fingerprint),
        provenance=build.provenance(config),
        state_metrics=build.optimizer_metrics,
        hooks=hooks,
        on_start=write_records,
    )
    try:
        if federated:
            results = federated_lib.train_federated(config, **common)
        else:
            optimizer = build.build_optimizer(config)
            results = train_lib.train(
                config,
                model_fn=model_fn,
                optimizer=optimizer,
                sharder=sharder,
                init_params=build.init_params(config),
                **common,
            )
    except (train_lib.NonFiniteLossError, checkpoint_lib.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except train_lib.PeerLostError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # skip jax.distributed's shutdown barrier, which would wait for the lost process and abort
    if not is_main:
        return 0
    summary = {
        "train_loss": results["train_loss"],
        "val_loss": results["val_loss"],
        "val_bits_per_byte": results["val_bits_per_byte"],
        "tokens_per_second": results["tokens_per_second"],
        "num_params": num_params,
        **report.moe_summary(config, num_params, metrics_path=os.path.join(workdir, "metrics.jsonl")),
        "steps": results["steps"],
        **{
            key: v
            for key, v in results.items()
            if key in ("rounds", "bytes_per_token", "val_bits_per_byte_worst_site")
            or key.startswith(("bytes_per_site", "bytes_per_device"))
        },
        "resumed_from": results["resumed_from"],
        "data_fingerprint": corpus.fingerprint,
        "devices": f"{mesh.devices.size} x {mesh.devices.flat[0].device_kind}",  # those the run used
        "wall_seconds_this_process": round(time.time() - started, 1),
    }
    workdir_lib.write_json(os.path.join(workdir, "summary.json"), summary)
    report.plot_loss_curve(os.path.join(workdir, "metrics.jsonl"), os.path.join(workdir, "loss_curve.png"))
    print(report.summary_table(summary), flush=True)
    if config.sample.prompt and config.sample.num_tokens:
        if jax.process_count() > 1:
            print(
                "sample skipped: generation runs in single-process runs only (the parameters are spread over "
                "processes here)",
                flush=True,
            )
        else:
            text = report.sample_text(config, model_fn, results)
            with open(os.path.join(workdir, "sample.txt"), "w") as f:
                f.write(text)
            whose = " from site 0's model (its own experts)" if federated else ""
            print(f"sample{whose} (temperature {config.sample.temperature}):\n{text}", flush=True)
    print(f"outputs in {workdir}", flush=True)
    return 0


def _virtual_sites(config) -> None:
    """A single-process federated run (mesh.site = M > 1) with no device count in XLA_FLAGS gets M virtual CPU
    devices, one per site, so `--config.mesh.site=2` works as typed. Must run before JAX creates its backend; it
    changes nothing on a GPU or TPU backend, or when XLA_FLAGS already sets a device count."""
    flags_now = os.environ.get("XLA_FLAGS", "")
    if config.mesh.site > 1 and config.mesh.num_processes == 1 and "device_count" not in flags_now:
        count = config.mesh.site * max(1, config.mesh.data) * max(1, config.mesh.expert) * max(1, config.mesh.model)
        os.environ["XLA_FLAGS"] = f"{flags_now} --xla_force_host_platform_device_count={count}".strip()
        print(f"federated run: {count} virtual CPU devices (XLA_FLAGS={os.environ['XLA_FLAGS']})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
