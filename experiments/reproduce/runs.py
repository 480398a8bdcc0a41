"""What the reproduction scripts share: one training run per configuration, each `python -m experiments.run` in its
own process (so every run gets its own virtual device count), reused only when a finished run of the very same
configuration is already there. The run's output (its progress bar, held-out evaluations, compile and resume lines)
reaches the terminal as it comes, each line prefixed by the run's name."""

from __future__ import annotations

import codecs
import collections
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["ROOT", "config_path", "launch", "read_metric", "resolved_config", "run_or_reuse", "set_aside"]

# Keys that change what a run shows, not what it computes: a finished run differing only there is reused.
DISPLAY_ONLY = {("train", "progress")}
PROGRESS_EVERY = 15.0  # seconds between two forwarded progress-bar states of one run
_print_lock = threading.Lock()  # one whole line at a time when runs go in parallel (reproduce.ufp4 --jobs)


def config_path(name: str) -> str:
    """The path of experiments/configs/<name>.py."""
    return os.path.join(ROOT, "experiments", "configs", f"{name}.py")


def _run_args(config: str, workdir: str, flags: list[str], steps: int) -> list[str]:
    """The command-line arguments of `python -m experiments.run` for this run (after the program name)."""
    return [f"--config={config}", f"--workdir={workdir}", f"--config.train.steps={steps}", *flags]


def resolved_config(config: str, flags: list[str], steps: int) -> dict:
    """The config `python -m experiments.run --config=<config> --config.train.steps=<steps> <flags>` trains, as its
    workdir's config.json holds it: resolved by `experiments.args.parse_run_args` in this process (so a bad flag
    raises `experiments.args.UsageError` here, before anything runs) and passed through JSON the way
    experiments.load.write_records writes it (tuples become lists, other non-JSON values their str)."""
    from experiments import args

    resolved, _ = args.parse_run_args(["experiments.run", *_run_args(config, "unused", flags, steps)])
    return json.loads(json.dumps(resolved.to_dict(), default=str))


def _differences(old: dict | None, new: dict, prefix: str = "") -> list[str]:
    """'section.key: old -> new' for every key whose value differs (missing keys shown as <absent>)."""
    if old is None:
        return ["config.json: <absent>"]
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def set_aside(workdir: str, why: list[str]) -> str:
    """Renames `workdir` to the first free `<workdir>.stale-<n>` (n = 1, 2, ...) and says so; returns the new name."""
    n = 1
    while os.path.exists(f"{workdir}.stale-{n}"):
        n += 1
    stale = f"{workdir}.stale-{n}"
    os.rename(workdir, stale)
    shown = "; ".join(why[:5]) + (f"; and {len(why) - 5} more" if len(why) > 5 else "")
    print(f"{workdir} holds a run of another configuration ({shown}): moved to {stale}, starting afresh", flush=True)
    return stale


def _comparable(config: dict | None) -> dict | None:
    """`config` (a resolved config as config.json holds it) without the DISPLAY_ONLY keys, and without the keys added
    since runs were written (`since_checkpoints`) at their default: a run written before such a key existed still
    matches."""
    from core import schema as schema_lib  # (imported where used: this module stays light)
    from experiments import schema

    if config is None:
        return None
    rules = schema.schema()
    out = {
        section: schema_lib.without_new_defaults(values, rules.get(section, {})) if isinstance(values, dict) else values
        for section, values in config.items()
    }
    for section, key in DISPLAY_ONLY:
        if isinstance(out.get(section), dict):
            out[section].pop(key, None)
    return out


