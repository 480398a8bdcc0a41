"""MGUP at CPU scale: the quickstart model trained with each MGUP variant and its base optimizer.

    python -m experiments.reproduce.mgup [--out runs/mgup] [--steps 400] [--only NAME,...]

Every run is the quickstart MoE language model (experiments/configs/quickstart.py: d_model 128, 4 layers, 8 experts
top-2) on one device without federation (`mesh.site = 1`), so the optimizer is the only thing that changes:
the same `--steps` x 8 x 256 byte-tokens, warm-up 40 steps and cosine decay, gradient clipping at 1, weight decay
0.1 on matrices, held-out loss on 16 batches every 100 steps. Optimizers: AdamW, C-AdamW, MGUP-AdamW,
Cautious-MGUP-AdamW (HF-style AdamW, b = (0.9, 0.95)), Lion, MGUP-Lion (b = (0.9, 0.99)), Muon, MGUP-Muon (Moonlight
scaling on the 2-D matrices, the routers included; AdamW backup for the embedding, the norms and the 3-D expert
tensors, `optim.muon.default_muon_labels`); MGUP with the reference's tau = 0.5, alpha = 2,
gamma = 0.1 and exact top-k.

Learning rates: a sweep over three values per family on seed 0 (AdamW and Muon families 2.5e-3, 5e-3, 1e-2; Lion
family 2.5e-4, 5e-4, 1e-3); each optimizer keeps its best, and seed 1 (other initialisation and data order) is run
there. Seed 0's value is the best of three, which favours every optimizer alike. Each run is `python -m
experiments.run` in its own process, in `<out>/runs/<name>`, its progress shown prefixed by that name; finished runs
are reused. Writes table.md, table.json (with the curves) and curves.png (training loss, smoothed, and held-out loss
at the tuned learning rates) into `--out` (`--out results/mgup` for the table docs/mgup.md quotes).
"""

from __future__ import annotations

import os
import time

from experiments import command, harness, plotting
from experiments import optimizers as optimizer_table
from experiments.reproduce import runs as runs_lib

CONFIG = runs_lib.config_path("quickstart")

# optimizer -> its family (experiments.optimizers), which fixes the learning-rate grid and the base it is compared with
# (the family's plain member: adamw, lion, muon). Betas, eps and Muon's momentum are the family defaults
# (docs/configuration.md).
FAMILY = {name: entry.family.name for name, entry in optimizer_table.OPTIMIZERS.items()}
LEARNING_RATES = {"adamw": (2.5e-3, 5e-3, 1e-2), "lion": (2.5e-4, 5e-4, 1e-3), "muon": (2.5e-3, 5e-3, 1e-2)}
# The committed results/mgup table ran the Muon family's AdamW backup with b1 = 0.9 (then the one optim.b1 of every
# optimizer), not the family default 0.95 (the reference's); pinned so that the table reproduces. Drop this when
# the table is regenerated.
PINNED = {"muon": ("--config.optim.b1=0.9",)}
SEEDS = (0, 1)
EVAL_EVERY, EVAL_BATCHES = 100, 16


def run_name(optimizer: str, lr: float, seed: int) -> str:
    """The workdir name of one run, e.g. mgup_adamw_lr0.005_s0."""
    return f"{optimizer}_lr{lr:g}_s{seed}"


def train(optimizer: str, lr: float, seed: int, steps: int, out: str) -> dict:
    """Runs (or reuses) one training run; returns its final held-out loss, curves and speed."""
    workdir = os.path.join(out, "runs", run_name(optimizer, lr, seed))
    flags = [
        "--config.mesh.site=1",
        "--config.mesh.data=1",
        f"--config.optim.name={optimizer}",
        f"--config.optim.learning_rate={lr}",
        *PINNED.get(FAMILY[optimizer], ()),
        f"--config.train.seed={seed}",
        f"--config.data.seed={seed}",
        f"--config.train.eval_every={EVAL_EVERY}",
        f"--config.train.eval_batches={EVAL_BATCHES}",
        f"--config.checkpoint.every={steps}",
    ]
    summary = runs_lib.run_or_reuse(CONFIG, workdir, flags, steps)
    return {
        "val_loss": summary["val_loss"],
        "train_curve": runs_lib.read_metric(workdir, "train_loss"),
        "val_curve": runs_lib.read_metric(workdir, "val_loss"),
        "tokens_per_second": summary["tokens_per_second"],
    }


