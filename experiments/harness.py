"""The research harness: what every benchmark (experiments/bench) and reproduction (experiments/reproduce) runs
through, so that each script keeps only its science.

A script builds a `Study` from its docstring (usage, description, `--out`, and `--repeats` for a benchmark), adds its
own flags (`add_steps`, `add_seeds`, `add_parts`, or plain argparse with the flag types `integer`, `number`,
`integers`, `names`, the commands' own from experiments.args), parses, reports progress with `Study.progress`, and
hands each result to `Study.write`. That writes `<name>.json` and `<name>.md` and the result's plots, every one
stating the same record: the command line that reproduces it (`command`: it parses back to the same arguments),
the machine (CPU model, cores, device, jax; `machine`), and the load average when the script started and when the
result was written. Timers: `median_seconds`, and `interleaved_medians` for side-by-side ratios.

Every script writes under `runs/<topic>/` (git-ignored) unless told `--out`: `--out results/<topic>` replaces the
reference tables and plots the README quotes, so a quick trial never overwrites them."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

import jax
import numpy as np

from experiments.args import HelpFormatter, integer, integers, names, number

__all__ = [
    "Study",
    "add_parts",
    "add_seeds",
    "add_steps",
    "command",
    "compiling",
    "cpu_model",
    "describe",
    "first_paragraph",
    "footer",
    "integer",
    "integers",
    "interleaved_medians",
    "machine",
    "median_seconds",
    "names",
    "number",
    "one_device_state",
    "parser",
]

K = TypeVar("K", bound=Hashable)


def compiling(what: str) -> None:
    """Prints "compiling <what> ..." (flushed): the line a script shows before a first call that compiles, so a
    long silence reads as work, not as a hang."""
    print(f"compiling {what} ...", flush=True)


def one_device_state(config):
    """(graphdef, train state, optimizer) of an experiment config's model and optimizer on this process's devices
    (the config validated first; parameters from seed 0): what a benchmark of one model's step starts from."""
    from core import train as train_lib
    from experiments import build, schema

    schema.validate(config, num_devices=jax.device_count())
    _, sharder = build.build_mesh(config)
    optimizer = build.build_optimizer(config)
    graphdef, state = train_lib.init_state(build.build_model_fn(config, sharder), optimizer, 0, sharder)
    return graphdef, state, optimizer


