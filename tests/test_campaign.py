"""The device campaigns (experiments/bench/gpu.sh, tpu.sh) and the recipe question at scale
(experiments.reproduce.ufp4_scale), dry-run on this CPU along the code path a device runs.

ufp4_scale --tiny trains bf16 and ufp4 (d_model 32, 2 layers, 6 steps; one seed by default, two under `slow`): its
record states a command that parses back to the arguments that ran, equal tokens for every run, and gaps to bf16
that a NumPy recomputation from the per-seed held-out losses gives (mean, mean +- 2 standard errors; one seed: no
interval). The gaps over three and four seeds, the budget sizing and the refusals are checked on their own. gpu.sh
in dry-run mode (CAMPAIGN_DRY_RUN=1: CPU platform, one kernel test case) runs its environment and kernel-test parts
by default; the whole of both scripts' dry runs (tiny decode contexts, ufp4_scale --tiny, and the quant benchmark,
which compiles nine recipes' train steps of the quickstart MoE: minutes on two CPU cores) is marked slow."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments.reproduce import ufp4_scale

ROOT = pathlib.Path(__file__).resolve().parent.parent
PARTS = ("environment", "kernel-tests", "decode-bench", "quant-bench", "recipe-question")
WRITES = {  # what each part leaves in $OUT
    "environment": ("environment.json",),
    "kernel-tests": ("kernel_tests.xml",),
    "decode-bench": ("decode.json", "decode.md", "decode.png"),
    "quant-bench": ("quant.json", "quant.md"),
    "recipe-question": ("ufp4_scale.json", "ufp4_scale.md", "ufp4_scale.png"),
}


def _expected_gaps(runs: list[dict], recipe: str, seeds: list[int]) -> tuple[float, float | None]:
    """Mean gap to bf16 and the 2-standard-error half-width, recomputed in float64 from the runs' losses."""
    loss = {(r["recipe"], r["seed"]): r["val_loss"] for r in runs}
    d = np.array([loss[recipe, s] for s in seeds], np.float64) - np.array([loss["bf16", s] for s in seeds])
    half = None if len(d) < 2 else 2 * math.sqrt(np.sum((d - d.mean()) ** 2) / (len(d) - 1)) / math.sqrt(len(d))
    return float(d.mean()), half


@pytest.mark.parametrize("seeds", [[1], pytest.param([0, 1], marks=pytest.mark.slow)])
def test_tiny_study_records_paired_gaps_that_numpy_recomputes(seeds, tmp_path):
    given = ",".join(map(str, seeds))
    argv = ["--tiny", "--steps", "6", "--seeds", given, "--recipes", "ufp4,bf16", "--out", str(tmp_path)]
    ufp4_scale.main(argv)
    record = json.loads((tmp_path / "ufp4_scale.json").read_text())
    args = ufp4_scale.make_study().parser.parse_args(argv)
    words = record["command"].split()
    assert words[:3] == ["python", "-m", "experiments.reproduce.ufp4_scale"]
    assert ufp4_scale.make_study().parser.parse_args(words[3:]) == args
    assert record["complete"] and record["seeds"] == seeds and list(record["recipes"]) == ["bf16", "ufp4"]
    assert len(record["runs"]) == 2 * len(seeds) and record["num_params"] > 0
    for run in record["runs"]:  # an equal token budget, and learning: below the uniform loss over 264 ids
        assert run["steps"] == 6 and len(run["train_loss"]) == 6 and run["tokens_per_second"] > 0
        assert math.isfinite(run["val_loss"]) and run["val_loss"] < math.log(264)
    for recipe, g in record["recipes"].items():
        mean, half = _expected_gaps(record["runs"], recipe, seeds)
        np.testing.assert_allclose(g["gap_mean"], mean, rtol=1e-12, atol=1e-15)
        if half is None:
            assert g["gap_half_width"] is None
        else:
            np.testing.assert_allclose(g["gap_half_width"], half, rtol=1e-12, atol=1e-15)
    table = (tmp_path / "ufp4_scale.md").read_text()
    g = record["recipes"]["ufp4"]
    interval = "(one seed: no interval)" if len(seeds) == 1 else f"+- {g['gap_half_width']:.4f}"
    assert f"| ufp4 | {g['val_loss_mean']:.4f} |" in table and f"{g['gap_mean']:+.4f} {interval} |" in table
    assert (tmp_path / "ufp4_scale.png").stat().st_size > 0


