"""What the reproduction scripts share: one training run per configuration, each `python -m experiments.run` in its
own process (so every run gets its own virtual device count), reused only when a finished run of the very same
configuration is already there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["ROOT", "config_path", "read_metric", "resolved_config", "run_or_reuse"]


def config_path(name: str) -> str:
    return os.path.join(ROOT, "experiments", "configs", f"{name}.py")


def _run_args(config: str, workdir: str, flags: list[str], steps: int) -> list[str]:
    """The command-line arguments of `python -m experiments.run` for this run (after the program name)."""
    return [f"--config={config}", f"--workdir={workdir}", f"--config.train.steps={steps}", *flags]


def resolved_config(config: str, flags: list[str], steps: int) -> dict:
    """The config `python -m experiments.run --config=<config> --config.train.steps=<steps> <flags>` trains, as its
    workdir's config.json holds it: resolved by `experiments.run.parse_args` in this process (so a bad flag raises
    `experiments.run.UsageError` here, before anything runs) and passed through JSON the way run.py writes it
    (tuples become lists, other non-JSON values their str)."""
    from experiments import run

    resolved, _ = run.parse_args(["experiments.run", *_run_args(config, "unused", flags, steps)])
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


def _set_aside(workdir: str, why: list[str]) -> str:
    """Renames `workdir` to the first free `<workdir>.stale-<n>` (n = 1, 2, ...) and says so; returns the new name."""
    n = 1
    while os.path.exists(f"{workdir}.stale-{n}"):
        n += 1
    stale = f"{workdir}.stale-{n}"
    os.rename(workdir, stale)
    shown = "; ".join(why[:5]) + (f"; and {len(why) - 5} more" if len(why) > 5 else "")
    print(f"{workdir} holds a run of another configuration ({shown}): moved to {stale}, starting afresh", flush=True)
    return stale


def run_or_reuse(config: str, workdir: str, flags: list[str], steps: int, *, devices: int = 1) -> dict:
    """Trains `config` with `flags` for `steps` steps in `workdir` and returns its summary.json.

    What is already in `workdir` is used only if its config.json (the resolved config experiments.run wrote)
    equals the config this call resolves (`resolved_config`: the config file, `flags` and `steps`): then a
    finished run (summary.json present) is returned as it is, and an interrupted one is resumed from its last
    checkpoint. Any other non-empty `workdir` (config.json different or missing) is renamed to
    `<workdir>.stale-<n>` (nothing is deleted) and the run starts afresh there, so results of two configurations
    never mix. A failed run raises with the command and the tail of its output.
    """
    workdir = os.path.abspath(workdir)  # the run's process works in ROOT: one meaning of a relative path for both
    wanted = resolved_config(config, flags, steps)
    summary_path = os.path.join(workdir, "summary.json")
    if os.path.isdir(workdir) and os.listdir(workdir):
        found = None
        if os.path.exists(os.path.join(workdir, "config.json")):
            with open(os.path.join(workdir, "config.json")) as f:
                found = json.load(f)
        if found == wanted:
            if os.path.exists(summary_path):
                with open(summary_path) as f:
                    return json.load(f)
        else:
            _set_aside(workdir, _differences(found, wanted))
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    cmd = [sys.executable, "-m", "experiments.run", *_run_args(config, workdir, flags, steps)]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    with open(summary_path) as f:
        return json.load(f)


def read_metric(workdir: str, name: str) -> list[tuple[int, float]]:
    """(step, value) of every record of metrics.jsonl that has `name`."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [(r["step"], r[name]) for r in records if name in r]