def median_seconds(call: Callable[[], object], *, repeats: int, warmup: int = 1, what: str | None = None) -> float:
    """Median seconds of `call()` (whose result is blocked on) over `repeats` calls after `warmup` calls (the first
    of which compiles: "compiling <what> ..." is printed before them when `what` is given)."""
    if what is not None and warmup:
        compiling(what)
    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def interleaved_medians(
    calls: Mapping[K, Callable[[], object]], *, repeats: int, warmup: int = 1, what: str | None = None
) -> dict[K, float]:
    """Median seconds of each call, timed in rounds (one call of each per round) so that slow drifts of a shared
    machine's speed hit every candidate alike: the ratios are what such a benchmark reports. The `warmup` calls
    of each come first (they compile: "compiling <what> (<n> programs) ..." is printed before them when `what` is
    given)."""
    if what is not None and warmup:
        compiling(f"{what} ({len(calls)} programs)")
    for call in calls.values():
        for _ in range(warmup):
            jax.block_until_ready(call())
    times: dict[K, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def cpu_model() -> str:
    """The host CPU's model name ("AMD EPYC 7B13", "Intel(R) Xeon(R) CPU @ 2.20GHz"): /proc/cpuinfo's first
    `model name` on Linux, else what the platform module says ("" when nothing does)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine() -> dict:
    """The host CPU's model, device kind, platform, device and core counts, jax version, and a note for CPU-only
    runs."""
    device = jax.devices()[0]
    return {
        "cpu_model": cpu_model(),
        "device": device.device_kind,
        "platform": device.platform,
        "num_devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "jax": jax.__version__,
        "note": (
            "CPU run: measured on this machine's cores; GPU numbers need a GPU run." if device.platform == "cpu" else ""
        ),
    }


def describe(m: dict) -> str:
    """One line for a results table: the CPU model, the device, its platform and cores, and the CPU-run note."""
    where = f"{m['cpu_model']}, " if m.get("cpu_model") else ""
    return f"{m['device']} ({where}{m['platform']}, {m['cpu_count']} cores). {m['note']}".rstrip()


# ------------------------------------------------------------------------------------------------ command line


def first_paragraph(doc: str) -> str:
    """The first paragraph of a docstring (up to its first blank line), its lines joined by single spaces."""
    paragraph = doc.strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def parser(doc: str, *, module: str, topic: str, repeats: int | None = None) -> argparse.ArgumentParser:
    """The argument parser every script starts from: usage as `python -m <module>`, `doc`'s first paragraph as the
    description, every flag's default shown in --help, `--out` (the output directory: `runs/<topic>` by default,
    `results/<topic>` for the committed tables) and, for a benchmark, `--repeats` (timed rounds per measurement,
    default `repeats`)."""
    p = argparse.ArgumentParser(
        prog=f"python -m {module}", description=first_paragraph(doc), formatter_class=HelpFormatter
    )
    p.add_argument(
        "--out",
        default=f"runs/{topic}",
        help=f"output directory (created if missing; files in it are overwritten). The default is git-ignored; "
        f"`--out results/{topic}` replaces the committed reference tables and plots the README quotes",
    )
    if repeats is not None:
        p.add_argument(
            "--repeats",
            type=integer(1),
            default=repeats,
            help="timed rounds per measurement, an integer >= 1; the median is reported",
        )
    return p


def command(
    p: argparse.ArgumentParser, args: argparse.Namespace, *, always: Sequence[str] = ("steps", "seeds"), **overrides
) -> str:
    """The command line that gives `args` under the parser `p`, as a results table states it: `p.prog`, then
    `--out` and every flag whose value differs from its default (flags named in `always`, by dest, even at their
    default), in the parser's order. `overrides` (by dest) replace values of `args`: e.g. `parts=["grid"]` for the
    part of a script that wrote a given table. Lists are written comma-separated, switches bare."""
    words = [p.prog]
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = overrides.get(action.dest, getattr(args, action.dest))
        default = action.default
        if isinstance(default, str) and action.type is not None and callable(action.type):
            default = action.type(default)
        if action.nargs == 0:  # a switch: written bare when set
            if value and value != default:
                words.append(action.option_strings[-1])
            continue
        if action.dest != "out" and action.dest not in always and value == default:
            continue
        text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        words += [action.option_strings[-1], text]
    return " ".join(words)


def add_steps(p: argparse.ArgumentParser, *, default: int, multiple_of: int, why: str) -> None:
    """`--steps` of a reproduction: the training steps of every run, a positive multiple of `multiple_of` (`why`
    says what makes that the rule)."""
    p.add_argument(
        "--steps",
        type=integer(multiple_of, multiple_of=multiple_of),
        default=default,
        help=f"training steps of every run: a multiple of {multiple_of} ({why.replace('%', '%%')}), >= {multiple_of}",
    )


def add_seeds(p: argparse.ArgumentParser, *, default: str, what: str, at_least: int = 1) -> None:
    """`--seeds` of a reproduction: comma-separated distinct integers >= 0, at least `at_least` of them (refused
    by argparse otherwise, naming the flag); `what` says what a seed sets."""

    def parse(text: str) -> list[int]:
        seeds = integers(0, distinct=True)(text)
        if len(seeds) < at_least:
            raise argparse.ArgumentTypeError(f"{text!r}: at least {at_least} seeds")
        return seeds

    more = f", at least {at_least}" if at_least > 1 else ""
    p.add_argument(
        "--seeds", type=parse, default=default, help=f"seeds ({what}): comma-separated distinct integers >= 0{more}"
    )


def add_parts(p: argparse.ArgumentParser, parts: Sequence[str]) -> None:
    """`--parts` of a reproduction made of parts: a comma-separated subset of `parts` (default: all of them)."""
    p.add_argument(
        "--parts",
        type=names(parts),
        default=",".join(parts),
        help=f"what to run: a comma-separated subset of {list(parts)}",
    )


# ------------------------------------------------------------------------------------------------------- a run


class Study:
    """One run of a benchmark or reproduction script: its command line and the record its outputs carry.

    `Study(__doc__, module=..., topic=..., repeats=...)` builds the parser (`parser`); the script adds its flags to
    `study.parser` (or with `add_steps`, `add_seeds`, `add_parts`), then `args = study.parse(argv)`. `parse` notes
    the time and the load average; `path` and `write` create `--out` when first used. `progress(i, n, what)` prints
    "[i/n] what (m.m min so far)". `write(name, result, markdown, plots)` writes the outputs (see `write`) and returns
    the record it wrote."""

    def __init__(self, doc: str, *, module: str, topic: str, repeats: int | None = None):
        self.parser = parser(doc, module=module, topic=topic, repeats=repeats)
        self.args: argparse.Namespace | None = None
        self._started = time.time()
        self._load_before: list[float] = []

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """The parsed arguments (argparse's exit 2, naming the flag, for a bad value)."""
        self.args = self.parser.parse_args(argv)
        self._started, self._load_before = time.time(), [round(x, 2) for x in os.getloadavg()]
        return self.args

    @property
    def out(self) -> str:
        """The output directory (`--out`)."""
        return self._parsed().out

    def path(self, name: str) -> str:
        """`name` inside the output directory (created if missing)."""
        os.makedirs(self.out, exist_ok=True)
        return os.path.join(self.out, name)

    def command(self, *, always: Sequence[str] = ("steps", "seeds"), **overrides) -> str:
        """The command line that gives these arguments (`command`); `overrides` by dest, e.g. `parts=["table"]`
        for the part of the script that wrote a given table."""
        return command(self.parser, self._parsed(), always=always, **overrides)

    def progress(self, i: int, n: int, what: str) -> None:
        """Prints "[i/n] what (m.m min so far)" (flushed): where a long script is, and for how long it has run."""
        print(f"[{i}/{n}] {what} ({(time.time() - self._started) / 60:.1f} min so far)", flush=True)

    def record(self, *, always: Sequence[str] = ("steps", "seeds"), **overrides) -> dict:
        """What every output states: its `command`, the `machine`, and the `load_average` (1, 5, 15 min) when the
        script started and now."""
        return {
            "command": self.command(always=always, **overrides),
            "machine": machine(),
            "load_average": {"before": self._load_before, "after": [round(x, 2) for x in os.getloadavg()]},
        }

    def write(
        self,
        name: str,
        result: Mapping,
        markdown: Callable[[dict], str],
        plots: Mapping[str, Callable[[dict, str], None]] | None = None,
        *,
        always: Sequence[str] = ("steps", "seeds"),
        **overrides,
    ) -> dict:
        """Writes `<out>/<name>.json` (the record, then `result`'s keys), `<name>.md` (`markdown(record)` and a
        last line naming the machine and the load averages) and each plot `plots[file](record, <out>/<file>)`;
        prints the table and the files written; returns the record. `always` and `overrides` go to `command`."""
        record = {**self.record(always=always, **overrides), **result}
        with open(self.path(f"{name}.json"), "w") as f:
            json.dump(record, f, indent=2)
        table = markdown(record).rstrip("\n") + "\n\n" + footer(record) + "\n"
        with open(self.path(f"{name}.md"), "w") as f:
            f.write(table)
        print(table, flush=True)
        for file, plot in (plots or {}).items():
            plot(record, self.path(file))
        print(f"wrote {', '.join(os.path.join(self.out, f) for f in (f'{name}.json', f'{name}.md', *(plots or {})))}")
        return record

    def _parsed(self) -> argparse.Namespace:
        if self.args is None:
            raise RuntimeError("Study.parse(argv) comes before the command, the record and the outputs.")
        return self.args


def footer(record: Mapping) -> str:
    """The line under every table: the CPU and device it ran on, jax's version and the load average (1 min) at the
    start and at the end."""
    m, load = record["machine"], record["load_average"]
    cpu = f"{m['cpu_model']}, " if m.get("cpu_model") else ""
    return (
        f"Ran on {cpu}{m['cpu_count']} cores, device {m['device']} ({m['platform']}), jax {m['jax']}; load average "
        f"(1 min) {load['before'][0]:.2f} at the start, {load['after'][0]:.2f} at the end."
    )
