"""What the reproduction scripts share: one training run per configuration, each `python -m experiments.run` in its
own process (so every run gets its own virtual device count), reused when it already finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["ROOT", "config_path", "read_metric", "run_or_reuse"]


def config_path(name: str) -> str:
    return os.path.join(ROOT, "experiments", "configs", f"{name}.py")


def run_or_reuse(config: str, workdir: str, flags: list[str], steps: int, *, devices: int = 1) -> dict:
    """Trains (or resumes) `config` with `flags` in `workdir` unless a finished run of `steps` steps is there;
    returns its summary.json. A failed run raises with the command and the tail of its output."""
    path = os.path.join(workdir, "summary.json")
    if os.path.exists(path):
        with open(path) as f:
            summary = json.load(f)
        if summary["steps"] == steps:
            return summary
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        f"--config={config}",
        f"--workdir={workdir}",
        f"--config.train.steps={steps}",
        *flags,
    ]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    with open(path) as f:
        return json.load(f)


def read_metric(workdir: str, name: str) -> list[tuple[int, float]]:
    """(step, value) of every record of metrics.jsonl that has `name`."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [(r["step"], r[name]) for r in records if name in r]
