"""Train-step throughput and achieved FLOP/s against the matmul peak measured in the same run.

    python -m experiments.bench.train_step [--steps 5] [--sizes quickstart,quickstart-dense,large] [--out runs/bench]

For each model size: tokens per second of the jitted train step (forward, backward, AdamW update) and its
achieved FLOP/s, counted two ways: the model FLOPs of the PaLM formula (6 N + 12 L d T per token, N the matmul
parameters a token meets: all 2-D weights, and top_k / num_experts of each MoE layer's [E, d, h] expert
weights) and the FLOPs XLA's cost analysis reports for the compiled step. The peak is a large square
`jnp.dot` in the same dtype, timed in the same process, so the ratio is the fraction of what this machine's
matmul can do. Writes train_step.json and train_step.md into `--out` (`--out results/bench` for the
table docs/cli.md quotes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from core import train as train_lib
from experiments import command, harness
from experiments.configs import quickstart
from experiments.harness import median_seconds

SIZES = {
    # name: overrides of the quickstart config (experiments/configs/quickstart.py)
    "quickstart": {},
    "quickstart-dense": {"moe": dict(every=0)},
    "large": {
        "model": dict(d_model=512, num_layers=8, num_heads=8, num_kv_heads=8, d_ff=1536),
        "moe": dict(expert_size=512),
        "data": dict(batch_size=16),
    },
}


def matmul_peak(n: int = 2048, dtype=jnp.float32, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n `jnp.dot` (2 n^3 FLOPs)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    dot = jax.jit(jnp.dot)
    return 2 * n**3 / median_seconds(lambda: dot(a, b), repeats=repeats, what=f"the {n}^3 matmul")


def bench_size(name: str, steps: int) -> dict:
    """One size's train step: its median time over `steps` calls, tokens/s, and the model and XLA FLOP counts."""
    c = quickstart.get_config()
    for section, values in SIZES[name].items():
        c[section].update(values)
    c.mesh.update(site=1, data=1)  # one train step of one model (the federation's sites run the same step)
    m = c.model
    d, layers, seq, batch = m.d_model, m.num_layers, c.data.seq_len, c.data.batch_size
    graphdef, state, optimizer = harness.one_device_state(c)
    step = train_lib.make_train_step(graphdef, optimizer)
    tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, 256)
    harness.compiling(f"the {name} train step")
    cost = step.lower(state, tokens).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla_flops: float | None = float(cost.get("flops", float("nan"))) if cost else float("nan")

    def one_step():  # the state is donated, so thread it through
        nonlocal state
        state, metrics = step(state, tokens)
        return metrics

    seconds = median_seconds(one_step, repeats=steps, warmup=2)  # the first call compiles
    leaves, _ = jax.tree_util.tree_flatten_with_path(state.params)
    params = sum(x.size for _, x in leaves)
    # Matmul weights a token meets: every 2-D parameter except an untied embedding table (a lookup, not a
    # product), and the top_k / num_experts share of the 3-D expert weights.
    active_share = c.moe.top_k / c.moe.num_experts
    matmul_params = sum(x.size * active_share for _, x in leaves if x.ndim == 3) + sum(
        x.size
        for path, x in leaves
        if x.ndim == 2 and not ("embedding" in jax.tree_util.keystr(path) and not m.tie_embeddings)
    )
    model_flops = batch * seq * (6 * matmul_params + 12 * layers * d * seq)
    if any(x.ndim == 3 for _, x in leaves):  # XLA's cost analysis counts a loop body once, not per trip
        xla_flops = None
    return {
        "size": name,
        "d_model": d,
        "layers": layers,
        "heads": m.num_heads,
        "kv_heads": m.num_kv_heads,
        "d_ff": m.d_ff,
        "seq_len": seq,
        "batch": batch,
        "params": int(params),
        "step_seconds": seconds,
        "tokens_per_second": batch * seq / seconds,
        "model_flops_per_step": model_flops,
        "xla_flops_per_step": xla_flops,
        "model_flops_per_second": model_flops / seconds,
        "xla_flops_per_second": None if xla_flops is None else xla_flops / seconds,
    }


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.bench.train_step", topic="bench")
    parser = study.parser
    parser.add_argument(
        "--steps", type=harness.integer(1), default=5, help="timed train steps per size, >= 1; the median is reported"
    )
    parser.add_argument(
        "--sizes",
        type=harness.names(SIZES),
        default=",".join(SIZES),
        help=f"model sizes to time: a comma-separated subset of {list(SIZES)}",
    )
    args = study.parse(argv)
    device = jax.devices()[0]
    peak = matmul_peak()
    print(f"matmul peak (2048^3 float32 jnp.dot): {peak / 1e9:.1f} GFLOP/s on {device.device_kind}", flush=True)
    rows = []
    for name in args.sizes:
        row = bench_size(name, args.steps)
        row["model_flops_fraction_of_peak"] = row["model_flops_per_second"] / peak
        xla = row["xla_flops_per_second"]
        row["xla_flops_fraction_of_peak"] = None if xla is None else xla / peak
        rows.append(row)
        print(
            f"{name}: {row['tokens_per_second']:,.0f} tok/s, {row['model_flops_per_second'] / 1e9:.1f} GFLOP/s "
            f"= {100 * row['model_flops_fraction_of_peak']:.1f}% of peak",
            flush=True,
        )
    result = {
        "dtype": "float32",
        "matmul_peak_flops_per_second": peak,
        "rows": rows,
    }
    study.write("train_step", result, markdown)


def markdown(result: dict) -> str:
    """train_step.md: one row per size."""
    lines = [
        "# Train-step throughput",
        "",
        f"`{result['command']}`: train step ({result['dtype']}); matmul peak "
        f"{result['matmul_peak_flops_per_second'] / 1e9:.1f} GFLOP/s (2048^3 jnp.dot, same run).",
        "",
        "| size | params | d_model x layers | batch x seq | step (s) | tokens/s | model GFLOP/s | % of peak "
        "| XLA-counted GFLOP/s | % of peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        xla = (
            "n/a | n/a"
            if r["xla_flops_per_second"] is None
            else f"{r['xla_flops_per_second'] / 1e9:.1f} | {100 * r['xla_flops_fraction_of_peak']:.1f}%"
        )
        lines.append(
            f"| {r['size']} | {r['params'] / 1e6:.2f}M | {r['d_model']} x {r['layers']} | "
            f"{r['batch']} x {r['seq_len']} | {r['step_seconds']:.3f} | {r['tokens_per_second']:,.0f} | "
            f"{r['model_flops_per_second'] / 1e9:.1f} | {100 * r['model_flops_fraction_of_peak']:.1f}% | "
            f"{xla} |"
        )
    lines += [
        "",
        "Model FLOPs count the expert weights a token meets (top_k / num_experts of them). The XLA column "
        "is n/a for MoE models: the CPU grouped matmul is a loop with a data-dependent trip count, which XLA's "
        "cost analysis counts once.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    command.run(main)
