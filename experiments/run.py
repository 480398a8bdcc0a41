"""The experiment CLI: train a model from a config file, then summarise, plot and sample.

    python -m experiments.run --config experiments/configs/quickstart.py --workdir runs/quick \
        --config.train.steps=300

Any config key can be overridden with `--config.<section>.<key>=<value>`; `--help` lists them all with their
defaults (docs/configuration.md is the same reference). A warm-up longer than a short run (`optim.warmup_steps` >
`train.steps`) is shortened to the run, with a notice (core.config.fit_to_steps). Outputs in the workdir:
config.json (the resolved config), data.json (corpus description and fingerprint), metrics.jsonl (one row per
log / eval), checkpoints/, summary.json, loss_curve.png, sample.txt, and history.jsonl when a resume accepted changed
hyper-parameters. Rerunning the same command resumes from the latest checkpoint (verified against the checksums it
was saved with); one run at a time holds a workdir (`.lock`). Exit codes: 0 done, 1 training stopped (non-finite
loss or state, unusable checkpoint, a lost process, a full disk), 2 bad input (flags, config, data, a workdir that
cannot be used or is in use).
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections
from absl import flags
from ml_collections import config_flags

from core import checkpoint as checkpoint_lib
from core import config as config_lib
from core import mesh as mesh_lib
from core import train as train_lib
from core import workdir as workdir_lib
from core.data import DataError
from experiments import build, command, config_doc, report, schema
from experiments import federated as federated_lib
from experiments.hf.config_map import HFConfigError
from experiments.hf.weights import HFWeightsError

USAGE = (
    "usage: python -m experiments.run --config experiments/configs/<name>.py[:arg] --workdir <dir> "
    "[--config.<section>.<key>=<value> ...]"
)


CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
DOCS = os.path.join(os.path.dirname(os.path.dirname(CONFIG_DIR)), "docs", "configuration.md")


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


class UsageError(ValueError):
    """A bad command line (flags, the config file, an override): the message says what is wrong and what is
    allowed; `main` prints it as one `error:` line (exit code 2)."""


def _shown(path: str) -> str:
    """`path` relative to the working directory when it lies below it, else absolute."""
    rel = os.path.relpath(os.path.abspath(path))
    return os.path.abspath(path) if rel.startswith("..") else rel


def config_files() -> list[str]:
    """The names of the config files in experiments/configs/, sorted."""
    return sorted(n for n in os.listdir(CONFIG_DIR) if n.endswith(".py") and not n.startswith("_"))


def _listing() -> str:
    """'experiments/configs/: composed.py, fomoe.py, ...' (the directory as a user would type it from here)."""
    return f"{_shown(CONFIG_DIR)}/: {', '.join(config_files())}"


def help_text() -> str:
    """What `python -m experiments.run --help` prints: usage, the flags, then every config key with its default,
    what it allows and its one-line description (experiments.config_doc.text, from the schema)."""
    return (
        f"{USAGE}\n\n"
        "Trains a model from a config file, then writes the summary, loss curve and a sample into the workdir;\n"
        "rerunning the same command resumes from the workdir's latest checkpoint. Exit codes: 0 done, 1 training\n"
        "stopped, 2 bad input.\n\n"
        "flags:\n"
        "  --config FILE[:ARG]          the experiment: a Python file whose get_config([ARG]) returns its config;\n"
        f"                               in {_listing()}\n"
        "  --workdir DIR                where the run writes (config.json, metrics.jsonl, checkpoints/, ...)\n"
        "  --config.<section>.<key>=V   override one config key below, e.g. --config.train.steps=300\n"
        "                               (a warm-up longer than train.steps is shortened to it, with a notice)\n"
        "  -h, --help                   this help\n\n"
        f"config keys: default [allowed values] and meaning (a config file changes some of them; full reference:\n"
        f"{_shown(DOCS)})\n\n" + config_doc.text()
    )


def _config_value(argv: list[str]) -> str | None:
    """The value of --config on the command line (`--config=X` or `--config X`; the last one wins), or None."""
    value = None
    for i, arg in enumerate(argv[1:], 1):
        if arg == "--":
            break
        if arg in ("--config", "-config"):
            value = argv[i + 1] if i + 1 < len(argv) else ""
        elif arg.startswith(("--config=", "-config=")):
            value = arg.split("=", 1)[1]
    return value


def _check_config_file(value: str) -> None:
    """Raises UsageError unless the path part of --config (before any ':arg') is a file."""
    path = value.split(":", 1)[0]
    if not path or path.startswith("-"):
        raise UsageError(f"--config needs a config file, got {value!r}; the config files in {_listing()}.")
    if os.path.isfile(path):
        return
    what = "is a directory, not a config file" if os.path.isdir(path) else "no such file"
    close = difflib.get_close_matches(os.path.basename(path), config_files(), n=1)
    hint = f" Did you mean {_shown(os.path.join(CONFIG_DIR, close[0]))}?" if close else ""
    raise UsageError(f"--config={value}: {what}; the config files in {_listing()}.{hint}")


def _unknown_override(arg: str, spec) -> str | None:
    """The error for a `--config.<section>.<key>` override the schema does not declare (None if it does): the
    closest keys, and the keys of its section (or the sections)."""
    key = arg[len("--config.") :].split("=", 1)[0]
    section, _, name = key.partition(".")
    if section in spec and name in spec[section]:
        return None
    if section in spec:
        if not name:
            return f"{arg}: '{section}' is a section; set one of its keys: --config.{section}.<key>=<value>, " + (
                f"<key> one of {', '.join(spec[section])}."
            )
        close = difflib.get_close_matches(name, list(spec[section]), n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(f'{section}.{c}' for c in close)}?" if close else ""
        return f"{arg}: unknown config key '{key}'.{hint} The keys of '{section}': {', '.join(spec[section])}."
    close = [f"{c}.{name}" if name in spec[c] else c for c in difflib.get_close_matches(section, list(spec), n=2)]
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return f"{arg}: unknown config section '{section}'.{hint} Sections: {', '.join(spec)}."


def _unknown_flag(name: str, spec) -> str:
    """' Did you mean --config.train.steps?' for an unknown flag --steps (a key's name or a close match)."""
    keys = [f"{s}.{k}" for s, fields in spec.items() for k in fields]
    named = [k for k in keys if k.split(".", 1)[1] == name or k == name]
    close = named or difflib.get_close_matches(name, ["config", "workdir", *keys], n=3, cutoff=0.6)
    shown = [c if c in ("config", "workdir") else f"config.{c}" for c in close]
    return f" Did you mean {' or '.join('--' + c for c in shown)}?" if shown else ""


def _value_error(message: str, spec) -> str | None:
    """A clean message for absl's error about an override's value ('flag --config.train.steps=abc: invalid
    literal for int() ...'), naming the flag, the value and what the key takes; None for other errors."""
    match = re.search(r"--config\.(\w+)\.(\w+)(?:=(.*?))?:", message) or re.search(
        r"Missing value for flag --config\.(\w+)\.(\w+)()", message
    )
    if not match or match[1] not in spec or match[2] not in spec[match[1]]:
        return None
    key, field = f"{match[1]}.{match[2]}", spec[match[1]][match[2]]
    if message.startswith("Missing value"):
        return f"--config.{key} needs a value: --config.{key}=<{field.describe()}>."
    value = match[3]
    kind = next(t for t in field.types if t is not type(None)).__name__
    if value == "None" and type(None) in field.types:
        return f"--config.{key}=None: the command line cannot set None; leave the flag out to keep the default."
    allowed = f"{field.describe()} (true or false)" if kind == "bool" else field.describe()
    return f"--config.{key}={value}: {value!r} is not a valid {kind}; config key '{key}' takes {allowed}."


def _load_error(value: str, error: BaseException) -> UsageError | None:
    """The UsageError for a config file that failed to load (a syntax error, an exception in get_config, a
    `:arg` that get_config does not take), or None when `error` did not come from the config file."""
    path = os.path.abspath(value.split(":", 1)[0])
    text = str(error)
    if "Error whilst parsing config file" in text:  # config_flags wraps a TypeError / ValueError of get_config
        last = [line for line in text.splitlines() if re.match(r"^\w+(Error|Exception)\b", line)]
        reason = last[-1] if last else text.splitlines()[0]
        if "get_config()" in reason and "positional argument" in reason:
            wanted = reason.rsplit(": ", 1)[-1].strip("'")  # the missing argument's name
            hint = (
                " (this config file takes no ':arg')"
                if "takes 0 positional" in reason
                else f" (pass it after a colon: --config={value.split(':', 1)[0]}:<{wanted}>)"
            )
            reason += hint
        return UsageError(f"--config={value}: cannot load the config file: {reason}")
    frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.abspath(f.filename) == path]
    if isinstance(error, SyntaxError) and error.filename and os.path.abspath(error.filename) == path:
        return UsageError(f"--config={value}: cannot load the config file: {error.msg} (line {error.lineno})")
    if frames:
        return UsageError(
            f"--config={value}: cannot load the config file: {type(error).__name__}: {error} "
            f"(line {frames[-1].lineno}: {frames[-1].line})"
        )
    return None


