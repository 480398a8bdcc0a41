"""FoMoE against its newest peers on one proxy, side by side: bytes on the wire, held-out loss over seeds with
intervals paired against DDP, bytes to a common target loss, and a bytes-vs-loss Pareto plot.

    python -m experiments.reproduce.fomoe_peers [--out runs/fomoe] [--steps 256] [--seeds 0,1,2] [--size proxy]
        [--rows ROWS] [--rerun-rows ROWS]

Every row trains experiments/configs/fomoe.py (d_model 128, 4 layers, 8 experts top-2; `--size 4x`: d_model,
expert and FFN widths doubled, about 4x the parameters) at M = 4 sites, K = 32 local steps per round, fixed
placement, on the same tokens for `--steps` steps, once per seed (`train.seed`: initialisation and rounding draws;
the data order is the corpus's), evaluated every 64 steps. Each is `python -m experiments.run` with 4 virtual CPU
devices in `<out>/runs/peers_<size>_<row>_s<seed>`, reused when finished. The rows (ROWS) are the peers as their
papers run them, mapped onto this federation:

  DDP                 gradients all-reduced every step (mesh.data = 4).
  DiLoCo              full replica (O_e = M), float32, outer Nesterov (lr 0.7, momentum 0.9).
  FoMoE O_e = 1, 2    partitioned experts, LocalAdamW (parameters and both moments averaged), float32.
  SPES                arXiv 2602.11543: every site holds every expert, trains its 2 of 8, dense parameters
                      averaged, experts from their owners, merging warm-up alpha 0.05 (moe.spes).
  DES-LOC             full replica, LocalAdamW with moment periods (3, 6) (moe.desloc), float32; and on
                      DiLoCo: its inner AdamW moments averaged on periods (3, 6), the outer state never sent.
  SparseLoCo          arXiv 2508.15706: full replica, top-64 of each 4096-value chunk with 2-bit values
                      (core.codec topk2), error feedback decayed by 0.95, outer SGD lr 1 without momentum.
  ours                partitioned experts (O_e = 2) + LocalAdamW + the low-bit formats found best here
                      (fp4 or topk2 with error feedback, second moments local), DES-LOC's first-moment
                      period, streaming fragments (each fragment averaged every second round).

  Decoupled DiLoCo    arXiv 2604.21428: 4 learner processes with no collective, full replicas, a synchroniser
                      merging with quorum 3, a 5 s grace window, token weights and DiLoCo's outer Nesterov
                      (`python -m experiments.decoupled`; its rounds are not lock-step, so a rerun can differ).

Reported (peers.md, peers.json, peers.png): per row the bytes each site sends per round (compiled; = the formula),
over the whole run, x fewer than DDP; the held-out loss per seed, its mean, and the mean paired difference to DDP
(same seed) with a 95% t-interval over the seeds; the bytes each site has sent when the seed-mean loss curve first
reaches the target (DiLoCo's final mean loss unless `--target`); for `--rerun-rows`, each seed rerun under another
compiler's rounding (RERUN_XLA_FLAGS) and whether the runs' interval covers the reruns; and a modelled wall time
over 10 Mbit/s links per site (compute at the run's steady tokens/s here, all 4 sites sharing this machine's cores,
+ its bytes at 10 Mbit/s; not a measurement over links).
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

from experiments import command, harness, plotting
from experiments.reproduce import links_methods, runs

CONFIG = runs.config_path("fomoe")
SITES, K, EVAL_EVERY = 4, 32, 64
LINK_MBIT = 10.0
# A rerun: XLA:CPU's fast math (reassociated reductions, approximate transcendental functions; infinities and NaNs
# still honoured) rounds differently from the default build, as another XLA build or host does: the drift of a
# rerun, measured here on one host (the same config reruns bit for bit on one host and build).
RERUN_XLA_FLAGS = "--xla_cpu_enable_fast_math=true"
REFERENCE = "fomoe_o2"  # float32 FoMoE: the loss the low-bit rows are held to
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
SIZES = {  # 4x: every matrix twice as wide and tall (d_model, experts and dense FFN), about 4x the parameters
    "proxy": [],
    "4x": ["--config.model.d_model=256", "--config.model.d_ff=1024", "--config.moe.expert_size=256"],
}
_SPARSELOCO = ["--config.fomoe.outer=diloco", *(f"--config.fomoe.{k}={v}" for k, v in links_methods.SPARSELOCO.items())]
_TOPK = ["--config.fomoe.sync_format=topk2", "--config.fomoe.sync_block=4096", "--config.fomoe.sync_scale=fp32"]
# name: (label, experiments.run flags beyond the federation's M and K)
ROWS = {
    "ddp": ("DDP (gradients every step)", []),
    "diloco": ("DiLoCo, full replica, float32", ["--config.fomoe.overlap=4", "--config.fomoe.outer=diloco"]),
    "fomoe_o1": ("FoMoE O_e = 1, LocalAdamW float32", ["--config.fomoe.overlap=1"]),
    "fomoe_o2": ("FoMoE O_e = 2, LocalAdamW float32", ["--config.fomoe.overlap=2"]),
    "decoupled": (
        "Decoupled DiLoCo, full replica, quorum 3 of 4",
        ["--config.fomoe.overlap=4", "--config.fomoe.outer=diloco"],
    ),
    "spes": ("SPES (owned experts, merging warm-up)", ["--config.fomoe.overlap=4", "--config.fomoe.outer=spes"]),
    "desloc": (
        "DES-LOC, full replica, periods (3, 6)",
        ["--config.fomoe.overlap=4", "--config.fomoe.moment_periods=(3, 6)"],
    ),
    "desloc_diloco": (
        "DES-LOC on DiLoCo, full replica, inner moments (3, 6)",
        ["--config.fomoe.overlap=4", "--config.fomoe.outer=diloco", "--config.fomoe.moment_periods=(3, 6)"],
    ),
    "sparseloco": ("SparseLoCo, full replica, top-64/4096 2-bit + EF", ["--config.fomoe.overlap=4", *_SPARSELOCO]),
    "ours_fp4": (
        "ours: O_e = 2, fp4 + EF, second moments local",
        [
            "--config.fomoe.overlap=2",
            "--config.fomoe.sync_format=fp4",
            "--config.fomoe.error_feedback=True",
            "--config.fomoe.second_moments=local",
        ],
    ),
    "ours_topk": (
        "ours: O_e = 2, top-256/4096 + EF, second moments local, first every 3rd round",
        [
            "--config.fomoe.overlap=2",
            *_TOPK,
            "--config.fomoe.sync_keep=256",
            "--config.fomoe.error_feedback=True",
            "--config.fomoe.second_moments=local",
            "--config.fomoe.moment_periods=(3, 1)",
        ],
    ),
    "ours_fp4_frag": (
        "ours: O_e = 2, fp4 + EF, second moments local, 2 streaming fragments",
        [
            "--config.fomoe.overlap=2",
            "--config.fomoe.sync_format=fp4",
            "--config.fomoe.error_feedback=True",
            "--config.fomoe.second_moments=local",
            "--config.fomoe.fragments=2",
        ],
    ),
    "ours_fp4_desloc_frag": (
        "ours: O_e = 2, fp4 + EF, second moments local, first every 3rd, 2 fragments",
        [
            "--config.fomoe.overlap=2",
            "--config.fomoe.sync_format=fp4",
            "--config.fomoe.error_feedback=True",
            "--config.fomoe.second_moments=local",
            "--config.fomoe.moment_periods=(3, 1)",
            "--config.fomoe.fragments=2",
        ],
    ),
    "ours_topk_frag": (
        "ours: O_e = 2, top-256/4096 + EF, second moments local, first every 3rd, 2 fragments",
        [
            "--config.fomoe.overlap=2",
            *_TOPK,
            "--config.fomoe.sync_keep=256",
            "--config.fomoe.error_feedback=True",
            "--config.fomoe.second_moments=local",
            "--config.fomoe.moment_periods=(3, 1)",
            "--config.fomoe.fragments=2",
        ],
    ),
}


def flags(row: str, seed: int, steps: int, size: str) -> list[str]:
    """The experiments.run flags of one run."""
    out = [f"--config.train.eval_every={EVAL_EVERY}", f"--config.train.seed={seed}", *SIZES[size]]
    if row == "ddp":
        return out + ["--config.mesh.site=1", f"--config.mesh.data={SITES}"]
    return (
        out + [f"--config.mesh.site={SITES}", "--config.mesh.data=1", f"--config.fomoe.local_steps={K}"] + ROWS[row][1]
    )


def train(row: str, seed: int, steps: int, size: str, out: str, rerun: bool = False) -> dict:
    """Trains (or reuses) one run; returns its summary.json with its held-out curve ("curve": [(step, loss)]).
    `rerun`: the same run under another compiler's rounding (RERUN_XLA_FLAGS), in its own workdir."""
    workdir = os.path.join(out, "runs", f"peers_{size}_{row}_s{seed}" + ("_rerun" if rerun else ""))
    command = None
    if row == "decoupled":
        command = lambda a: [sys.executable, "-m", "experiments.decoupled", "--quorum", "3", "--grace", "5", "--", *a]  # noqa: E731
    env = {"XLA_FLAGS": RERUN_XLA_FLAGS} if rerun else None
    summary = runs.run_or_reuse(
        CONFIG, workdir, flags(row, seed, steps, size), steps, devices=SITES, command=command, env=env
    )
    with open(os.path.join(workdir, "config.json")) as f:
        data = json.load(f)["data"]
    tokens = steps * data["batch_size"] * data["seq_len"]
    return {
        **summary,
        "curve": runs.read_metric(workdir, "val_loss"),
        "compute_seconds": tokens / summary["tokens_per_second"],
    }


