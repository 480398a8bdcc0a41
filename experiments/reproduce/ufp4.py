"""UFP4 at CPU scale: the grid analysis, and the quickstart MoE trained with each 4-bit recipe against BF16.

    python -m experiments.reproduce.ufp4 [--out runs/ufp4] [--parts grid,train] [--steps 400] [--jobs 1]
        [--recipes gridgames,nvfp4_ms_eden]

grid: the per-level shrinkage bias of E2M1, E1M2 and INT4 (spec formula), and the spec's synthetic table: 2^20
N(0,1) values, then the same with 2 of 256 channels scaled x30, in 1 x 16 blocks (32 for MXFP4) along the
channels, with and without a 16-point RHT: SQNR, alpha = <Q(A), A> / |A|^2 and bucket entropy per format, beside
the paper's numbers -> grid.md, grid.json, grid.png.

train: the quickstart MoE (experiments/configs/quickstart.py on one device, mesh.site = 1; AdamW lr 5e-3, batch 8 x
256) for `--steps` steps with each recipe (none = float32 GEMMs, bf16 = bfloat16 GEMM operands with float32
accumulation, e2m1_baseline, ufp4, ufp4_int4, NVIDIA's nvfp4 and its 4-over-6 variant, mxfp4 and AMD's mxfp4_amd)
and seeds 0 and 1
(initialisation and data order; the same tokens for every recipe of a seed), seeds 2 and 3 as well for bf16,
e2m1_baseline and ufp4 (their difference is the paper's claim and lies inside two seeds' noise), plus the paper's
ablation on the E1M2 grid (seed 0): no RHT, RHT on wgrad, on dgrad + wgrad, on fprop + wgrad (all without stochastic
rounding), against full RHT + SR on dy (= UFP4). Reported: the BF16-relative loss error |L - L_bf16| / L_bf16 of the
training loss over the last 20% of steps (logged every 10 steps, same seed's BF16 run), and the held-out loss at the
end -> table.md, table.json (with the loss curves), loss_error.png. Each run is `python -m experiments.run` in
`<out>/runs/<name>`, its progress shown prefixed by that name; finished runs are reused. Everything goes into
`--out` (`--out results/ufp4` for the tables and plots docs/ufp4.md quotes).

fidelity: every 4-bit recipe's three training GEMMs on the operands of a trained quickstart model, against float64
(SQNR, relative bias, wgrad cosine, with 95% intervals and paired rankings): experiments.reproduce.ufp4_fidelity.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments import command, harness, plotting
from experiments.reproduce import runs, ufp4_fidelity

CONFIG = runs.config_path("quickstart")
PARTS = ("grid", "train", "fidelity")
RECIPES = ("none", *ufp4_fidelity.RECIPES)  # float32 GEMMs beside the recipes the fidelity part compares
REFERENCE = "bf16"  # the loss errors are relative to true bf16 GEMMs (as the paper's); "none" = float32 GEMMs
SEEDS = (0, 1)
HEADLINE = ("bf16", "e2m1_baseline", "ufp4")  # the paper's comparison gets two more seeds: it is inside 2 seeds' noise
HEADLINE_SEEDS = (0, 1, 2, 3)
ABLATION = {  # name -> precision flags (E1M2 grid, seed 0); the last row is UFP4 itself
    "e1m2_no_rht": {"recipe": "ufp4", "rht": "none", "stochastic_dy": "off"},
    "e1m2_rht_wgrad": {"recipe": "ufp4", "rht": "wgrad", "stochastic_dy": "off"},
    "e1m2_rht_dgrad_wgrad": {"recipe": "ufp4", "rht": "dgrad+wgrad", "stochastic_dy": "off"},
    "e1m2_rht_fprop_wgrad": {"recipe": "ufp4", "rht": "fprop+wgrad", "stochastic_dy": "off"},
}
PAPER_ABLATION = {
    "e1m2_no_rht": 1.89202,
    "e1m2_rht_wgrad": 1.88721,
    "e1m2_rht_dgrad_wgrad": 1.88912,
    "e1m2_rht_fprop_wgrad": 1.88558,
    "ufp4": 1.88079,
}
PAPER_SYNTHETIC = {
    ("gaussian", "e2m1", False): (20.52, 0.9959),
    ("gaussian", "int4", False): (21.39, 1.0007),
    ("outliers", "e2m1", False): (22.23, None),
    ("outliers", "int4", False): (20.55, None),
    ("outliers", "e2m1", True): (18.88, None),
    ("outliers", "int4", True): (25.47, None),
}


# ------------------------------------------------------------------------------------------------------- grid


def grid_analysis(study: harness.Study) -> None:
    """grid.md/json/png in `study.out`: the shrinkage bias per level, and SQNR, alpha and bucket entropy of
    synthetic tensors (the command they state: `--parts grid`, without `--steps`, which grid does not read)."""
    import jax
    import jax.numpy as jnp

    from quant import analysis, quantize, rht, shrinkage_bias

    bias = {fmt: {f"{q:g}": b for q, b in shrinkage_bias(fmt).items() if q > 0} for fmt in ("e2m1", "e1m2", "int4")}
    x = jax.random.normal(jax.random.key(0), (4096, 256), jnp.float32)
    outliers = x * jnp.where(jnp.isin(jnp.arange(256), jnp.asarray([3, 77])), 30.0, 1.0)
    rows = []
    for dist, data in (("gaussian", x), ("outliers", outliers)):
        for fmt in ("e2m1", "int4", "mxfp4", "nvfp4"):
            for rotated in (False, True):
                a = rht(data) if rotated else data
                q = quantize(a, fmt)
                paper = PAPER_SYNTHETIC.get((dist, fmt, rotated), (None, None))
                rows.append(
                    {
                        "data": dist,
                        "fmt": fmt,
                        "rht": rotated,
                        "sqnr_db": float(analysis.sqnr(a, q)),
                        "alpha": float(analysis.alpha(a, q)),
                        "entropy_bits": float(analysis.bucket_entropy(a, fmt)),
                        "paper_sqnr_db": paper[0],
                        "paper_alpha": paper[1],
                    }
                )
    result = {"bias": bias, "rows": rows}
    study.write("grid", result, grid_markdown, {"grid.png": grid_plot}, parts=["grid"], always=())


def grid_markdown(result: dict) -> str:
    """grid.md: the bias table and the synthetic-tensor table beside the paper's numbers."""
    lines = [
        "# UFP4 grid analysis",
        "",
        f"`{result['command']}`. Mean rounding error of "
        "each positive interior level's bin under locally uniform density, (2 q_i - q_{i-1} - q_{i+1}) / 4 in "
        "grid units (negative levels mirror it):",
        "",
        "| grid | level: bias |",
        "|---|---|",
    ]
    for fmt, levels in result["bias"].items():
        lines.append(f"| {fmt} | " + ", ".join(f"{q}: {b:+g}" for q, b in levels.items()) + " |")
    lines += [
        "",
        "Synthetic tensors: 2^20 N(0,1) values as 4096 x 256, blocks along the 256 channels (1 x 16; 32 for "
        "MXFP4), FP32 amax scales (E4M3 under a tensor scale for NVFP4, UE8M0 for MXFP4), round-to-nearest-even; "
        "outliers: channels 3 and 77 scaled x30; RHT: 16-point, fixed signs. INT4 = E1M2 here.",
        "",
        "| data | format | RHT | SQNR (dB) | paper | alpha | paper | bucket entropy (bits) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        paper = r["paper_sqnr_db"]
        ps = "" if paper is None else f"{paper:.2f} ({r['sqnr_db'] - paper:+.2f})"
        pa = "" if r["paper_alpha"] is None else f"{r['paper_alpha']:.4f}"
        lines.append(
            f"| {r['data']} | {r['fmt']} | {'yes' if r['rht'] else 'no'} | {r['sqnr_db']:.2f} | {ps} | "
            f"{r['alpha']:.4f} | {pa} | {r['entropy_bits']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def grid_plot(result: dict, path: str) -> None:
    """grid.png: the shrinkage bias per level of each grid, and the SQNR of every format with and without RHT."""
    from quant.grids import grid_max

    with plotting.figure(path, size=(11, 4.3), ncols=2, grid=None, legend_size=8, title=result["command"]) as (
        ax1,
        ax2,
    ):
        for marker, (fmt, levels) in zip("osd", result["bias"].items()):
            qs = [float(q) for q in levels]
            ax1.plot(
                [q / grid_max(fmt) for q in qs],
                [100 * b / q for q, b in zip(qs, levels.values())],
                marker + "-",
                label=fmt,
                alpha=0.8,
            )
        ax1.axhline(0, color="k", lw=0.5)
        ax1.set_xlabel("level / grid max")
        ax1.set_ylabel("mean rounding error of the level's bin\n(% of the level)")
        ax1.set_title("Shrinkage bias per level (locally uniform density): E2M1 -6.25% at 2 and 4", fontsize=9)
        rows = result["rows"]
        labels = [f"{r['fmt']}{' +RHT' if r['rht'] else ''}" for r in rows if r["data"] == "gaussian"]
        xs = np.arange(len(labels))
        for j, dist in enumerate(("gaussian", "outliers")):
            ax2.bar(
                xs + 0.4 * j - 0.2,
                [r["sqnr_db"] for r in rows if r["data"] == dist],
                width=0.4,
                label="N(0,1)" if dist == "gaussian" else "2 channels x30",
            )
        ax2.set_xticks(xs, labels, rotation=30, fontsize=7)
        ax2.set_ylabel("SQNR (dB)")
        ax2.set_ylim(15, 27)
        ax2.set_title("SQNR of 1 x 16 block quantisation: RHT helps the uniform grid, hurts E2M1", fontsize=9)


# ------------------------------------------------------------------------------------------------------ train


def seeds(recipe: str) -> tuple[int, ...]:
    """The seeds a recipe is trained with."""
    return HEADLINE_SEEDS if recipe in HEADLINE else SEEDS


def plan() -> list[dict]:
    """Every training run: name, recipe, seed and precision flags."""
    runs = [{"name": f"{r}_s{s}", "recipe": r, "seed": s, "flags": {"recipe": r}} for r in RECIPES for s in seeds(r)]
    runs += [{"name": f"{n}_s0", "recipe": n, "seed": 0, "flags": f} for n, f in ABLATION.items()]
    return runs


def train(run: dict, steps: int, out: str) -> dict:
    """Runs (or reuses) one training run; returns its held-out loss, training-loss curve and speed."""
    workdir = os.path.join(out, "runs", run["name"])
    flags = [
        "--config.mesh.site=1",
        "--config.mesh.data=1",
        f"--config.train.seed={run['seed']}",
        f"--config.data.seed={run['seed']}",
        f"--config.train.eval_every={steps}",
        "--config.train.eval_batches=16",
        f"--config.checkpoint.every={steps}",
        *(f"--config.precision.{k}={v}" for k, v in run["flags"].items()),
    ]
    summary = runs.run_or_reuse(CONFIG, workdir, flags, steps)
    return {
        "val_loss": summary["val_loss"],
        "curve": runs.read_metric(workdir, "train_loss"),
        "tokens_per_second": summary["tokens_per_second"],
    }


def relative_error(run: dict, bf16: dict, steps: int) -> tuple[float, float]:
    """(mean |L - L_bf16| / L_bf16 over the logged steps in the last 20%, mean train loss there)."""
    ref = dict(bf16["curve"])
    tail = [(s, loss) for s, loss in run["curve"] if s > 0.8 * steps]
    return (float(np.mean([abs(loss - ref[s]) / ref[s] for s, loss in tail])), float(np.mean([x for _, x in tail])))


def recipe_row(results: dict[str, dict], recipe: str, seeds_: Sequence[int], steps: int) -> dict[str, Any]:
    """One recipe's row of the training tables: its loss error against the reference run of each seed
    (`relative_error`), held-out losses and speed, per seed and their means."""
    runs_ = [results[f"{recipe}_s{s}"] for s in seeds_]
    errors = [relative_error(run, results[f"{REFERENCE}_s{s}"], steps) for run, s in zip(runs_, seeds_)]
    val = [run["val_loss"] for run in runs_]
    return {
        "recipe": recipe,
        "seeds": list(seeds_),
        "rel_error": [e for e, _ in errors],
        "rel_error_mean": float(np.mean([e for e, _ in errors])),
        "tail_loss": float(np.mean([t for _, t in errors])),
        "val_loss": val,
        "val_loss_mean": float(np.mean(val)),
        "tokens_per_second": float(np.mean([run["tokens_per_second"] for run in runs_])),
    }


def train_all(study: harness.Study, steps: int, jobs: int) -> None:
    """Trains (or reuses) every run of `plan` in `study.out`/runs, `jobs` at a time; writes table.md, table.json
    and loss_error.png into `study.out`, which state the command `--parts train` (with `--jobs 1`: the runs'
    results do not depend on it)."""
    runs, results = plan(), {}
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(train, run, steps, study.out): run for run in runs}
        for i, future in enumerate(concurrent.futures.as_completed(futures)):
            run = futures[future]
            results[run["name"]] = future.result()
            study.progress(i + 1, len(runs), f"{run['name']}: held-out loss {results[run['name']]['val_loss']:.4f}")
    rows = [recipe_row(results, r, seeds(r), steps) for r in RECIPES]
    ablation = []
    for name in (*ABLATION, "ufp4"):
        run = results[f"{name}_s0"]
        error, tail = relative_error(run, results["bf16_s0"], steps)
        ablation.append(
            {
                "name": name,
                "tail_loss": tail,
                "rel_error": error,
                "val_loss": run["val_loss"],
                "paper_loss": PAPER_ABLATION[name],
            }
        )
    by = {r["recipe"]: r for r in rows}
    e2m1, ufp4 = by["e2m1_baseline"]["rel_error_mean"], by["ufp4"]["rel_error_mean"]
    paired = np.subtract(by["e2m1_baseline"]["rel_error"], by["ufp4"]["rel_error"])  # same seed, same tokens
    result = {
        "steps": steps,
        "seeds": list(SEEDS),
        "headline_seeds": list(HEADLINE_SEEDS),
        "rows": rows,
        "ablation": ablation,
        "ufp4_gap_vs_e2m1": 1 - ufp4 / e2m1,
        "paired_difference": {
            "mean": float(paired.mean()),
            "standard_error": float(paired.std(ddof=1) / np.sqrt(len(paired))),
        },
    }
    result["curves"] = {name: r["curve"] for name, r in sorted(results.items())}  # what loss_error.png draws
    study.write("table", result, train_markdown, {"loss_error.png": error_plot}, parts=["train"], jobs=1)


def train_subset(study: harness.Study, steps: int, recipes: list[str]) -> None:
    """`--recipes`: the training part for bf16 and `recipes` only, seeds SEEDS, rerun side by side in this session
    (runs in `study.out`/runs like the full table's); writes table_recipes.md / .json with the rows the full table
    has (no ablation, no headline reading)."""
    chosen = [REFERENCE, *(r for r in recipes if r != REFERENCE)]
    plan_: list[dict[str, Any]] = [
        {"name": f"{r}_s{s}", "recipe": r, "seed": s, "flags": {"recipe": r}} for r in chosen for s in SEEDS
    ]
    results: dict[str, dict] = {}
    for i, run in enumerate(plan_):
        name = str(run["name"])
        results[name] = train(run, steps, study.out)
        study.progress(i + 1, len(plan_), f"{name}: held-out loss {results[name]['val_loss']:.4f}")
    rows = [recipe_row(results, r, SEEDS, steps) for r in chosen]
    result = {"steps": steps, "seeds": list(SEEDS), "rows": sorted(rows, key=lambda r: r["val_loss_mean"])}
    study.write("table_recipes", result, subset_markdown, parts=["train"], always=("steps", "recipes"))


def subset_markdown(result: dict) -> str:
    """table_recipes.md: the chosen recipes beside bf16, ordered by held-out loss."""
    lines = [
        "# UFP4 at CPU scale: chosen recipes beside BF16, rerun side by side",
        "",
        f"`{result['command']}`: the training part's setting (quickstart MoE, one device, {result['steps']} steps x 8 "
        f"x 256 byte-tokens, seeds {result['seeds']}) for these recipes only, all run in this session. Relative loss "
        "error as in table.md (against the BF16 run of the same seed). Ordered by mean held-out loss.",
        "",
        "| recipe | held-out loss (mean) | per seed | rel. loss error (mean) | per seed | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        per_val = " / ".join(f"{v:.4f}" for v in r["val_loss"])
        per_err = " / ".join(f"{100 * e:.2f}%" for e in r["rel_error"])
        lines.append(
            f"| {r['recipe']} | {r['val_loss_mean']:.4f} | {per_val} | {100 * r['rel_error_mean']:.2f}% | {per_err} | "
            f"{r['tokens_per_second']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def train_markdown(result: dict) -> str:
    """table.md: the loss error per recipe, the UFP4 against E2M1 reading, the ablation."""
    steps = result["steps"]
    lines = [
        "# UFP4 at CPU scale: 4-bit training of the quickstart MoE",
        "",
        f"`{result['command']}`: quickstart MoE on one device, "
        f"{steps} steps x 8 x 256 byte-tokens, seeds {result['seeds']} ({result['headline_seeds']} for "
        f"{', '.join(HEADLINE)}). none: float32 GEMMs; bf16 (the reference): GEMM operands rounded to bfloat16, "
        f"float32 accumulation; every recipe keeps the head, routers and embeddings in float32. "
        f"Relative loss error: |L - L_bf16| / "
        f"L_bf16 of the training loss (logged every 10 steps, same seed and tokens as the BF16 run) averaged over "
        f"the last 20% of steps; the paper's figure of merit. Held-out loss on 16 batches at the end. The loss "
        f"columns average each row's own seeds: compare them only between rows with the same seeds. tokens/s "
        f"were measured with other jobs on the machine (`python -m experiments.bench.quant` times the steps).",
        "",
        "| recipe | rel. loss error (mean) | per seed | train loss, last 20% | held-out loss (mean) | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        per = " / ".join(f"{100 * e:.2f}%" for e in r["rel_error"])
        lines.append(
            f"| {r['recipe']} | {100 * r['rel_error_mean']:.2f}% | {per} | {r['tail_loss']:.4f} | "
            f"{r['val_loss_mean']:.4f} | {r['tokens_per_second']:,.0f} |"
        )
    gap, paired = result["ufp4_gap_vs_e2m1"], result["paired_difference"]
    verdict = (
        "smaller, beyond two standard errors"
        if paired["mean"] > 2 * paired["standard_error"]
        else "larger, beyond two standard errors"
        if paired["mean"] < -2 * paired["standard_error"]
        else "not distinguishable from E2M1's: the difference is within two standard errors"
    )
    lines += [
        "",
        f"UFP4's mean loss error is {100 * abs(gap):.0f}% {'smaller' if gap > 0 else 'larger'} than the "
        f"E2M1 baseline's (the paper: about 20% smaller at 1.5B-124B). Per seed, E2M1 minus UFP4 is "
        f"{100 * paired['mean']:+.2f} +- {100 * paired['standard_error']:.2f} points (mean +- standard error "
        f"over {len(result['headline_seeds'])} seeds): at our scale UFP4's gap is **{verdict}**.",
        "",
        "Ablation on the E1M2 grid (seed 0; the paper's Dense 1.5B numbers beside, mean LM loss):",
        "",
        "| configuration | train loss, last 20% | rel. loss error | held-out loss | paper |",
        "|---|---|---|---|---|",
    ]
    for a in result["ablation"]:
        lines.append(
            f"| {a['name']} | {a['tail_loss']:.4f} | {100 * a['rel_error']:.2f}% | {a['val_loss']:.4f} | "
            f"{a['paper_loss']:.5f} |"
        )
    return "\n".join(lines) + "\n"


def error_plot(result: dict, path: str) -> None:
    """loss_error.png: each 4-bit recipe's training loss relative to BF16's (same seed), mean over seeds, as a
    5-point mean against step; the last 20% (where the table averages) shaded; the command as the title. `result`:
    table.json's record (its "steps", "command" and "curves": run name -> [(step, train loss), ...])."""
    curves_of, steps = result["curves"], result["steps"]
    with plotting.figure(path, size=(7, 4.3), title=result["command"]) as ax:
        for r in (r for r in RECIPES if r != REFERENCE):
            curves = []
            for s in seeds(r):
                ref = dict(curves_of[f"bf16_s{s}"])
                curves.append([(st, (loss - ref[st]) / ref[st]) for st, loss in curves_of[f"{r}_s{s}"]])
            xs, smooth = plotting.moving_average(*plotting.mean_curve(curves), 5)
            ax.plot(xs, 100 * smooth, label=r)
        ax.axhline(0, color="k", lw=0.5)
        ax.axvspan(0.8 * steps, steps, color="gray", alpha=0.1, label="last 20%")
        ax.set_xlabel("step")
        ax.set_ylabel("(L - L_bf16) / L_bf16 (%), 5-point mean")
        ax.set_title("Training loss relative to BF16, quickstart MoE, mean over seeds", fontsize=9)


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = harness.Study(__doc__, module="experiments.reproduce.ufp4", topic="ufp4")
    parser = study.parser
    harness.add_parts(parser, PARTS)
    harness.add_steps(
        parser,
        default=400,
        multiple_of=50,
        why="the last 20%, where the loss error is averaged, is whole 10-step logging intervals",
    )
    parser.add_argument(
        "--jobs", type=harness.integer(1), default=1, help="training runs at once (each its own process), >= 1"
    )
    parser.add_argument(
        "--recipes",
        type=harness.names(RECIPES),
        default=None,
        help="with --parts train: only these recipes beside bf16 (table_recipes.md; the full table otherwise)",
    )
    args = study.parse(argv)
    parts = args.parts
    if "grid" in parts:
        grid_analysis(study)
    if args.recipes is not None and parts != ["train"]:
        parser.error(f"--recipes={','.join(args.recipes)} needs --parts train alone")
    if "train" in parts:
        if args.recipes is not None:
            train_subset(study, args.steps, args.recipes)
        else:
            train_all(study, args.steps, args.jobs)
    if "fidelity" in parts:
        ufp4_fidelity.fidelity_all(study, args.steps, CONFIG)


if __name__ == "__main__":
    command.run(main)