def parse_args(argv: list[str]):
    """Parses the command line into (config, workdir); fits a warm-up longer than a short run to it
    (core.config.fit_to_steps), printing a notice. Raises UsageError with a clear message."""
    spec = schema.schema()
    for arg in argv[1:]:
        if arg.startswith("--config."):
            unknown = _unknown_override(arg, spec)
            if unknown:
                raise UsageError(unknown)
    config_value = _config_value(argv)
    if config_value is not None:
        _check_config_file(config_value)
    fv = flags.FlagValues()
    config_flag = config_flags.DEFINE_config_file(
        "config", None, "experiment config file", flag_values=fv, lock_config=True, sys_argv=argv
    )
    workdir_flag = flags.DEFINE_string(
        "workdir", None, "output directory (resumes if it holds checkpoints)", flag_values=fv
    )
    try:
        rest = fv(argv)
    except Exception as e:
        loading = _load_error(config_value, e) if config_value else None
        if loading is not None:
            raise loading from None
        if isinstance(e, flags.Error):
            clean = _value_error(str(e), spec)
            if clean is not None:
                raise UsageError(clean) from None
            flag = re.match(r"Unknown command line flag '([^']*)'", str(e))
            hint = _unknown_flag(flag[1], spec) if flag else ""
            raise UsageError(f"{e}.{hint}\n{USAGE}" if hint else f"{e}\n{USAGE}") from None
        if isinstance(e, (AttributeError, KeyError, TypeError, ValueError)):
            raise UsageError(f"cannot apply the command line to the config: {e}\n{USAGE}") from None
        raise
    if len(rest) > 1:
        names = [os.path.splitext(f)[0] for f in config_files()]
        hint = f" (a config: --config {_shown(os.path.join(CONFIG_DIR, rest[1] + '.py'))})" if rest[1] in names else ""
        raise UsageError(f"unexpected argument {rest[1]!r}{hint}; every argument is a flag (--name=value).\n{USAGE}")
    if fv["config"].value is None:
        raise UsageError(f"--config is required.\n{USAGE}")
    if not workdir_flag.value:
        raise UsageError(f"--workdir is required.\n{USAGE}")
    config = config_flag.value
    if not isinstance(config, ml_collections.ConfigDict):  # config_flags defers a load error to first access
        filename = config_flags.get_config_filename(fv["config"])
        if hasattr(config, "to_dict"):  # (config_flags' placeholder of a deferred load error raises it here)
            try:
                config.to_dict()
            except Exception as e:
                raise UsageError(f"cannot load --config={filename}: {e}") from None
        raise UsageError(
            f"--config={filename}: get_config() must return an ml_collections.ConfigDict, got {type(config).__name__}"
        )
    notices = config_lib.fit_to_steps(config)
    if notices and config.mesh.get("process_id", 0) == 0:
        for notice in notices:
            print(f"note: {notice}", flush=True)
    return config, workdir_flag.value


