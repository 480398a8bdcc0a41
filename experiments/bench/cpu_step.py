"""Where a train step's time goes on XLA:CPU, and which XLA:CPU options change it, side by side in one run.

    python -m experiments.bench.cpu_step [--models qwen3,qwen3_moe] [--repeats 15] [--out runs/bench]

For each model of `experiments.bench.peer` (quickstart size, float32, one device), the training loop's jitted step
(`core.train.make_train_step`):
  * options: the same step compiled under each of `OPTIONS` (XLA debug options passed to this compilation only),
    timed interleaved (one call of each per round, `--repeats` rounds, medians), with each one's first loss, so
    that an option that changed the numbers would show;
  * allocator: the step timed in a fresh process as this project runs it (`core.host_memory` applied) and in one
    with LOWBIT_HOST_MALLOC=system (glibc's default: an mmap of the step's temporary buffer on every call), with
    the compiled step's temporary buffer size;
  * profile: one trace of 5 steps (`jax.profiler`, XLA:CPU's per-operation events), the time of every operation
    summed by what it computes (its op_name without numbers), the top rows. Operations inside loops are counted
    once per iteration, their loop once more: the loops' rows are listed apart.
Writes cpu_step.json and cpu_step.md into `--out` (`--out results/bench` for the tables docs/performance.md quotes).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from experiments import command, harness

OPTIONS = {
    "default": {},
    "no YNNPACK fusions": {"xla_cpu_experimental_ynn_fusion_type": ""},
    "YNNPACK for dots only": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "no XNNPACK": {"xla_cpu_use_xnnpack": False},
    "oneDNN": {"xla_cpu_use_onednn": True},
    "no fusion emitters": {"xla_cpu_use_fusion_emitters": False},
    "concurrency-optimized scheduler": {"xla_cpu_enable_concurrency_optimized_scheduler": True},
}


def built(model: str):
    """(jitted train step fn, state, tokens [8, 257]) of `model` at the quickstart size, on one device."""
    import jax

    from core import train as train_lib
    from experiments.bench import peer

    config = peer.config_for(model, "quickstart")
    graphdef, state, optimizer = harness.one_device_state(config)
    tokens = np.random.default_rng(0).integers(0, 256, (config.data.batch_size, config.data.seq_len + 1))
    return jax.jit(train_lib.train_step_fn(graphdef, optimizer)), state, tokens.astype(np.int32)


def options(step, state, tokens, repeats: int) -> tuple[dict, object]:
    """({option set: {"seconds", "loss"}} of the step compiled under each of OPTIONS, timed interleaved; the step
    compiled with XLA's defaults)."""
    lowered = step.lower(state, tokens)
    harness.compiling(f"the step under {len(OPTIONS)} option sets")
    compiled = {
        name: lowered.compile(compiler_options=opts) if opts else lowered.compile() for name, opts in OPTIONS.items()
    }
    losses = {name: float(fn(state, tokens)[1]["loss"]) for name, fn in compiled.items()}
    calls = {name: (lambda fn=fn: fn(state, tokens)[1]) for name, fn in compiled.items()}
    seconds = harness.interleaved_medians(calls, repeats=repeats, warmup=1)
    return {name: {"seconds": seconds[name], "loss": losses[name]} for name in OPTIONS}, compiled["default"]


_ALLOCATOR_PROBE = """
import sys, time, json
import numpy as np
from core import host_memory
host_memory.keep_freed_memory()  # as the commands apply it (LOWBIT_HOST_MALLOC=system: nothing)
import jax
from experiments.bench import cpu_step
step, state, tokens = cpu_step.built(sys.argv[1])
compiled = step.lower(state, tokens).compile()
for _ in range(2):
    jax.block_until_ready(compiled(state, tokens))
times = []
for _ in range(int(sys.argv[2])):
    start = time.perf_counter()
    jax.block_until_ready(compiled(state, tokens))
    times.append(time.perf_counter() - start)
print(json.dumps({"seconds": float(np.median(times)), "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}))
"""


def allocator(model: str, repeats: int) -> dict:
    """{"kept" | "system": {"seconds", "temp_bytes"}}: the step in fresh processes with and without core.host_memory,
    alternated twice (each value the median of its two processes' medians)."""
    from core import host_memory

    runs: dict[str, list[dict]] = {"kept": [], "system": []}
    for _ in range(2):
        for name in runs:
            env = {**os.environ, host_memory.ENV: "keep" if name == "kept" else "system"}
            cmd = [sys.executable, "-c", _ALLOCATOR_PROBE, model, str(repeats)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {
        name: {"seconds": float(np.median([r["seconds"] for r in rs])), "temp_bytes": rs[0]["temp_bytes"]}
        for name, rs in runs.items()
    }


def profile(compiled, state, tokens, top: int = 12, steps: int = 5) -> dict:
    """The compiled step's operations from one jax.profiler trace: ms per step summed by op_name, loops apart."""
    import jax

    op_names = {}
    for line in compiled.as_text().splitlines():
        found = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*?op_name=\"([^\"]*)\"", line)
        if found:
            op_names[found.group(1)] = re.sub(r"\d+", "N", found.group(2))
    jax.block_until_ready(compiled(state, tokens))
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        start = time.perf_counter()
        for _ in range(steps):
            jax.block_until_ready(compiled(state, tokens))
        traced = (time.perf_counter() - start) / steps
        jax.profiler.stop_trace()
        with gzip.open(glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)[0]) as f:
            events = json.load(f)["traceEvents"]
    by_op: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and e.get("name") in op_names:
            by_op[op_names[e["name"]]] += e["dur"] / steps / 1e3
    rows = sorted(by_op.items(), key=lambda kv: -kv[1])
    loops = [(name, ms) for name, ms in rows if name.endswith("/while")]
    rows = [(name, ms) for name, ms in rows if not name.endswith("/while")]
    return {"traced_step_ms": 1e3 * traced, "top": rows[:top], "loops": loops}


