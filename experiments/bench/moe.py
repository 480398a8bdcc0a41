"""MoE layer forward+backward time against a dense FFN of the same active FLOPs, side by side in one run.

    python -m experiments.bench.moe [--tokens 4096] [--repeats 5] [--expert-sizes 128,512] [--out runs/bench]

For E in {8, 32, 64} experts, k in {1, 2, 4} and each expert size h (128 is FoMoE's; 512 the output width of the
grouped-matmul shape below): the MoE layer (d_model 256, sigmoid router) with dropless dispatch (sort + the
backend's grouped matmul) and with capacity dispatch (GShard einsum, one group per sequence, capacity factor 1.25),
against a dense SiLU FFN of hidden width k x h, which does the same expert FLOPs per token (the MoE also pays its
router, d_model x E per token). Time = jitted gradient of a scalar of the output with respect to
the input and all weights (forward + backward). Also times the grouped matmul alone, every implementation, on
4096 x 256 -> 512 in 64 equal groups against one dense product of the same FLOPs.
Writes moe.json and moe.md into `--out` (`--out results/bench` for the table docs/fomoe.md quotes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from core.mesh import Sharder
from core.model import MLP, DefaultPrecision, TransformerConfig, split_params
from experiments import command, harness
from experiments.harness import interleaved_medians, median_seconds
from moe import MoE, MoEConfig
from moe.grouped_matmul import grouped_matmul

EXPERTS, TOP_K = (8, 32, 64), (1, 2, 4)
D_MODEL, SEQ = 256, 256


def _fwd_bwd(module: nnx.Module, x: jax.Array):
    """A call of the jitted gradient of sum(module(x) * a fixed random cotangent) with respect to the module's
    parameters and x: one forward and backward of the layer."""
    graphdef, params, rest = split_params(module)
    cotangent = jax.random.normal(jax.random.key(7), x.shape, x.dtype)

    @jax.jit
    def grads(params, x):
        loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p, rest)(x)[0] * cotangent)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1))(params, x)

    return lambda: grads(params, x)


def bench_layers(tokens: int, expert_size: int, repeats: int) -> list[dict]:
    """Per (top-k, experts): the dense FFN, dropless and capacity MoE layers timed side by side; one row each."""
    cfg = TransformerConfig(d_model=D_MODEL, num_layers=4, mlp="silu")
    x = jax.random.normal(jax.random.key(0), (tokens // SEQ, SEQ, D_MODEL), jnp.float32)
    rows = []
    for k in TOP_K:
        dense = MLP(
            TransformerConfig(d_model=D_MODEL, num_layers=4, mlp="silu", d_ff=k * expert_size),
            path="ffn",
            precision=DefaultPrecision(),
            shard=Sharder(),
            rngs=nnx.Rngs(0),
        )
        for e in EXPERTS:
            calls = {"dense": _fwd_bwd(dense, x)}
            for dispatch in ("dropless", "capacity"):
                layer = MoE.in_transformer(
                    cfg,
                    MoEConfig(num_experts=e, top_k=k, expert_size=expert_size, dispatch=dispatch),
                    path="ffn",
                    rngs=nnx.Rngs(0),
                )
                calls[dispatch] = _fwd_bwd(layer, x)
            t = interleaved_medians(
                calls, repeats=repeats, what=f"dense / dropless / capacity at h={expert_size} E={e} k={k}"
            )
            row = {
                "experts": e,
                "top_k": k,
                "expert_size": expert_size,
                "tokens": tokens,
                **{f"{name}_seconds": v for name, v in t.items()},
                "dropless_over_dense": t["dropless"] / t["dense"],
                "capacity_over_dropless": t["capacity"] / t["dropless"],
            }
            rows.append(row)
            print(
                f"h={expert_size} E={e:2d} k={k}: dense {t['dense'] * 1e3:7.1f} ms  dropless "
                f"{t['dropless'] * 1e3:7.1f} ms ({row['dropless_over_dense']:.2f}x dense)  capacity "
                f"{t['capacity'] * 1e3:7.1f} ms ({row['capacity_over_dropless']:.2f}x dropless)",
                flush=True,
            )
    return rows


def bench_grouped_matmul(repeats: int) -> list[dict]:
    """The grouped-matmul shape: 4096 rows x 256 -> 512 in 64 equal groups; forward and forward+backward."""
    m, k, n, g = 4096, 256, 512, 64
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (g, k, n), jnp.float32)
    sizes = jnp.full((g,), m // g, jnp.int32)
    candidates = {
        "windowed": lambda x, w: grouped_matmul(x, w, sizes, implementation="windowed"),
        "ragged_dot": lambda x, w: grouped_matmul(x, w, sizes, implementation="ragged_dot"),
        "batched": lambda x, w: grouped_matmul(x, w, sizes, implementation="batched"),
        "batched einsum (equal groups only)": lambda x, w: jnp.einsum(
            "gmk,gkn->gmn", x.reshape(g, m // g, k), w
        ).reshape(m, n),
        "dense product (same FLOPs)": lambda x, w: x @ w[0],
    }
    calls: dict[tuple[str, str], Callable[[], object]] = {}
    for name, fn in candidates.items():
        if name == "ragged_dot" and jax.default_backend() == "cpu":
            continue  # far slower on CPU (a generic loop): timed once below, outside the rounds
        fwd = jax.jit(fn)
        bwd = jax.jit(jax.grad(lambda x, w, fn=fn: jnp.sum(fn(x, w) ** 2), argnums=(0, 1)))
        calls[(name, "forward")] = functools.partial(fwd, x, w)
        calls[(name, "forward_backward")] = functools.partial(bwd, x, w)
    times = interleaved_medians(calls, repeats=repeats, what="the grouped matmuls")
    if jax.default_backend() == "cpu":
        fn = candidates["ragged_dot"]
        fwd, bwd = jax.jit(fn), jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w) ** 2), argnums=(0, 1)))
        times[("ragged_dot", "forward")] = median_seconds(lambda: fwd(x, w), repeats=1, what="ragged_dot forward")
        times[("ragged_dot", "forward_backward")] = median_seconds(
            lambda: bwd(x, w), repeats=1, what="ragged_dot forward + backward"
        )
    rows = []
    for name in candidates:
        row: dict[str, Any] = {
            "implementation": name,
            "forward_seconds": times[(name, "forward")],
            "forward_backward_seconds": times[(name, "forward_backward")],
        }
        rows.append(row)
        print(
            f"grouped matmul {name}: fwd {row['forward_seconds'] * 1e3:.1f} ms, fwd+bwd "
            f"{row['forward_backward_seconds'] * 1e3:.1f} ms",
            flush=True,
        )
    return rows


def markdown(result: dict) -> str:
    """moe.md: the layer table and the grouped-matmul table."""
    lines = [
        "# MoE layer forward+backward against a dense FFN",
        "",
        f"`{result['command']}`: MoE layer forward+backward (float32): {result['tokens']} tokens, d_model "
        f"{D_MODEL}, sigmoid router; dense = SiLU FFN of hidden k x h (same expert FLOPs); capacity factor 1.25, "
        "one group per sequence of 256. Medians of "
        f"{result['repeats']} rounds; each round times the three side by side.",
        "",
        "| expert size h | experts | top-k | dense (ms) | dropless (ms) | capacity (ms) | dropless / dense | "
        "capacity / dropless |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["layers"]:
        lines.append(
            f"| {r['expert_size']} | {r['experts']} | {r['top_k']} | {r['dense_seconds'] * 1e3:.1f} | "
            f"{r['dropless_seconds'] * 1e3:.1f} | {r['capacity_seconds'] * 1e3:.1f} | "
            f"{r['dropless_over_dense']:.2f} | {r['capacity_over_dropless']:.2f} |"
        )
    lines += [
        "",
        "Grouped matmul alone: 4096 x 256 -> 512, 64 equal groups.",
        "",
        "| implementation | forward (ms) | forward+backward (ms) |",
        "|---|---|---|",
    ]
    for r in result["grouped_matmul"]:
        lines.append(
            f"| {r['implementation']} | {r['forward_seconds'] * 1e3:.1f} | {r['forward_backward_seconds'] * 1e3:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.bench.moe", topic="bench", repeats=5)
    parser = study.parser
    parser.add_argument(
        "--tokens",
        type=harness.integer(SEQ, multiple_of=SEQ),
        default=4096,
        help=f"tokens per layer call: a multiple of {SEQ} (the sequence length), >= {SEQ}",
    )
    parser.add_argument(
        "--expert-sizes",
        type=harness.integers(1),
        default="128,512",
        help="expert hidden sizes h to time: comma-separated integers >= 1",
    )
    args = study.parse(argv)
    layers = [row for h in args.expert_sizes for row in bench_layers(args.tokens, h, args.repeats)]
    result = {
        "tokens": args.tokens,
        "repeats": args.repeats,
        "layers": layers,
        "grouped_matmul": bench_grouped_matmul(args.repeats),
    }
    study.write("moe", result, markdown)


if __name__ == "__main__":
    command.run(main)