def paired_interval(losses: list[float], baseline: list[float]) -> tuple[float, float]:
    """(mean of loss - baseline over the seeds, half-width of its 95% t-interval; nan for one seed)."""
    d = np.asarray(losses) - np.asarray(baseline)
    if d.size < 2:
        return float(d.mean()), math.nan
    return float(d.mean()), float(T_975[d.size - 1] * d.std(ddof=1) / math.sqrt(d.size))


def bytes_to_target(curve: list[tuple[int, float]], per_step: float, target: float) -> float | None:
    """Bytes a site has sent when the (seed-mean) held-out curve first reaches `target`; None if it never does."""
    for step, loss in curve:
        if loss <= target:
            return step * per_step
    return None


def rerun_check(losses: list[float], reruns: list[float], ddp: list[float], ddp_reruns: list[float]) -> dict:
    """What reruns (RERUN_XLA_FLAGS) of a row and of DDP say of its interval, paired by seed: "drift", rerun - run
    per seed; "vs_ddp", the reruns' mean difference to DDP's reruns; "covered", whether that lies in the runs'
    95% interval of the difference (`paired_interval`); "vs_ddp_all", the interval over runs and reruns alike
    (2 n differences, each rerun paired with DDP's rerun)."""
    diff, half = paired_interval(losses, ddp)
    again, _ = paired_interval(reruns, ddp_reruns)
    both = paired_interval(losses + reruns, ddp + ddp_reruns)
    return {
        "drift": [r - v for r, v in zip(reruns, losses)],
        "vs_ddp": again,
        "covered": bool(abs(again - diff) <= half),
        "vs_ddp_all": list(both),
    }


