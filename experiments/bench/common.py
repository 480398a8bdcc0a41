"""What every benchmark script shares: median timers, a description of the machine, writing the results."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable

import jax
import numpy as np


def median_seconds(call: Callable[[], object], *, repeats: int, warmup: int = 1) -> float:
    """Median seconds of `call()` (whose result is blocked on) over `repeats` calls after `warmup` calls."""
    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def interleaved_medians(calls: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each call, timed in rounds (one call of each per round) so that slow drifts of a shared
    machine's speed hit every candidate alike: the ratios are what such a benchmark reports."""
    for call in calls.values():
        for _ in range(warmup):
            jax.block_until_ready(call())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def machine() -> dict:
    """Device kind, platform, device and core counts, jax version, and a note for CPU-only runs."""
    device = jax.devices()[0]
    return {
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
    """One line for a results table: the device, its platform and cores, and the CPU-run note."""
    return f"{m['device']} ({m['platform']}, {m['cpu_count']} cores). {m['note']}".rstrip()


def write_results(out_dir: str, name: str, result: dict, markdown: Callable[[dict], str]) -> None:
    """Writes `<out_dir>/<name>.json` and `<name>.md` (the table `markdown(result)`), and prints the table."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    table = markdown(result)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table)
    print(table)