@pytest.mark.parametrize("seeds", [[3], [0, 1, 2], [5, 1, 4, 2]])
def test_gaps_and_their_interval_against_numpy(seeds):
    rng = np.random.default_rng(len(seeds))
    recipes = ["bf16", "nvfp4", "ufp4", "mxfp4"]
    runs = [
        {
            "recipe": r,
            "seed": s,
            "val_loss": float(rng.uniform(1.5, 2.5)),
            "tokens_per_second": float(rng.uniform(1, 9)),
        }
        for r in recipes
        for s in seeds
    ]
    out = ufp4_scale.gaps(runs, recipes, seeds)
    for recipe in recipes:
        mean, half = _expected_gaps(runs, recipe, seeds)
        np.testing.assert_allclose(out[recipe]["gap_mean"], mean, rtol=1e-12, atol=1e-15)
        assert (out[recipe]["gap_half_width"] is None) == (half is None)
        if half is not None:
            np.testing.assert_allclose(out[recipe]["gap_half_width"], half, rtol=1e-12)
    record = {
        "command": "python -m experiments.reproduce.ufp4_scale",
        "seeds": seeds,
        "steps": 10,
        "size": "tiny",
        "num_params": 1000,
        "tokens_per_step": 64,
        "complete": True,
        "dropped_seeds": [],
        "dropped_recipes": [],
        "minutes": 1.0,
        "sized": True,
        "wall_seconds": 30.0,
        "recipes": out,
        "runs": [{**r, "compile_seconds": 1.0} for r in runs],
    }
    table = ufp4_scale.markdown(record)
    assert ("one seed: no interval" in table) == (len(seeds) == 1)


@pytest.mark.parametrize("n_seeds", [1, 2, 3])
def test_sized_steps_are_the_most_that_fit_the_budget(n_seeds):
    runs = {
        r: ufp4_scale.Timing(step=0.1 * (i + 1), compile=7.0 + i, evaluation=0.5 * (i + 1), done=5)
        for i, r in enumerate(ufp4_scale.RECIPES)
    }

    def needed(steps: int) -> float:  # the rest of the first seed's runs, then every later seed's from scratch
        first = sum((steps - r.done) * r.step + r.evaluation for r in runs.values())
        later = sum(r.compile + steps * r.step + 2 * r.evaluation for r in runs.values())
        return first + (n_seeds - 1) * later

    budget = 300.0
    steps = ufp4_scale.sized_steps(budget, runs, n_seeds)
    assert steps > ufp4_scale.MIN_STEPS
    assert needed(steps) <= ufp4_scale.SAFETY * budget + 1e-9 < needed(steps + 1)


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--steps", "3", "integer >= 6"),
        ("--recipes", "ufp4,mxfp4", "bf16 among them"),
        ("--recipes", "bf16,fp3", "unknown"),
        ("--minutes", "0", "> 0"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag_and_the_value(flag, value, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        ufp4_scale.make_study().parser.parse_args([flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and flag in err and repr(value) in err and says in err


def test_help_states_the_first_paragraph_and_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        ufp4_scale.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0 and text.startswith("usage: python -m experiments.reproduce.ufp4_scale ")
    assert " ".join((ufp4_scale.__doc__ or "").strip().split("\n\n")[0].split()) in text
    for action in ufp4_scale.make_study().parser._actions:
        if action.option_strings and action.dest != "help" and action.default not in ("", None, False):
            assert f"(default:{action.default})".replace(" ", "") in text.replace(" ", ""), action.dest


def _dry_run(script: str, out: pathlib.Path, parts: tuple[str, ...]) -> dict:
    """Runs `bash experiments/bench/<script>` in dry-run mode into `out` (the parts named only); its campaign.json."""
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, CAMPAIGN_DRY_RUN="1", CAMPAIGN_PARTS=",".join(parts))
    done = subprocess.run(
        ["bash", str(ROOT / "experiments" / "bench" / script)], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "campaign.json").read_text())


def _check(record: dict, out: pathlib.Path, parts: tuple[str, ...]) -> None:
    assert record["dry_run"] and [p["part"] for p in record["parts"]] == list(parts)
    assert all(p["exit"] == 0 for p in record["parts"]), record["parts"]
    for part in parts:
        for name in WRITES[part]:
            assert (out / name).stat().st_size > 0, f"{part} did not write {name}"
    if "kernel-tests" in parts:  # one case, passed
        assert record["kernel_tests"] == {"tests": 1, "failures": 0, "errors": 0, "skipped": 0}
    assert "| part | exit | seconds | limit |" in (out / "campaign.md").read_text()
    env = json.loads((out / "environment.json").read_text()) if "environment" in parts else {"backend": "cpu"}
    assert env["backend"] == "cpu"


def test_gpu_campaign_dry_run_environment_and_kernels(tmp_path):
    parts = ("environment", "kernel-tests")
    _check(_dry_run("gpu.sh", tmp_path, parts), tmp_path, parts)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["gpu.sh", "tpu.sh"])
def test_campaign_dry_run_every_part(script, tmp_path):
    _check(_dry_run(script, tmp_path, PARTS), tmp_path, PARTS)