def collect(optimizers: list[str], steps: int, study: harness.Study) -> dict:
    """The sweep on seed 0, then the other seeds at each optimizer's best learning rate (runs in `study.out`/runs,
    each reported with `study.progress` when it starts and when it ends)."""
    plan = [(o, lr, SEEDS[0]) for o in optimizers for lr in LEARNING_RATES[FAMILY[o]]]
    runs = {}

    def go(o, lr, seed, i, total):
        t0 = time.time()
        study.progress(i, total, f"{run_name(o, lr, seed)} ...")
        runs[(o, lr, seed)] = train(o, lr, seed, steps, study.out)
        loss = runs[(o, lr, seed)]["val_loss"]
        study.progress(i, total, f"{run_name(o, lr, seed)}: held-out loss {loss:.4f} ({time.time() - t0:.0f} s)")

    total = len(plan) + len(optimizers) * (len(SEEDS) - 1)
    for i, (o, lr, seed) in enumerate(plan):
        go(o, lr, seed, i + 1, total)
    best = {o: min(LEARNING_RATES[FAMILY[o]], key=lambda lr: runs[(o, lr, SEEDS[0])]["val_loss"]) for o in optimizers}
    i = len(plan)
    for o in optimizers:
        for seed in SEEDS[1:]:
            i += 1
            go(o, best[o], seed, i, total)
    return {"runs": runs, "best": best}


def summarise(optimizers: list[str], collected: dict, steps: int) -> dict:
    """The table's rows (each optimizer at its best learning rate: held-out loss per seed, mean, spread, gap to
    its base, the sweep) and the curves the plot draws (per optimizer and seed, at the best learning rate)."""
    runs, best = collected["runs"], collected["best"]
    rows = []
    for o in optimizers:
        losses = [runs[(o, best[o], s)]["val_loss"] for s in SEEDS]
        rows.append(
            {
                "optimizer": o,
                "base": FAMILY[o],
                "learning_rate": best[o],
                "val_losses": losses,
                "mean": sum(losses) / len(losses),
                "spread": max(losses) - min(losses),
                "tokens_per_second": sum(runs[(o, best[o], s)]["tokens_per_second"] for s in SEEDS) / len(SEEDS),
                "sweep": {f"{lr:g}": runs[(o, lr, SEEDS[0])]["val_loss"] for lr in LEARNING_RATES[FAMILY[o]]},
            }
        )
    by = {r["optimizer"]: r for r in rows}
    for r in rows:
        base = by.get(r["base"])
        r["vs_base"] = None if base is None or r["base"] == r["optimizer"] else r["mean"] - base["mean"]
    curves = {
        o: {str(s): {k: runs[(o, best[o], s)][f"{k}_curve"] for k in ("train", "val")} for s in SEEDS}
        for o in optimizers
    }
    return {"steps": steps, "tokens": steps * 8 * 256, "seeds": list(SEEDS), "rows": rows, "curves": curves}


def verdict(r: dict, by: dict) -> str:
    """Whether a variant beat its base: its mean is lower and the gap exceeds both runs' seed spreads."""
    if r["vs_base"] is None:
        return "base"
    noise = max(r["spread"], by[r["base"]]["spread"])
    if abs(r["vs_base"]) <= noise:
        return "tie (gap within seed spread)"
    return "better" if r["vs_base"] < 0 else "worse"


