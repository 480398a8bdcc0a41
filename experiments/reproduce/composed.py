"""The composed run and what each of its choices costs: experiments/configs/composed.py (the quickstart's FoMoE
federation trained with MGUP-AdamW on UFP4 GEMMs) against the same run with the optimizer, the GEMMs or both set
back (AdamW; recipe "none": unquantised float32 GEMMs; both back = the quickstart).

    python -m experiments.reproduce.composed [--out runs/composed] [--steps 700] [--seeds 0,1,2]

Every variant trains on the same steps with each seed (initialisation and data order; the same tokens for every
variant of a seed), so effects are read as paired differences within a seed. Each run is `python -m experiments.run`
in its own process (2 virtual CPU sites), in `<out>/runs/<name>_s<seed>`, its progress shown prefixed by that
name; finished runs are reused. Writes table.md, table.json and curves.png (held-out bits per byte over the steps,
mean over seeds) into `--out` (`--out results/composed` for the table docs/cli.md quotes).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from experiments import command, harness, plotting
from experiments.reproduce import runs as runs_lib

CONFIG = runs_lib.config_path("composed")
VARIANTS = {  # name -> (optim.name, precision.recipe)
    "adamw_none": ("adamw", "none"),
    "mgup_adamw_none": ("mgup_adamw", "none"),
    "adamw_ufp4": ("adamw", "ufp4"),
    "mgup_adamw_ufp4": ("mgup_adamw", "ufp4"),
}
EFFECTS = {  # label -> (variant with the choice, the same variant without it)
    "MGUP-AdamW vs AdamW, none (float32 GEMMs)": ("mgup_adamw_none", "adamw_none"),
    "MGUP-AdamW vs AdamW, UFP4 GEMMs": ("mgup_adamw_ufp4", "adamw_ufp4"),
    "UFP4 vs none (float32 GEMMs), AdamW": ("adamw_ufp4", "adamw_none"),
    "UFP4 vs none (float32 GEMMs), MGUP-AdamW": ("mgup_adamw_ufp4", "mgup_adamw_none"),
}
LABELS = {"none": "none (float32 GEMMs)"}  # how the table and the plot name a recipe (default: its name)


def train(name: str, seed: int, steps: int, out: str) -> dict:
    """Runs (or reuses) one variant with one seed; returns its held-out bits per byte, curve and speed."""
    optimizer, recipe = VARIANTS[name]
    workdir = os.path.join(out, "runs", f"{name}_s{seed}")
    flags = [
        f"--config.optim.name={optimizer}",
        f"--config.precision.recipe={recipe}",
        f"--config.train.seed={seed}",
        f"--config.data.seed={seed}",
        f"--config.checkpoint.every={steps}",
    ]
    summary = runs_lib.run_or_reuse(CONFIG, workdir, flags, steps, devices=2)
    return {
        "val_bits_per_byte": summary["val_bits_per_byte"],
        "val_bits_per_byte_worst_site": summary["val_bits_per_byte_worst_site"],
        "tokens_per_second": summary["tokens_per_second"],
        "curve": runs_lib.read_metric(workdir, "val_bits_per_byte"),
    }


def summarise(runs: dict, seeds: list[int]) -> dict:
    """Per variant the mean over seeds; per effect the paired differences (with - without) per seed, their mean and
    its standard error (None for one seed)."""
    variants: dict[str, dict[str, Any]] = {}
    for name, (optimizer, recipe) in VARIANTS.items():
        per_seed = [runs[name][s] for s in seeds]
        variants[name] = {
            "optimizer": optimizer,
            "recipe": recipe,
            "val_bits_per_byte": [r["val_bits_per_byte"] for r in per_seed],
            "val_bits_per_byte_worst_site": [r["val_bits_per_byte_worst_site"] for r in per_seed],
            "tokens_per_second": float(np.mean([r["tokens_per_second"] for r in per_seed])),
        }
    effects = {}
    for label, (with_, without) in EFFECTS.items():
        diffs = np.subtract(variants[with_]["val_bits_per_byte"], variants[without]["val_bits_per_byte"])
        stderr = float(np.std(diffs, ddof=1) / np.sqrt(len(diffs))) if len(diffs) > 1 else None
        effects[label] = {"per_seed": diffs.tolist(), "mean": float(diffs.mean()), "stderr": stderr}
    return {"variants": variants, "effects": effects}


def markdown(result: dict) -> str:
    """table.md: per variant the held-out bits per byte per seed and their mean; the paired effects."""
    lines = [
        "# All four results in one run",
        "",
        f"`{result['command']}`: experiments/configs/composed.py (2 FoMoE sites, disjoint experts, "
        "LocalAdamW every 10 steps) with the optimizer and the GEMM recipe set back one at a time; the same "
        "tokens for every variant of a seed; tokens/s with other jobs on the machine.",
        "",
        "| optimizer | GEMMs | held-out bits per byte, mean over seeds | per seed | worst site, per seed | "
        "tokens / s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in result["variants"].items():
        b = "**" if name == "mgup_adamw_ufp4" else ""
        lines.append(
            f"| {b}{r['optimizer']}{b} | {b}{LABELS.get(r['recipe'], r['recipe'])}{b} | "
            f"{b}{np.mean(r['val_bits_per_byte']):.3f}{b} | "
            f"{' / '.join(f'{v:.3f}' for v in r['val_bits_per_byte'])} | "
            f"{' / '.join(f'{v:.3f}' for v in r['val_bits_per_byte_worst_site'])} | "
            f"{r['tokens_per_second']:,.0f} |"
        )
    lines += [
        "",
        "Paired differences in held-out bits per byte (with the choice minus without it, same seed; "
        "negative = better):",
        "",
        "| effect | per seed | mean +- standard error | reading |",
        "|---|---|---|---|",
    ]
    for label, e in result["effects"].items():
        if e["stderr"] is None:
            spread, reading = f"{e['mean']:+.3f}", "one seed: no error estimate"
        else:
            spread = f"{e['mean']:+.3f} +- {e['stderr']:.3f}"
            reading = "beyond 2 standard errors" if abs(e["mean"]) > 2 * e["stderr"] else "within 2 standard errors"
        lines.append(f"| {label} | {' / '.join(f'{d:+.3f}' for d in e['per_seed'])} | {spread} | {reading} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """curves.png: held-out bits per byte against step per variant, mean over seeds."""
    title = f"Composed run: FoMoE sites, optimizer x GEMM recipe ({len(result['seeds'])} seeds)"
    with plotting.figure(path, size=(6.4, 4.2), legend_size=8, title=result["command"]) as ax:
        for name, r in result["variants"].items():
            steps, values = plotting.mean_curve([result["curves"][name][str(s)] for s in result["seeds"]])
            ax.plot(steps, values, "o-", ms=3, label=f"{r['optimizer']}, {LABELS.get(r['recipe'], r['recipe'])}")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out bits per byte (mean over sites and seeds)")
        ax.set_title(title, fontsize=9)


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.reproduce.composed", topic="composed")
    harness.add_steps(study.parser, default=700, multiple_of=10, why="whole rounds of fomoe.local_steps = 10")
    harness.add_seeds(study.parser, default="0,1,2", what="initialisation and data order")
    args = study.parse(argv)
    seeds = args.seeds
    runs: dict[str, dict[int, dict]] = {name: {} for name in VARIANTS}
    for i, (seed, name) in enumerate((s, n) for s in seeds for n in VARIANTS):
        study.progress(i + 1, len(seeds) * len(VARIANTS), f"{name}, seed {seed}")
        runs[name][seed] = train(name, seed, args.steps, args.out)
    result = {
        "steps": args.steps,
        "seeds": seeds,
        **summarise(runs, seeds),
        "curves": {n: {str(s): runs[n][s]["curve"] for s in seeds} for n in VARIANTS},
    }
    study.write("table", result, markdown, {"curves.png": plot})


if __name__ == "__main__":
    command.run(main)
