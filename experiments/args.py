"""The commands' flags, parsed and checked, and nothing more: argparse types, the flags of a run to serve and of its
KV pool, and the training command's `--config` command line. What is built from parsed flags (an engine, a loaded
model) is experiments.engine's.

    parser.add_argument("--steps", type=args.integer(1), default=100)     # refused by argparse, naming the rule
    args.add_run_flags(parser); args.add_kv_flags(parser)                  # --workdir --site; --kv-format ...
    config, workdir = args.parse_run_args(sys.argv)                        # experiments.run's command line

Both serve commands (`python -m experiments.serve`, `python -m experiments.serve --http`) read the run and KV flags;
the benchmark and reproduction scripts take their flag types from here too (through experiments.harness), and
the reproductions resolve a run's config as `python -m experiments.run` would (`parse_run_args`, UsageError).

A bad flag fails with a FlagError, a UsageError (the run's command line) or argparse's own error, naming the flag,
the value and what is allowed; nothing is loaded.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import traceback
from collections.abc import Callable, Iterable

import ml_collections
from absl import flags
from ml_collections import config_flags

from core import schema as core_schema
from experiments import config_doc, load, schema
from kvcache import formats
from kvcache.serving import EngineConfig

__all__ = [
    "MAX_KV_MEMORY_MIB",
    "MAX_SEED",
    "RUN_USAGE",
    "FlagError",
    "HelpFormatter",
    "UsageError",
    "add_kv_flags",
    "add_run_flags",
    "config_files",
    "integer",
    "integers",
    "names",
    "number",
    "parse_run_args",
    "run_help",
]

MAX_KV_MEMORY_MIB = 2.0**40
"""The largest --kv-memory-mib (1 EiB): larger pools cannot be allocated anywhere and overflow XLA's shape sizes."""

MAX_SEED = 2**64 - 1
"""The largest --seed: an engine's and a request's random streams are seeded in [0, 2^64) (kvcache.serving)."""


class FlagError(ValueError):
    """A flag that cannot serve this run (its message names the flag, the value and what is allowed)."""


# ------------------------------------------------------------------------------------------------ argparse types


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default after its help, except a default of None or "" (whose meaning the help states)
    and a switch's (it takes no value): every command's --help states each default once."""

    def _get_help_string(self, action):
        if action.default in ("", None) or action.default is argparse.SUPPRESS or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def integer(minimum: int = 1, *, multiple_of: int = 1, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse `type`: an integer >= `minimum` (and <= `maximum` if given) that is a multiple of `multiple_of`;
    otherwise argparse reports the flag, the value and this rule."""
    rule = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
    rule += f" and a multiple of {multiple_of}" if multiple_of > 1 else ""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or value % multiple_of or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{text!r} is not {rule}")
        return value

    return parse


def number(low: float, *, low_open: bool = False, high: float | None = None) -> Callable[[str], float]:
    """An argparse `type`: a finite float > `low` (`low_open`) or >= `low`, and <= `high` if given; otherwise
    argparse reports the flag, the value and this rule (nan and inf are refused)."""
    rule = f"a finite number {'>' if low_open else '>='} {low:g}" + ("" if high is None else f" and <= {high!r}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if (
            not math.isfinite(value)
            or value < low
            or (low_open and value == low)
            or (high is not None and value > high)
        ):
            raise argparse.ArgumentTypeError(f"{text!r} is not {rule}")
        return value

    return parse


def integers(minimum: int = 1, *, distinct: bool = False, empty: bool = False) -> Callable[[str], list[int]]:
    """An argparse `type`: comma-separated integers, each >= `minimum` (all different if `distinct`); an empty
    string gives [] when `empty`, else it is refused."""
    rule = f"comma-separated integers >= {minimum}" + (", all different" if distinct else "")

    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = None
        if values is None or (not values and not empty) or any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"{text!r} is not {rule}")
        if distinct and len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"{text!r} repeats a value; give {rule}")
        return values

    return parse


def names(allowed: Iterable[str], *, empty: bool = False) -> Callable[[str], list[str]]:
    """An argparse `type`: a comma-separated subset of `allowed` (in the order given); an empty string gives []
    when `empty`, else it is refused."""
    allowed = list(allowed)

    def parse(text: str) -> list[str]:
        values = [v for v in text.split(",") if v]
        unknown = [v for v in values if v not in allowed]
        if unknown or (not values and not empty):
            raise argparse.ArgumentTypeError(
                f"{text!r}: {'unknown ' + repr(unknown) if unknown else 'give at least one'}; allowed: {allowed}"
            )
        return values

    return parse