def launch(cmd: list[str], *, env: dict[str, str], cwd: str, label: str) -> tuple[int, list[str]]:
    """Runs `cmd` (stdout and stderr merged, Python unbuffered) and forwards its output to this process's stdout as
    it comes, every line as `[label] line`: each line ended by a newline, and of the states a progress bar draws
    (tqdm rewrites its line, each state led by a carriage return) the first, then at most one per `PROGRESS_EVERY`
    seconds (the bar's final state ends with a newline, so it is always shown). Blank lines and the blanks tqdm
    writes to clear its bar are dropped. The process is killed if this one stops forwarding (e.g. Ctrl-C).
    Returns (its exit status, its last 200 lines)."""
    tail: collections.deque[str] = collections.deque(maxlen=200)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    piece = re.compile(r"([^\r\n]*)(\r\n|\n|\r(?!$))")  # a "\r" at the very end may be half of a "\r\n"
    last_state = -float("inf")

    def show(text: str) -> None:
        tail.append(text)
        with _print_lock:
            print(f"[{label}] {text}", flush=True)

    proc = subprocess.Popen(
        cmd, cwd=cwd, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    stream = proc.stdout
    assert isinstance(stream, io.BufferedReader)  # Popen's default buffering: read1 returns what is there
    buffer = ""
    try:
        while chunk := stream.read1(1 << 16):
            buffer += decoder.decode(chunk)
            end = 0
            for m in piece.finditer(buffer):
                end = m.end()
                text, sep = m.group(1).rstrip(), m.group(2)
                if not text.strip():
                    continue
                if sep != "\r":
                    show(text)
                elif time.monotonic() - last_state >= PROGRESS_EVERY:
                    last_state = time.monotonic()
                    show(text)
            buffer = buffer[end:]
        buffer += decoder.decode(b"", final=True)
        if buffer.strip():
            show(buffer.strip())
        return proc.wait(), list(tail)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_or_reuse(
    config: str,
    workdir: str,
    flags: list[str],
    steps: int,
    *,
    devices: int = 1,
    command: Callable[[list[str]], list[str]] | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """Trains `config` with `flags` for `steps` steps in `workdir` and returns its summary.json.

    What is already in `workdir` is used only if its config.json (the resolved config experiments.run wrote)
    equals the config this call resolves (`resolved_config`: the config file, `flags` and `steps`; keys in
    DISPLAY_ONLY aside): then a finished run (summary.json present) is returned as it is, and an interrupted one
    is resumed from its last checkpoint. Any other non-empty `workdir` (config.json different or missing) is
    renamed to `<workdir>.stale-<n>` (nothing is deleted) and the run starts afresh there, so results of two
    configurations never mix. The run's output reaches stdout as it comes, prefixed by `[<workdir's name>]`
    (`launch`). A failed run raises with the command and the tail of its output.
    `command` maps experiments.run's arguments to the command that runs them (default: `python -m experiments.run
    <arguments>` with `devices` virtual CPU devices), e.g. an `experiments.launch` of several processes; `env` adds
    to its environment (its XLA_FLAGS follow the device count's).
    """
    workdir = os.path.abspath(workdir)  # the run's process works in ROOT: one meaning of a relative path for both
    label = os.path.basename(workdir)
    wanted = resolved_config(config, flags, steps)
    summary_path = os.path.join(workdir, "summary.json")
    if os.path.isdir(workdir) and os.listdir(workdir):
        found = None
        if os.path.exists(os.path.join(workdir, "config.json")):
            with open(os.path.join(workdir, "config.json")) as f:
                found = json.load(f)
        if _comparable(found) == _comparable(wanted):
            if os.path.exists(summary_path):
                print(f"[{label}] finished before: reusing {workdir}", flush=True)
                with open(summary_path) as f:
                    return json.load(f)
        else:
            set_aside(workdir, _differences(_comparable(found), _comparable(wanted) or {}))
    extra = dict(env or {})
    xla_flags = f"--xla_force_host_platform_device_count={devices} {extra.pop('XLA_FLAGS', '')}".strip()
    environment = {**os.environ, **extra, "XLA_FLAGS": xla_flags}
    args = _run_args(config, workdir, flags, steps)
    cmd = [sys.executable, "-m", "experiments.run", *args] if command is None else command(args)
    code, tail = launch(cmd, env=environment, cwd=ROOT, label=label)
    if code != 0:
        shown = "\n".join(tail[-40:])
        raise RuntimeError(f"run failed with exit status {code} ({' '.join(cmd)}); its last lines:\n{shown}")
    with open(summary_path) as f:
        return json.load(f)


def read_metric(workdir: str, name: str) -> list[tuple[int, float]]:
    """(step, value) of every record of metrics.jsonl that has `name`."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [(r["step"], r[name]) for r in records if name in r]