def markdown(result: dict) -> str:
    """cpu_step.md: per model, the option table, the allocator rows and the profile's top operations."""
    lines = [
        "# A train step on XLA:CPU: options, allocator, where the time goes",
        "",
        f"`{result['command']}`: quickstart-size models of experiments.bench.peer, float32, batch 8 x 256.",
    ]
    for model, r in result["models"].items():
        base = r["options"]["default"]["seconds"]
        lines += ["", f"## {model}", "", "| XLA:CPU option | step ms | / default | first loss |", "|---|---|---|---|"]
        for name, o in r["options"].items():
            lines.append(f"| {name} | {1e3 * o['seconds']:.1f} | {o['seconds'] / base:.2f}x | {o['loss']:.6f} |")
        kept, system = r["allocator"]["kept"], r["allocator"]["system"]
        lines += [
            "",
            f"Allocator (fresh processes): step {1e3 * kept['seconds']:.1f} ms with core.host_memory, "
            f"{1e3 * system['seconds']:.1f} ms with glibc's default ({system['seconds'] / kept['seconds']:.2f}x); "
            f"the step's temporary buffer is {kept['temp_bytes'] / 2**20:.1f} MiB.",
            "",
            f"Profile (XLA:CPU's per-operation trace; the traced step took {r['profile']['traced_step_ms']:.0f} ms):",
            "",
            "| operation (op_name) | ms per step |",
            "|---|---|",
        ]
        lines += [f"| `{name}` | {ms:.2f} |" for name, ms in r["profile"]["top"]]
        lines += [
            f"| loop `{name}` (its body's operations included above) | {ms:.2f} |" for name, ms in r["profile"]["loops"]
        ]
        lines += ["", f"Load average (1 min) after {model}'s measurements: {r['load_after']:.1f}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    from experiments.bench import peer

    study = harness.Study(__doc__, module="experiments.bench.cpu_step", topic="bench", repeats=15)
    study.parser.add_argument(
        "--models",
        type=harness.names(peer.MODELS),
        default=",".join(peer.MODELS),
        help=f"a subset of {list(peer.MODELS)}",
    )
    args = study.parse(argv)
    models: dict[str, dict[str, Any]] = {}
    n = 3 * len(args.models)
    for i, model in enumerate(args.models):
        step, state, tokens = built(model)
        study.progress(3 * i + 1, n, f"{model}: XLA:CPU options")
        table, compiled = options(step, state, tokens, args.repeats)
        models[model] = {"options": table}
        study.progress(3 * i + 2, n, f"{model}: allocator")
        models[model]["allocator"] = allocator(model, args.repeats)
        study.progress(3 * i + 3, n, f"{model}: profile")
        models[model]["profile"] = profile(compiled, state, tokens)
        models[model]["load_after"] = os.getloadavg()[0]
    study.write("cpu_step", {"models": models}, markdown)


if __name__ == "__main__":
    command.run(main)