# ------------------------------------------------------------------------------------------------ shared flags


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """--workdir (required), --site and --precision: the run to serve, a federated run's site whose model serves,
    and what its GEMMs compute in (experiments.load.PRECISIONS)."""
    # required: default=SUPPRESS keeps "(default: None)" out of the help
    parser.add_argument(
        "--workdir",
        required=True,
        default=argparse.SUPPRESS,
        help="a finished run's directory, trained by experiments.run or imported by experiments.hf (config.json, "
        "data.json, checkpoints/)",
    )
    parser.add_argument(
        "--site", type=integer(0), default=0, help="a federated run's site whose model serves (0 .. sites - 1)"
    )
    parser.add_argument(
        "--precision",
        choices=load.PRECISIONS,
        default="trained",
        help="the GEMMs' precision: the run's training recipe (a UFP4 run's 4-bit GEMMs) or float (what an export "
        "computes)",
    )


def add_kv_flags(parser: argparse.ArgumentParser) -> None:
    """--kv-format, --scale-rule and --kv-memory-mib: the KV pool's flags, and --decode-steps, the engine's decode
    steps per device call. The first two are absent from the parsed namespace when not given (their default is the
    run's: `kv_format` reads them)."""
    parser.add_argument(
        "--kv-format",
        default=argparse.SUPPRESS,
        choices=formats.NAMES,
        help="format the KV pool stores keys/values in (default: the run's kvcache.format)",
    )
    parser.add_argument(
        "--scale-rule",
        default=argparse.SUPPRESS,
        choices=formats.SCALE_RULES,
        help="UE8M0 scale rule of the fp4 and k8v4 formats (default: the run's kvcache.scale_rule)",
    )
    parser.add_argument(
        "--kv-memory-mib",
        type=number(0.0, low_open=True, high=MAX_KV_MEMORY_MIB),
        default=64.0,
        help=f"KV pool size in MiB (at least one block of {EngineConfig.block_size} tokens must fit)",
    )
    parser.add_argument(
        "--decode-steps",
        type=integer(1),
        default=EngineConfig.decode_steps,
        help="decode steps per device call when every scheduled request decodes and none waits (1: a call per "
        "token; tokens then reach a stream up to this many at a time)",
    )


# ----------------------------------------------------------------------------------------- the run's command line


RUN_USAGE = (
    "usage: python -m experiments.run --config experiments/configs/<name>.py[:arg] --workdir <dir> "
    "[--config.<section>.<key>=<value> ...]"
)


CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
CONFIG_DOC = os.path.join(os.path.dirname(os.path.dirname(CONFIG_DIR)), "docs", "configuration.md")


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


def run_help() -> str:
    """What `python -m experiments.run --help` prints: usage, the flags, then every config key with its default,
    what it allows and its one-line description (experiments.config_doc.text, from the schema)."""
    return (
        f"{RUN_USAGE}\n\n"
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
        f"{_shown(CONFIG_DOC)})\n\n" + config_doc.text()
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


def parse_run_args(argv: list[str]):
    """Parses the command line into (config, workdir); fits a warm-up longer than a short run to it
    (core.schema.fit_to_steps), printing a notice. Raises UsageError with a clear message."""
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
            raise UsageError(f"{e}.{hint}\n{RUN_USAGE}" if hint else f"{e}\n{RUN_USAGE}") from None
        if isinstance(e, (AttributeError, KeyError, TypeError, ValueError)):
            raise UsageError(f"cannot apply the command line to the config: {e}\n{RUN_USAGE}") from None
        raise
    if len(rest) > 1:
        names = [os.path.splitext(f)[0] for f in config_files()]
        hint = f" (a config: --config {_shown(os.path.join(CONFIG_DIR, rest[1] + '.py'))})" if rest[1] in names else ""
        raise UsageError(
            f"unexpected argument {rest[1]!r}{hint}; every argument is a flag (--name=value).\n{RUN_USAGE}"
        )
    if fv["config"].value is None:
        raise UsageError(f"--config is required.\n{RUN_USAGE}")
    if not workdir_flag.value:
        raise UsageError(f"--workdir is required.\n{RUN_USAGE}")
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
    notices = core_schema.fit_to_steps(config)
    if notices and config.mesh.get("process_id", 0) == 0:
        for notice in notices:
            print(f"note: {notice}", flush=True)
    return config, workdir_flag.value
