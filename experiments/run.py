"""The experiment CLI: train a model from a config file, then summarise, plot and sample.

    python -m experiments.run --config experiments/configs/quickstart.py --workdir runs/quick \
        --config.train.steps=300

Any config key can be overridden with `--config.<section>.<key>=<value>`; `--help` lists them all with their
defaults (docs/configuration.md is the same reference). A warm-up longer than a short run (`optim.warmup_steps` >
`train.steps`) is shortened to the run, with a notice (core.schema.fit_to_steps). Outputs in the workdir:
config.json (the resolved config), data.json (corpus description and fingerprint), metrics.jsonl (one row per
log / eval), checkpoints/, summary.json, loss_curve.png, sample.txt, and history.jsonl when a resume accepted changed
hyper-parameters. Rerunning the same command resumes from the latest checkpoint (verified against the checksums it
was saved with); one run at a time holds a workdir (`.lock`). Exit codes: 0 done, 1 training stopped (non-finite
loss or state, unusable checkpoint, a lost process, a full disk), 2 bad input (flags, config, data, a workdir that
cannot be used or is in use).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from core import checkpoint as checkpoint_lib
from core import fields as fields_lib
from core import mesh as mesh_lib
from core import train as train_lib
from core import workdir as workdir_lib
from core.corpus import DataError
from experiments import args, build, command, load, report, schema
from experiments import federated as federated_lib
from experiments.hf import load as hf_load
from experiments.hf.config_map import HFConfigError
from experiments.hf.weights import HFWeightsError

RUN_FILES = (
    "config.json",
    "data.json",
    "summary.json",
    "metrics.jsonl",
    "metrics.superseded.jsonl",
    "history.jsonl",
    "loss_curve.png",
    "sample.txt",
)
"""The files a run writes into its workdir (each must be a file if it is there: core.workdir.check_files)."""


def main(argv: list[str] | None = None) -> int:
    """The command line's entry point (`argv` as sys.argv: the program name first). Returns the exit code: 0 done
    (or --help), 1 training stopped, 2 bad input (one `error:` line on stderr)."""
    argv = sys.argv if argv is None else argv
    if any(arg in ("-h", "--help", "-help") for arg in argv[1 : argv.index("--") if "--" in argv else None]):
        print(args.run_help(), end="")
        return 0
    try:
        config, workdir = args.parse_run_args(argv)
    except (args.UsageError, fields_lib.ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return run(config, workdir)
    except workdir_lib.WriteError as e:  # a full disk: the run stopped, it was not refused
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (fields_lib.ConfigError, DataError, workdir_lib.WorkdirError, HFConfigError, HFWeightsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(config, workdir: str, *, hooks: Sequence[Callable[[int, dict[str, float]], None]] = ()) -> int:
    """Validates, trains, and writes the summary, holding the workdir's lock (process 0). Returns the exit code.
    `hooks` are called after every step (`core.train.run`); an exception they raise stops the run as a crash would
    (tests use one). Raises ConfigError, DataError, WorkdirError, HFConfigError or HFWeightsError (a checkpoint
    of checkpoint.init_from that does not fit) for bad input."""
    schema.validate(config)  # static checks: no JAX backend touched yet
    hf_load.resolve(config)
    mesh_lib.resolve_processes(config)  # mesh.num_processes = -1: this process's index and count from srun, mpirun...
    schema.validate(config)  # with what init_from and the cluster imply
    try:
        if config.mesh.process_id != 0:
            return _run(config, workdir, hooks)
        with workdir_lib.lock(workdir):  # (a refusal leaves through it: the lock file is left as it was found)
            workdir_lib.check_files(workdir, RUN_FILES, ("checkpoints",))
            return _run(config, workdir, hooks)
    except (train_lib.NonFiniteLossError, checkpoint_lib.CheckpointError) as e:  # (a WriteError: main's, exit 1 too)
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(config, workdir: str, hooks: Sequence[Callable[[int, dict[str, float]], None]]) -> int:
    _virtual_sites(config)  # before the JAX backend starts (the first device query below)
    mesh_lib.initialize_distributed(config)
    schema.validate(config, num_devices=jax.device_count())
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

    federated = config.mesh.site > 1
    common: dict[str, Any] = dict(
        workdir=workdir,
        batches=batches,
        compat=schema.checkpoint_compat(config, corpus.fingerprint),
        provenance=schema.provenance(config),
        state_metrics=build.optimizer_metrics,
        hooks=hooks,
        # the records are written once any checkpoint in the workdir has been accepted (process 0)
        on_start=(lambda resumed_from: load.write_records(workdir, config, corpus)) if is_main else None,
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
                init_params=hf_load.init_params(config),
                **common,
            )
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
    """A single-process federated run (mesh.site = M > 1) with no device count in XLA_FLAGS gets M x mesh.expert
    virtual CPU devices (mesh.expert per site), so `--config.mesh.site=2` works as typed. Must run before JAX
    creates its backend; it changes nothing on a GPU or TPU backend, or when XLA_FLAGS already sets a device count."""
    flags_now = os.environ.get("XLA_FLAGS", "")
    if config.mesh.site > 1 and config.mesh.num_processes == 1 and "device_count" not in flags_now:
        count = config.mesh.site * max(1, config.mesh.data) * max(1, config.mesh.expert) * max(1, config.mesh.model)
        os.environ["XLA_FLAGS"] = f"{flags_now} --xla_force_host_platform_device_count={count}".strip()
        print(f"federated run: {count} virtual CPU devices (XLA_FLAGS={os.environ['XLA_FLAGS']})", flush=True)


if __name__ == "__main__":
    command.run(main)