def rows(
    summaries: dict[str, dict[int, dict]], steps: int, target: float | None, reruns: dict[str, dict[int, dict]] | None
) -> tuple[list[dict], float]:
    """One record per row (see the module docstring) and the target loss used; rows in `reruns` (DDP among them)
    carry `rerun_check`'s "rerun"."""
    seeds = sorted(summaries["ddp"])
    ddp = summaries["ddp"]
    ddp_losses = [ddp[s]["val_loss"] for s in seeds]
    means = {r: float(np.mean([by[s]["val_loss"] for s in seeds])) for r, by in summaries.items()}
    target = means["diloco"] if target is None else target
    ddp_step = ddp[seeds[0]]["bytes_per_device_per_step"]
    out = []
    for row, by_seed in summaries.items():
        first = by_seed[seeds[0]]
        per_step = ddp_step if row == "ddp" else first["bytes_per_site_per_round"] / K
        curves = [dict(by_seed[s]["curve"]) for s in seeds]
        mean_curve = [(step, float(np.mean([c[step] for c in curves]))) for step in sorted(curves[0])]
        losses = [by_seed[s]["val_loss"] for s in seeds]
        diff, half = paired_interval(losses, ddp_losses)
        compute = float(np.mean([by_seed[s]["compute_seconds"] for s in seeds]))
        total = per_step * steps
        out.append(
            {
                "row": row,
                "label": ROWS[row][0],
                "bytes_per_round": per_step * K,
                "formula_equal": row != "ddp"
                and math.isclose(first["bytes_per_site_per_round"], first["bytes_per_site_per_round_formula"]),
                "bytes_total": total,
                "vs_ddp": ddp_step / per_step,
                "val_loss": losses,
                "val_loss_mean": means[row],
                "vs_ddp_loss": [diff, half],
                "curve": mean_curve,
                "bytes_to_target": bytes_to_target(mean_curve, per_step, target),
                "wall_seconds_10mbit": compute + total * 8 / (LINK_MBIT * 1e6),
            }
        )
        if reruns and row in reruns:
            again = [reruns[row][s]["val_loss"] for s in seeds]
            ddp_again = [reruns["ddp"][s]["val_loss"] for s in seeds]
            out[-1]["rerun"] = {"val_loss": again, **rerun_check(losses, again, ddp_losses, ddp_again)}
    reference = next((r for r in out if r["row"] == REFERENCE and "rerun" in r), None)
    for r in out:  # the low-bit rows against float32 FoMoE, over runs and reruns paired by seed and kind
        if reference is not None and "rerun" in r and r["row"] not in (REFERENCE, "ddp"):
            both, base = r["val_loss"] + r["rerun"]["val_loss"], reference["val_loss"] + reference["rerun"]["val_loss"]
            r["rerun"]["vs_reference_all"] = list(paired_interval(both, base))
    return sorted(out, key=lambda r: r["bytes_total"]), target