def markdown(result: dict) -> str:
    """table.md: one row per optimizer at its tuned learning rate, then the seed-0 sweep."""
    rows = result["rows"]
    by = {r["optimizer"]: r for r in rows}
    lines = [
        "# MGUP at CPU scale: the quickstart model with each optimizer",
        "",
        f"`{result['command']}`: quickstart MoE (d_model 128, 4 "
        f"layers, 8 experts top-2) on one device, {result['steps']} steps x 8 x 256 byte-tokens "
        f"({result['tokens']:,} tokens) for every run, seeds {result['seeds']} at the learning rate that won "
        f"the seed-0 sweep. Held-out loss: nats per byte-token on {EVAL_BATCHES} batches. MGUP: tau 0.5, "
        "alpha 2, gamma 0.1, exact top-k.",
        "",
        "| optimizer | base | lr | held-out loss (mean) | seeds | spread | vs base | verdict | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = "" if r["vs_base"] is None else f"{r['vs_base']:+.4f}"
        seeds = " / ".join(f"{x:.4f}" for x in r["val_losses"])
        lines.append(
            f"| {r['optimizer']} | {r['base']} | {r['learning_rate']:g} | {r['mean']:.4f} | {seeds} | "
            f"{r['spread']:.4f} | {vs} | {verdict(r, by)} | {r['tokens_per_second']:,.0f} |"
        )
    lines += [
        "",
        "Learning-rate sweep (seed 0, held-out loss):",
        "",
        "| optimizer | " + " | ".join(["lr 1", "lr 2", "lr 3"]) + " |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['optimizer']} | " + " | ".join(f"{lr}: {v:.4f}" for lr, v in r["sweep"].items()) + " |")
    return "\n".join(lines) + "\n"


def curves_plot(result: dict, path: str) -> None:
    """curves.png: one panel per optimizer family; training loss (5-point mean) and held-out loss (dots) at each
    optimizer's tuned learning rate, mean over seeds (`result`: table.json's record, `summarise`'s keys and the
    command)."""
    best = {r["optimizer"]: r["learning_rate"] for r in result["rows"]}
    optimizers = list(best)
    families = [f for f in LEARNING_RATES if any(FAMILY[o] == f for o in optimizers)]
    title = f"MGUP against its base, quickstart MoE, mean of seeds {result['seeds']}\n{result['command']}"
    with plotting.figure(path, size=(5 * len(families), 4.4), ncols=len(families), squeeze=False, title=title) as axes:
        for ax, family in zip(axes, families):
            members = [o for o in optimizers if FAMILY[o] == family]
            for o, color in plotting.colors(members).items():
                curves = [result["curves"][o][str(s)] for s in result["seeds"]]
                steps, train = plotting.mean_curve([c["train"] for c in curves])
                ax.plot(*plotting.moving_average(steps, train, 5), color=color, lw=1, alpha=0.6)
                vsteps, val = plotting.mean_curve([c["val"] for c in curves])
                ax.plot(vsteps, val, "o-", color=color, ms=4, label=f"{o} (lr {best[o]:g})")
            ax.set_ylim(top=2.6)
            ax.set_xlabel("step")
            ax.set_ylabel("loss (nats per byte)")
            ax.set_title(f"{family} family: train (line, 5-point mean) and held-out (dots)", fontsize=8)


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.reproduce.mgup", topic="mgup")
    harness.add_steps(study.parser, default=400, multiple_of=EVAL_EVERY, why="the evaluation interval")
    study.parser.add_argument(
        "--only",
        type=harness.names(FAMILY, empty=True),
        default="",
        help=f"optimizers to run: a comma-separated subset of {list(FAMILY)} (empty: all)",
    )
    args = study.parse(argv)
    optimizers = args.only or list(FAMILY)
    collected = collect(optimizers, args.steps, study)
    study.write("table", summarise(optimizers, collected, args.steps), markdown, {"curves.png": curves_plot})


if __name__ == "__main__":
    command.run(main)