def main(argv: list[str] | None = None) -> int:
    """The command line's entry point (`argv` as sys.argv: the program name first). Returns the exit code: 0 done
    (or --help), 1 training stopped, 2 bad input (one `error:` line on stderr)."""
    argv = sys.argv if argv is None else argv
    if any(arg in ("-h", "--help", "-help") for arg in argv[1 : argv.index("--") if "--" in argv else None]):
        print(help_text(), end="")
        return 0
    try:
        config, workdir = parse_args(argv)
    except (UsageError, config_lib.ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return run(config, workdir)
    except workdir_lib.WriteError as e:  # a full disk: the run stopped, it was not refused
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (config_lib.ConfigError, DataError, workdir_lib.WorkdirError, HFConfigError, HFWeightsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(config, workdir: str, *, hooks: Sequence[Callable[[int, dict[str, float]], None]] = ()) -> int:
    """Validates, trains, and writes the summary, holding the workdir's lock (process 0). Returns the exit code.
    `hooks` are called after every step (`core.train.run`); an exception they raise stops the run as a crash would
    (tests use one). Raises ConfigError, DataError, WorkdirError, HFConfigError or HFWeightsError (a checkpoint
    of checkpoint.init_from that does not fit) for bad input."""
    schema.validate(config)  # static checks: no JAX backend touched yet
    schema.resolve(config)
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


def write_records(workdir: str, config: ml_collections.ConfigDict, corpus) -> None:
    """The run's config.json (the resolved config) and data.json (the corpus's description and fingerprint), which
    `experiments.load` reads back."""
    workdir_lib.write_json(os.path.join(workdir, "config.json"), config.to_dict())
    workdir_lib.write_json(os.path.join(workdir, "data.json"), {"fingerprint": corpus.fingerprint, **corpus.info})


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
        on_start=(lambda resumed_from: write_records(workdir, config, corpus)) if is_main else None,
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