def pareto(records: list[dict]) -> set[str]:
    """The rows no other row beats on both bytes (total) and mean held-out loss."""
    front = set()
    for r in records:
        if not any(
            o["bytes_total"] <= r["bytes_total"]
            and o["val_loss_mean"] <= r["val_loss_mean"]
            and (o["bytes_total"], o["val_loss_mean"]) != (r["bytes_total"], r["val_loss_mean"])
            for o in records
        ):
            front.add(r["row"])
    return front


def markdown(result: dict) -> str:
    """peers.md: the side-by-side table, ordered by bytes, with DDP's loss beside every ratio."""
    seeds, records = result["seeds"], result["rows"]
    ddp = next(r for r in records if r["row"] == "ddp")
    front = set(result["pareto"])
    lines = [
        "# FoMoE against its peers, side by side",
        "",
        f"`{result['command']}`: experiments/configs/fomoe.py ({result['size']}) at M = {SITES} sites, K = {K}, "
        f"{result['steps']} steps of 16 x 256 byte-tokens, seeds {', '.join(map(str, seeds))}; DDP's held-out loss "
        f"{ddp['val_loss_mean']:.4f} (mean over the seeds). Bytes: what a site sends, read from the compiled programs "
        "(every federated row equals its formula where marked); Decoupled DiLoCo's: what a learner sends, counted on "
        "its socket (it receives as much; the synchroniser sends M times that). 'vs DDP loss': mean of (row - DDP) "
        "over the seeds, with its 95% t-interval (seeds only: a rerun of the same config drifts too, see "
        "docs/fomoe.md). Target: "
        f"{result['target']:.4f} held-out (DiLoCo's final mean unless set). Wall time: modelled, compute at the "
        f"run's tokens/s plus its bytes over a {LINK_MBIT:g} Mbit/s link per site. Ordered by bytes per run; "
        "* on the Pareto front (bytes, mean loss).",
        "",
        "| row | MB per site per round | = formula | MB per run | x fewer than DDP | "
        + " | ".join(f"seed {s}" for s in seeds)
        + " | mean | vs DDP loss | MB to target | modelled hours at 10 Mbit/s |",
        "|---|---|---|---|---|" + "---|" * len(seeds) + "---|---|---|---|",
    ]
    for r in records:
        losses = " | ".join(f"{v:.4f}" for v in r["val_loss"])
        diff, half = r["vs_ddp_loss"]
        to_target = "not reached" if r["bytes_to_target"] is None else f"{r['bytes_to_target'] / 1e6:,.2f}"
        formula = "n/a" if r["row"] == "ddp" else "yes" if r["formula_equal"] else "no"
        lines.append(
            f"| {r['label']}{' *' if r['row'] in front else ''} | {r['bytes_per_round'] / 1e6:,.3f} | "
            f"{formula} | {r['bytes_total'] / 1e6:,.2f} | {r['vs_ddp']:,.0f}x | "
            f"{losses} | {r['val_loss_mean']:.4f} | {diff:+.4f} ± {half:.4f} | {to_target} | "
            f"{r['wall_seconds_10mbit'] / 3600:.2f} |"
        )
    rerun = [r for r in records if "rerun" in r]
    if rerun:
        lines += [
            "",
            f"Reruns: every seed of these rows (DDP among them) run again with XLA_FLAGS `{RERUN_XLA_FLAGS}`, which "
            "rounds differently from the default build (reassociated reductions, approximate transcendental "
            "functions), as another XLA build or host does; on one host and build the same config reruns bit for "
            "bit. 'covered': the reruns' mean difference to DDP's reruns lies in the runs' 95% interval above. "
            "'runs and reruns': the interval over both (2 n differences, reruns paired with DDP's reruns). "
            f"'vs {ROWS[REFERENCE][0]}': the same over runs and reruns, paired by seed and kind.",
            "",
            "| row | reruns | rerun - run | vs DDP (runs) | vs DDP (reruns) | covered | vs DDP, runs and reruns | "
            f"vs {ROWS[REFERENCE][0]}, runs and reruns |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rerun:
            c, (diff, half) = r["rerun"], r["vs_ddp_loss"]
            versus = "n/a" if "vs_reference_all" not in c else "{:+.4f} ± {:.4f}".format(*c["vs_reference_all"])
            lines.append(
                f"| {r['label']} | {' / '.join(f'{v:.4f}' for v in c['val_loss'])} | "
                f"{' / '.join(f'{v:+.4f}' for v in c['drift'])} | {diff:+.4f} ± {half:.4f} | {c['vs_ddp']:+.4f} | "
                f"{'yes' if c['covered'] else 'no'} | {c['vs_ddp_all'][0]:+.4f} ± {c['vs_ddp_all'][1]:.4f} | "
                f"{versus} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """peers.png: mean held-out loss (and each seed) against MB per site per run, log scale; the front joined."""
    front = set(result["pareto"])
    with plotting.figure(path, size=(7.5, 5), grid="both", title=result["command"], legend_size=7) as ax:
        colors = plotting.colors([r["row"] for r in result["rows"]])
        for r in result["rows"]:
            x = r["bytes_total"] / 1e6
            ax.scatter([x] * len(r["val_loss"]), r["val_loss"], color=colors[r["row"]], s=10, alpha=0.6)
            ax.scatter([x], [r["val_loss_mean"]], color=colors[r["row"]], marker="D", s=40, label=r["label"])
        points = sorted((r["bytes_total"] / 1e6, r["val_loss_mean"]) for r in result["rows"] if r["row"] in front)
        ax.plot(*zip(*points), color="gray", linewidth=1, linestyle="--")
        ax.axhline(result["target"], color="gray", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_xlabel("MB per site over the run (compiled)")
        ax.set_ylabel("held-out loss (nats per byte-token)")
        ax.set_title(f"M = {SITES}, K = {K}, {result['size']}: bytes against loss (dashed: Pareto front)", fontsize=9)


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.reproduce.fomoe_peers", topic="fomoe")
    harness.add_steps(study.parser, default=256, multiple_of=K, why=f"whole rounds at K = {K}")
    harness.add_seeds(study.parser, default="0,1,2", what="initialisation and rounding draws", at_least=2)
    study.parser.add_argument("--size", choices=sorted(SIZES), default="proxy", help="the model size (default proxy)")
    study.parser.add_argument(
        "--rows", type=harness.names(ROWS), default=list(ROWS), help="rows to run (default all; ddp and diloco always)"
    )
    study.parser.add_argument("--target", type=harness.number(0.0, low_open=True), help="target held-out loss")
    study.parser.add_argument(
        "--rerun-rows",
        type=harness.names([r for r in ROWS if r != "decoupled"], empty=True),
        default=[],
        help="rows to run, and rerun under another compiler's rounding, every seed (DDP too when any; default none)",
    )
    args = study.parse(argv)
    again = ["ddp"] + [r for r in args.rerun_rows if r != "ddp"] if args.rerun_rows else []
    chosen = list(dict.fromkeys(["ddp", "diloco", *args.rows, *again]))  # a rerun row is run too
    jobs = [(row, seed, False) for seed in args.seeds for row in chosen]
    jobs += [(row, seed, True) for seed in args.seeds for row in again]
    summaries: dict[str, dict[int, dict]] = {r: {} for r in chosen}
    reruns: dict[str, dict[int, dict]] = {r: {} for r in again}
    for done, (row, seed, rerun) in enumerate(jobs, 1):
        study.progress(done, len(jobs), f"{ROWS[row][0]}, seed {seed}{', rerun' if rerun else ''}")
        (reruns if rerun else summaries)[row][seed] = train(row, seed, args.steps, args.size, args.out, rerun)
    records, target = rows(summaries, args.steps, args.target, reruns)
    result = {
        "steps": args.steps,
        "seeds": args.seeds,
        "size": args.size,
        "target": target,
        "rows": records,
        "pareto": sorted(pareto(records)),
    }
    study.write(f"peers_{args.size}", result, markdown, {f"peers_{args.size}.png": plot})


if __name__ == "__main__":
    command.run(main)
