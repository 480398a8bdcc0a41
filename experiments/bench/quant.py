"""4-bit training cost on CPU: train-step time of each quant recipe against unquantised float32 GEMMs (recipe
"none"), and quantiser throughput against the copy bandwidth, side by side in one run.

    python -m experiments.bench.quant [--repeats 5] [--out runs/bench]

Train step: the quickstart MoE model on one device (experiments/configs/quickstart.py with mesh.site = 1; batch
8 x 256, AdamW), one jitted step per recipe (quant.recipes.RECIPES: none = float32 GEMMs, bf16 = bfloat16
operands with float32 accumulation, the 4-bit recipes), median of `--repeats` interleaved rounds; goal UFP4 / none
<= 1.6. The 4-bit recipes emulate 4-bit arithmetic (fake quantisation in float32, then the float32 matmul), so
against "none" this measures the quantisers' overhead, not 4-bit speed. Quantiser: `quant.quantize` of a 4096 x
4096 float32 tensor per format (and with stochastic rounding, and after the RHT), as effective GB/s (4 bytes read +
4 written per entry) against a jitted copy of the same tensor. Writes quant.json and quant.md into `--out`
(`--out results/bench` for the table docs/ufp4.md quotes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from core import train as train_lib
from experiments import command, harness
from experiments.configs import quickstart
from experiments.harness import interleaved_medians
from quant import quantize, recipes, rht

GOAL = {"ufp4": 1.6}


def train_steps(repeats: int) -> dict[str, float]:
    """Median seconds of the quickstart MoE's train step (one device) per recipe, timed in interleaved rounds."""
    calls: dict[str, Callable[[], object]] = {}
    for name in recipes.RECIPES:
        c = quickstart.get_config()
        c.mesh.update(site=1, data=1)
        c.precision.recipe = name
        graphdef, state, optimizer = harness.one_device_state(c)
        step = train_lib.make_train_step(graphdef, optimizer)
        tokens = jax.random.randint(jax.random.key(0), (c.data.batch_size, c.data.seq_len + 1), 0, 256)
        box = {"state": state}

        def call(step=step, box=box, tokens=tokens):
            box["state"], metrics = step(box["state"], tokens)
            return metrics["loss"]

        calls[name] = call
    return interleaved_medians(calls, repeats=repeats, warmup=2, what="a train step per recipe")


def quantisers(repeats: int, n: int = 4096) -> dict[str, float]:
    """Effective GB/s (8 bytes per entry) of each quantiser on an n x n float32 tensor, and of a copy."""
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    key = jax.random.key(1)
    fns = {"copy": jax.jit(lambda v: v * 1.0 + 0.0)}
    for fmt in ("e2m1", "e1m2", "int4", "mxfp4", "nvfp4"):
        fns[fmt] = jax.jit(lambda v, fmt=fmt: quantize(v, fmt))
    fns["e1m2 stochastic"] = jax.jit(lambda v: quantize(v, "e1m2", rounding="stochastic", key=key))
    fns["e1m2 after RHT16"] = jax.jit(lambda v: quantize(rht(v), "e1m2"))
    calls = {k: functools.partial(f, x) for k, f in fns.items()}
    seconds = interleaved_medians(calls, repeats=repeats, warmup=1, what="the quantisers")
    return {k: 2 * 4 * x.size / s / 1e9 for k, s in seconds.items()}  # GB/s


def markdown(result: dict) -> str:
    """quant.md: train-step time per recipe against BF16, and quantiser throughput against the copy."""
    steps, rates = result["train_step_seconds"], result["quantiser_gb_per_s"]
    lines = [
        "# 4-bit training cost on CPU",
        "",
        f"`{result['command']}`: the 4-bit recipes emulate 4-bit GEMMs "
        "(fake quantisation, then float32 matmuls): against none (float32 GEMMs) this is the quantisers' overhead, "
        "not 4-bit speed; bf16 rounds the GEMM operands to bfloat16 (float32 accumulation).",
        "",
        "Train step of the quickstart MoE (one device, batch 8 x 256, AdamW), median of "
        f"{result['repeats']} interleaved rounds:",
        "",
        "| recipe | step (ms) | / none | goal |",
        "|---|---|---|---|",
    ]
    for name, s in steps.items():
        ratio = s / steps["none"]
        goal = f"<= {GOAL[name]} ({'met' if ratio <= GOAL[name] else 'missed'})" if name in GOAL else ""
        lines.append(f"| {name} | {1e3 * s:.1f} | {ratio:.2f}x | {goal} |")
    lines += [
        "",
        "Quantiser throughput on a 4096 x 4096 float32 tensor (GB/s counted as 4 bytes read + 4 written per "
        "entry; copy = the same traffic with no work):",
        "",
        "| quantiser | GB/s | / copy |",
        "|---|---|---|",
    ]
    for name, rate in rates.items():
        lines.append(f"| {name} | {rate:.2f} | {rate / rates['copy']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.bench.quant", topic="bench", repeats=5)
    args = study.parse(argv)
    result = {
        "repeats": args.repeats,
        "train_step_seconds": train_steps(args.repeats),
        "quantiser_gb_per_s": quantisers(args.repeats),
    }
    study.write("quant", result, markdown)


if __name__ == "__main__":
    command.run(main)
