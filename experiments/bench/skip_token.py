"""Skip-token throughput: one site's training step against the number of ghost experts it does not host.

    python -m experiments.bench.skip_token [--out runs/fomoe] [--experts 32] [--top-k 8] [--layers 4]
                                           [--batch 8] [--seq 256] [--repeats 5]

The paper's setting (FoMoE, "up to 1.4x" at 0/8/16 ghost experts on its 150M model): d_model 512, expert size 128,
a quarter of the experts active, sigmoid router. Here: a `--layers`-layer MoE transformer (every block MoE) with
`--experts` experts, top-k `--top-k`; a site in skip-token mode hosts the first N_le = N_e - ghosts experts; the
global router still scores all N_e, and a choice of a ghost is not computed (its rows never reach the expert
matmuls: the grouped matmul's trip count follows the resident rows). Time = the jitted train step (forward,
backward, AdamW) on random tokens, the variants interleaved in rounds; throughput = tokens / median step time;
speedup against the site hosting every expert. Writes skip_token.json, skip_token.md and skip_token.png into
`--out` (`--out results/fomoe` for the table docs/fomoe.md quotes).
"""

from __future__ import annotations

import jax
import numpy as np

from core import train as train_lib
from experiments import build, command, harness, plotting, schema
from experiments.harness import interleaved_medians


def _config(experts: int, top_k: int, layers: int, seq: int, batch: int):
    """The benchmark's model and data shape on one device, as a config."""
    config = schema.default_config()
    config.model.update(d_model=512, num_layers=layers, num_heads=8, num_kv_heads=8, d_ff=2048)
    config.moe.update(every=1, num_experts=experts, top_k=top_k, expert_size=128, router="sigmoid")
    config.data.update(seq_len=seq, batch_size=batch)
    config.mesh.update(site=1, data=1)
    return config


def measure(experts: int, top_k: int, layers: int, seq: int, batch: int, ghosts: list[int], repeats: int) -> dict:
    """The train step with each number of ghost experts, timed in interleaved rounds; one row per count."""
    config = _config(experts, top_k, layers, seq, batch)
    optimizer = build.build_optimizer(config)
    _, sharder = build.build_mesh(config)  # one device
    tokens = jax.numpy.asarray(np.random.default_rng(0).integers(0, 256, size=(batch, seq + 1)), jax.numpy.int32)
    steps, ghost_fraction = {}, {}
    for g in ghosts:
        resident = np.arange(experts - g)
        model_fn = build.build_model_fn(config, sharder, resident=resident, routing_mode="skip_token")
        graphdef, state = train_lib.init_state(model_fn, optimizer, 0, sharder)
        step = train_lib.train_step_fn(graphdef, optimizer)
        run = jax.jit(step)  # not donated: every call starts from the same state
        harness.compiling(f"the train step with {g} ghost experts")
        _, metrics = run(state, tokens)
        ghost_fraction[g] = float(metrics.get("moe/ghost_fraction", 0.0))  # none with every expert resident
        steps[g] = lambda run=run, state=state: run(state, tokens)
    seconds = interleaved_medians({str(g): steps[g] for g in ghosts}, repeats=repeats)
    base = seconds[str(ghosts[0])]
    rows = [
        {
            "ghost_experts": g,
            "resident_experts": experts - g,
            "ghost_fraction": ghost_fraction[g],
            "ideal_ghost_fraction": g / experts,
            "step_seconds": seconds[str(g)],
            "tokens_per_second": batch * seq / seconds[str(g)],
            "speedup": base / seconds[str(g)],
        }
        for g in ghosts
    ]
    return {
        "experts": experts,
        "top_k": top_k,
        "layers": layers,
        "d_model": 512,
        "expert_size": 128,
        "batch": batch,
        "seq_len": seq,
        "repeats": repeats,
        "rows": rows,
    }


def markdown(result: dict) -> str:
    """skip_token.md: one row per ghost-expert count."""
    lines = [
        "# Skip-token throughput",
        "",
        f"`{result['command']}`: {result['layers']}-layer MoE transformer, d_model 512, "
        f"{result['experts']} experts of size 128, top-{result['top_k']}, sigmoid router; train step (forward, "
        f"backward, AdamW) on {result['batch']} x {result['seq_len']} tokens, median of {result['repeats']} "
        "interleaved repeats.",
        "",
        "| ghost experts | resident | ghost fraction (ideal) | step (ms) | tokens/s | speedup |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['ghost_experts']} | {r['resident_experts']} | {r['ghost_fraction']:.3f} "
            f"({r['ideal_ghost_fraction']:.3f}) | {1e3 * r['step_seconds']:.1f} | "
            f"{r['tokens_per_second']:,.0f} | {r['speedup']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """skip_token.png: training throughput against the number of ghost experts, beside the paper's 1.4x."""
    rows = result["rows"]
    with plotting.figure(path, size=(5.5, 3.8), title=result["command"]) as ax:
        ax.plot([r["ghost_experts"] for r in rows], [r["speedup"] for r in rows], "o-", label="measured (CPU)")
        ax.axhline(1.4, color="gray", ls=":", label="paper: up to 1.4x")
        ax.set_xlabel(f"ghost experts (of {result['experts']})")
        ax.set_ylabel("training throughput / all resident")
        ax.set_title("Skip-token: work skipped for non-resident experts", fontsize=9)


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.bench.skip_token", topic="fomoe", repeats=5)
    parser = study.parser
    parser.add_argument("--experts", type=harness.integer(1), default=32, help="experts N_e per MoE layer, >= 1")
    parser.add_argument(
        "--top-k", type=harness.integer(1), default=8, help="experts chosen per token, in [1, --experts]"
    )
    parser.add_argument("--layers", type=harness.integer(1), default=4, help="transformer layers (all MoE), >= 1")
    parser.add_argument("--batch", type=harness.integer(1), default=8, help="sequences per train step, >= 1")
    parser.add_argument("--seq", type=harness.integer(1), default=256, help="tokens per sequence, >= 1")
    parser.add_argument(
        "--ghosts",
        type=harness.integers(0, distinct=True, empty=True),
        default="",
        help="ghost-expert counts to time: comma-separated integers in [0, --experts), the first 0 (the "
        "baseline); empty: 0, N_e/4, N_e/2, 3 N_e/4",
    )
    args = study.parse(argv)
    ghosts = args.ghosts or [0, args.experts // 4, args.experts // 2, 3 * args.experts // 4]
    if not all(0 <= g < args.experts for g in ghosts) or ghosts[0] != 0:
        parser.error(f"--ghosts {ghosts}: each must be in [0, {args.experts}) and the first 0 (the baseline).")
    if args.top_k > args.experts:
        parser.error(f"--top-k = {args.top_k} must be <= --experts = {args.experts}")
    measured = measure(args.experts, args.top_k, args.layers, args.seq, args.batch, ghosts, args.repeats)
    study.write("skip_token", measured, markdown, {"skip_token.png": plot})


if __name__ == "__main__":
    command.run(main)
