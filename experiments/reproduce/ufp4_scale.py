"""UFP4 at scale on one accelerator: bf16, nvfp4 (E2M1), ufp4 and mxfp4 each train a 113M-parameter dense decoder
for the same token budget, sized to fit `--minutes`, and the held-out loss of each against BF16's, paired by seed.

    python -m experiments.reproduce.ufp4_scale [--minutes 4] [--seeds 0,1] [--recipes bf16,nvfp4,ufp4,mxfp4]
        [--steps 0] [--tiny] [--out runs/ufp4_scale]

The model: experiments.schema.default_config with d_model 768, 12 layers, 12 heads (head dim 64), SwiGLU d_ff 3072,
byte-level (vocabulary 264, the built-in corpus: the Python standard library's sources), float32 parameters;
113M parameters. Batch 16 x 512 tokens, AdamW at 6e-4 warmed up over 20 steps, then constant: the step count is
sized after each recipe's step is compiled and timed, and a decaying schedule would bake it into the compiled
program. One device (mesh.site = mesh.data = 1). Each run's seed sets the initialisation, the data order and the
recipe's fixed RHT signs (`train.seed` = `data.seed`, as experiments.reproduce.ufp4); every recipe of a seed sees
the same tokens. Recipes are quant.recipes' (`precision.recipe`): bf16 = bfloat16 GEMM operands with float32
accumulation (the reference), nvfp4 = NVIDIA's E2M1 recipe, ufp4 = the uniform E1M2 grid with RHT16 on all three
GEMMs, mxfp4 = the OCP E2M1 baseline; 4-bit arithmetic is emulated (fake quantisation, then the matmul).

The budget: each recipe's first run is built, compiled and timed over a few steps (which count as its first steps),
its held-out evaluation too; then the step count is the largest that fits what is left of `--minutes` for every
run (compilations of the later seeds' programs and their evaluations included), split evenly over the runs. When
even a short run of every seed does not fit, the last seeds are dropped; when compiling the recipes would take 70%
of the budget, the last recipes are (bf16 and one more stay; either is said so). `--steps N` fixes the count
instead. The record's command states the steps, seeds and recipes that ran, so it reproduces the same token budget.
After every seed the outputs are rewritten with what has finished (`complete` false until the last).

Reported: held-out loss (nats per byte token, 8 fixed batches of the held-out stream) per recipe and seed, the gap
to bf16 per seed and its mean +- 2 standard errors over seeds (one seed: no interval), tokens per second of the
timed steps, compile seconds -> ufp4_scale.json, ufp4_scale.md, ufp4_scale.png in `--out`.

`--tiny` runs the same code path in seconds on a CPU (d_model 32, 2 layers, batch 2 x 32, 2 held-out batches).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from core import data as data_lib
from core import train as train_lib
from experiments import build, command, harness, plotting, report, schema
from quant import recipes as quant_recipes

RECIPES = ("bf16", "nvfp4", "ufp4", "mxfp4")
REFERENCE = "bf16"  # every gap is against the same seed's bf16 run
WARM_CALLS = 2  # the first calls compile (core.train.PlainStepper.warmup_calls)
PROBE = 3  # steps timed per recipe before the budget is sized
CALIBRATION_SHARE = 0.7  # recipes beyond bf16 and one more are left out if compiling them would pass this share
SAFETY = 0.9  # share of the time left that the sized steps may use (the estimate's error, writing the outputs)
SIZES: dict[str, dict[str, Any]] = {
    "scale": {
        "model": {"d_model": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 12, "d_ff": 3072},
        "data": {"seq_len": 512, "batch_size": 16},
        "learning_rate": 6e-4,
        "warmup_steps": 20,
        "eval_batches": 8,
    },
    "tiny": {
        "model": {"d_model": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2, "d_ff": 64},
        "data": {"seq_len": 32, "batch_size": 2},
        "learning_rate": 3e-3,
        "warmup_steps": 2,
        "eval_batches": 2,
    },
}
MIN_STEPS = WARM_CALLS + PROBE + 1  # an explicit --steps must go past the timed steps


def make_config(size: str, recipe: str, seed: int):
    """The experiment config of one run: default_config with the `size` preset, the recipe and the seed (train
    and data), on one device; schedule warm-up then constant, so the optimizer does not depend on the steps."""
    preset = SIZES[size]
    config = schema.default_config()
    config.model.update(**preset["model"])
    config.data.update(**preset["data"], seed=seed)
    config.mesh.update(site=1, data=1)
    config.optim.update(learning_rate=preset["learning_rate"], warmup_steps=preset["warmup_steps"], schedule="constant")
    config.train.update(seed=seed, eval_batches=preset["eval_batches"], steps=max(preset["warmup_steps"], 1))
    config.precision.recipe = recipe
    schema.validate(config, num_devices=jax.device_count())
    return config


class Timing(NamedTuple):
    """What the budget is sized from, per recipe (its first seed's run): seconds per train step, seconds to build and
    compile a run (the first calls included), seconds of an evaluation with its compilation, steps already done."""

    step: float
    compile: float
    evaluation: float
    done: int


class Run:
    """One (recipe, seed) run: its state and stepper, the steps done, the train losses, timings."""

    def __init__(self, config, corpus):
        self.recipe, self.seed = config.precision.recipe, config.train.seed
        started = time.perf_counter()
        _, sharder = build.build_mesh(config)
        optimizer = build.build_optimizer(config)
        model_fn = build.build_model_fn(config, sharder)
        self.num_params = report.count_params(model_fn)
        graphdef, self.state = train_lib.init_state(model_fn, optimizer, self.seed, sharder)
        batches = data_lib.Batches(
            corpus, seq_len=config.data.seq_len, global_batch=config.data.batch_size, seed=self.seed
        )
        self.tokens_per_step = config.data.batch_size * config.data.seq_len
        self.stepper = train_lib.PlainStepper(
            graphdef, optimizer, batches, sharder, eval_batches=config.train.eval_batches
        )
        self.done, self.losses, self.step_seconds = 0, [], []
        self.advance(WARM_CALLS, timed=False)
        self.compile_seconds = time.perf_counter() - started  # building, compiling and the first calls
        self.eval_seconds = 0.0

    def advance(self, steps: int, *, timed: bool = True) -> None:
        """`steps` more train steps (each synchronised: its loss is read)."""
        for _ in range(steps):
            t0 = time.perf_counter()
            self.state, metrics = self.stepper.step(self.state, self.done)
            if timed:
                self.step_seconds.append(time.perf_counter() - t0)
            self.losses.append(metrics["loss"])
            self.done += 1

    def evaluate(self) -> float:
        """Held-out loss (nats per token) now; its seconds are kept (the first includes the compilation)."""
        t0 = time.perf_counter()
        loss = float(self.stepper.evaluate(self.state)["val_loss"])
        self.eval_seconds = time.perf_counter() - t0
        return loss

    def seconds_per_step(self) -> float:
        return float(np.median(self.step_seconds))

    def timing(self) -> Timing:
        return Timing(self.seconds_per_step(), self.compile_seconds, self.eval_seconds, self.done)

    def result(self) -> dict:
        """What the record keeps of a finished run (the state is dropped)."""
        val = self.evaluate()
        del self.state  # its memory goes back before the next run starts
        return {
            "recipe": self.recipe,
            "seed": self.seed,
            "steps": self.done,
            "val_loss": val,
            "train_loss": self.losses,
            "tokens_per_second": self.tokens_per_step / self.seconds_per_step(),
            "compile_seconds": self.compile_seconds,
        }


def sized_steps(budget: float, timings: Mapping[str, Timing], n_seeds: int) -> int:
    """The steps every run can take in `budget` seconds (of which SAFETY is used): the first seed's runs continue
    from their calibration (`done` steps taken, their evaluation compiled), each later seed's runs compile again
    (as long as the first seed's did) and compile their evaluation, and every run ends with an evaluation. May be
    below MIN_STEPS (then the budget does not fit `n_seeds`)."""
    t = timings.values()
    fixed = sum(x.evaluation - x.done * x.step for x in t) + (n_seeds - 1) * sum(
        x.compile + 2 * x.evaluation for x in t
    )
    return int((SAFETY * budget - fixed) // (n_seeds * sum(x.step for x in t)))


def gaps(rows: list[dict], recipes: list[str], seeds: list[int]) -> dict[str, dict]:
    """Per recipe: the held-out loss per seed, its mean, the gap to the same seed's bf16 run per seed, its mean and
    the half-width of mean +- 2 standard errors (std with ddof 1 / sqrt(n); None for one seed)."""
    loss = {(r["recipe"], r["seed"]): r["val_loss"] for r in rows}
    out = {}
    for recipe in recipes:
        values = np.array([loss[recipe, s] for s in seeds])
        diff = values - np.array([loss[REFERENCE, s] for s in seeds])
        half = float(2 * diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else None
        out[recipe] = {
            "val_loss": values.tolist(),
            "val_loss_mean": float(values.mean()),
            "gap": diff.tolist(),
            "gap_mean": float(diff.mean()),
            "gap_half_width": half,
            "tokens_per_second": float(np.mean([r["tokens_per_second"] for r in rows if r["recipe"] == recipe])),
        }
    return out


def markdown(result: dict) -> str:
    """ufp4_scale.md: held-out loss per recipe, the gap to bf16 with its interval, tokens/s."""
    seeds, steps = result["seeds"], result["steps"]
    lines = [
        "# UFP4 at scale: 4-bit training recipes against BF16",
        "",
        f"`{result['command']}`: a {result['num_params'] / 1e6:.1f}M-parameter dense decoder ({result['size']} "
        f"size), {steps} steps x {result['tokens_per_step']:,} tokens = {steps * result['tokens_per_step']:,} "
        f"tokens per run, seeds {seeds} (paired: the same tokens for every recipe of a seed). Held-out loss in "
        "nats per token; gap = loss - the same seed's bf16 loss, mean +- 2 standard errors over seeds. 4-bit "
        "arithmetic is emulated (fake quantisation), so tokens/s measures the quantisers' cost, not 4-bit speed."
        + ("" if result["complete"] else " **Partial: the runs of later seeds have not finished.**"),
        "",
        "| recipe | held-out loss (mean) | per seed | gap to bf16 | tokens/s |",
        "|---|---|---|---|---|",
    ]
    for recipe, g in result["recipes"].items():
        per = " / ".join(f"{v:.4f}" for v in g["val_loss"])
        if recipe == REFERENCE:
            gap = "(reference)"
        elif g["gap_half_width"] is None:
            gap = f"{g['gap_mean']:+.4f} (one seed: no interval)"
        else:
            gap = f"{g['gap_mean']:+.4f} +- {g['gap_half_width']:.4f}"
        lines.append(f"| {recipe} | {g['val_loss_mean']:.4f} | {per} | {gap} | {g['tokens_per_second']:,.0f} |")
    for what in ("seeds", "recipes"):
        if result[f"dropped_{what}"]:
            lines += [
                "",
                f"{what.capitalize()} {result[f'dropped_{what}']} were left out: they did not fit in the time budget.",
            ]
    lines += [
        "",
        f"Budget: {result['minutes']:g} minutes; steps {'sized from it' if result['sized'] else 'fixed by --steps'}; "
        f"the whole study took {result['wall_seconds'] / 60:.1f} minutes. Compile seconds (building, compiling, "
        "the first two steps) per run: "
        + ", ".join(f"{r['recipe']}/s{r['seed']} {r['compile_seconds']:.1f}" for r in result["runs"])
        + ".",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """ufp4_scale.png: the train loss per recipe (mean over seeds) against step, and each 4-bit recipe's gap to
    bf16 (per seed as points, the mean with its +- 2 standard errors bar when there are two seeds or more)."""
    names = list(result["recipes"])
    color = plotting.colors(names)
    with plotting.figure(path, size=(11, 4.3), ncols=2, title=result["command"]) as (ax1, ax2):
        for recipe in names:
            curves = [r["train_loss"] for r in result["runs"] if r["recipe"] == recipe]
            ax1.plot(np.arange(1, len(curves[0]) + 1), np.mean(curves, axis=0), color=color[recipe], label=recipe)
        ax1.set_xlabel("step")
        ax1.set_ylabel("train loss (nats per token), mean over seeds")
        ax1.set_title("Training loss per recipe", fontsize=9)
        others = [n for n in names if n != REFERENCE]
        for i, recipe in enumerate(others):
            g = result["recipes"][recipe]
            ax2.plot([i] * len(g["gap"]), g["gap"], "o", color=color[recipe], alpha=0.5, label=f"{recipe} per seed")
            ax2.errorbar(
                [i + 0.15],
                [g["gap_mean"]],
                yerr=None if g["gap_half_width"] is None else [g["gap_half_width"]],
                fmt="s",
                color=color[recipe],
                capsize=3,
            )
        ax2.axhline(0, color="k", lw=0.5)
        ax2.set_xticks(range(len(others)), others)
        ax2.set_ylabel("held-out loss - bf16's (same seed)")
        ax2.set_title("Gap to BF16: seeds, mean +- 2 standard errors", fontsize=9)


def _steps(text: str) -> int:
    """--steps: 0 (sized from --minutes) or an integer >= MIN_STEPS."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value != 0 and value < MIN_STEPS:
        raise argparse.ArgumentTypeError(f"{text!r} is not 0 (sized from --minutes) or an integer >= {MIN_STEPS}")
    return value


def _recipes(text: str) -> list[str]:
    """--recipes: names from quant.recipes.RECIPES, bf16 among them (the gaps are against it)."""
    names = harness.names(quant_recipes.RECIPES)(text)
    if REFERENCE not in names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct names with {REFERENCE} among them")
    return [REFERENCE] + [n for n in names if n != REFERENCE]


def make_study() -> harness.Study:
    """The study and its command line (the flags of the module docstring)."""
    study = harness.Study(__doc__, module="experiments.reproduce.ufp4_scale", topic="ufp4_scale")
    p = study.parser
    p.add_argument(
        "--minutes",
        type=harness.number(0, low_open=True),
        default=4.0,
        help="time budget of the whole study in minutes, > 0: the steps are sized to fit it",
    )
    harness.add_seeds(
        p, default="0,1", what="initialisation, data order and RHT signs; every recipe of a seed sees the same tokens"
    )
    p.add_argument(
        "--recipes",
        type=_recipes,
        default=",".join(RECIPES),
        help=f"recipes to train, comma-separated names from {list(quant_recipes.RECIPES)}, bf16 among them",
    )
    p.add_argument(
        "--steps",
        type=_steps,
        default=0,
        help=f"training steps of every run: 0 sizes them from --minutes; else an integer >= {MIN_STEPS}",
    )
    p.add_argument("--tiny", action="store_true", help="d_model 32, 2 layers, batch 2 x 32: the code path in seconds")
    return study


def main(argv=None) -> None:
    """The command line: see the module docstring, or --help."""
    study = make_study()
    args = study.parse(argv)
    started, size = time.perf_counter(), "tiny" if args.tiny else "scale"
    seeds, recipes, skipped = list(args.seeds), list(args.recipes), list[str]()
    corpus, _ = build.build_data(make_config(size, REFERENCE, seeds[0]))

    first: dict[str, Run] = {}
    for i, recipe in enumerate(list(recipes)):
        spent = time.perf_counter() - started
        if not args.steps and i >= 2 and spent * (i + 1) / i > CALIBRATION_SHARE * 60 * args.minutes:
            skipped, recipes = recipes[i:], recipes[:i]
            print(f"recipes {skipped} left out: compiling them would not leave time to train", flush=True)
            break
        run = first[recipe] = Run(make_config(size, recipe, seeds[0]), corpus)
        run.advance(PROBE)
        run.evaluate()  # compiles the evaluation and times it
        study.progress(
            i + 1,
            len(recipes),
            f"{recipe}: compiled in {run.compile_seconds:.1f} s, {1e3 * run.seconds_per_step():.1f} ms per step",
        )
    steps, dropped = args.steps, list[int]()
    if not steps:
        left = 60 * args.minutes - (time.perf_counter() - started)
        while (
            steps := sized_steps(left, {r: run.timing() for r, run in first.items()}, len(seeds))
        ) < MIN_STEPS and len(seeds) > 1:
            dropped.insert(0, seeds.pop())
        steps = max(steps, MIN_STEPS)
        print(f"{steps} steps per run for seeds {seeds}" + (f" (seeds {dropped} do not fit)" if dropped else ""))
    results: list[dict] = []
    for k, seed in enumerate(seeds):
        for recipe in recipes:
            run = first.pop(recipe) if k == 0 else Run(make_config(size, recipe, seed), corpus)
            run.advance(steps - run.done)
            results.append(run.result())
            study.progress(
                len(results),
                len(seeds) * len(recipes),
                f"{recipe} seed {seed}: held-out loss {results[-1]['val_loss']:.4f}",
            )
        done = seeds[: k + 1]
        result = {
            "size": size,
            "num_params": run.num_params,
            "tokens_per_step": run.tokens_per_step,
            "minutes": args.minutes,
            "sized": not args.steps,
            "steps": steps,
            "seeds": done,
            "dropped_seeds": dropped,
            "dropped_recipes": skipped,
            "complete": k == len(seeds) - 1,
            "wall_seconds": time.perf_counter() - started,
            "recipes": gaps(results, recipes, done),
            "runs": results,
        }
        study.write("ufp4_scale", result, markdown, {"ufp4_scale.png": plot}, steps=steps, seeds=done, recipes=recipes)


if __name__ == "__main__":
    command.run(main)
