"""UFP4's GEMM fidelity on the model's own tensors: every 4-bit recipe's three training GEMMs against float64.

    python -m experiments.reproduce.ufp4 --parts fidelity [--steps 400] [--out runs/ufp4]

The quickstart MoE (one site) is trained with the `bf16` recipe for `--steps` steps, checkpointed at a quarter,
half, three quarters and the end. At each checkpoint one training batch (the next step's) goes through the model
with every projection and expert GEMM computed in float32 and a zero "tap" added to its output: the gradient of
the loss with respect to a tap is that GEMM's dY. So every GEMM the recipes quantise (attention q, k, v, o; each
expert's up and down, and gate with a swiglu expert, one GEMM per expert over its routed tokens; not the head,
routers or embeddings, which every recipe keeps in high precision) gives its real operands x [M, K], W [K, N] and
dY [M, N].

For each recipe, each GEMM kind and each captured GEMM, the library's own quantisation of both operands
(quant.gemm.prepare_operands: padding, RHT, block scales, stochastic rounding of dY) and the product of the
quantised operands in float64, against the float64 product of the unquantised ones, E:
  fprop  x W      dgrad  dY W^T      wgrad  x^T dY
over `DRAWS` draws (each a new stochastic-rounding key and new random RHT signs; recipes without either are
evaluated once): SQNR = 10 log10(|E|^2 / |Q - E|^2) (mean over draws), the gain <mean(Q), E> / |E|^2 - 1 (the
relative bias along the exact result over the draws' mean: negative is shrinkage, which stochastic rounding cannot
average away), and for wgrad the cosine of Q with E. Tokens are zero-padded to a multiple of `BUCKET` (exact: zero
rows add zero blocks and zero products) so that a few programs serve every GEMM.

Reported (fidelity.md, fidelity.json, fidelity.png): per recipe and GEMM kind the mean over captured GEMMs with a
95% bootstrap interval (GEMMs resampled, the same resample for every recipe), and the ranking: recipes in order of
their mean, each adjacent pair with the 95% interval of their paired difference (resolved when it excludes 0).
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments import harness, plotting
from experiments.reproduce import runs

RECIPES = (
    "bf16",
    "e2m1_baseline",
    "ufp4",
    "ufp4_int4",
    "nvfp4",
    "nvfp4_4over6",
    "mxfp4",
    "mxfp4_amd",
    "gridgames",
    "nvfp4_ms_eden",
)
GEMMS = ("fprop", "dgrad", "wgrad")
DRAWS = 8
BUCKET = 256
BOOTSTRAP = 2000
SOURCE = "fidelity_source"  # the run whose checkpoints are captured, in <out>/runs


def source_run(out: str, steps: int, config: str) -> str:
    """Trains (or reuses) the bf16 quickstart MoE on one site, checkpointed at steps / 4, / 2, 3 / 4 and `steps`;
    returns its workdir."""
    workdir = os.path.join(out, "runs", SOURCE)
    flags = [
        "--config.mesh.site=1",
        "--config.mesh.data=1",
        "--config.precision.recipe=bf16",
        f"--config.train.eval_every={steps}",
        "--config.train.eval_batches=16",
        f"--config.checkpoint.every={steps // 4}",
        "--config.checkpoint.keep=4",
    ]
    runs.run_or_reuse(config, workdir, flags, steps)
    return workdir


class Taps:
    """A precision slot (core.model.Precision) that computes every GEMM in float32 and records its operands; with
    `taps` set ({path: zeros of the output's shape}) it adds each path's tap to its output, so the gradient with
    respect to the taps is every GEMM's dY. Paths `keeps` says are high precision are computed but not recorded."""

    def __init__(self, grouped, keeps):
        self.grouped, self.keeps = grouped, keeps
        self.taps: dict[str, Any] | None = None
        self.outputs: dict[str, Any] = {}  # path -> its GEMM's output (for the taps' shapes)
        self.kinds: dict[
            str, tuple
        ] = {}  # path -> ("dense", lhs contraction axis, rhs contraction axis) / ("grouped",)
        self.operands: dict[str, tuple] = {}  # path -> (lhs, rhs) / (lhs, rhs, group sizes)

    def _out(self, path: str, y, kind: tuple, operands: tuple):
        if self.keeps(path):
            return y
        self.outputs[path], self.kinds[path], self.operands[path] = y, kind, operands
        return y if self.taps is None else y + self.taps[path]

    def dot_general(self, path: str, key):
        import jax

        def call(lhs, rhs, dims, precision=None, preferred_element_type=None, *, out_sharding=None):
            (lc, rc), (lb, rb) = dims
            if lb or rb or len(lc) != 1:
                raise ValueError(f"{path}: batched or multi-axis contractions are not captured ({dims})")
            y = jax.lax.dot_general(
                lhs, rhs, dims, precision=jax.lax.Precision.HIGHEST, preferred_element_type=preferred_element_type
            )
            return self._out(path, y, ("dense", lc[0], rc[0]), (lhs, rhs))

        return call

    def grouped_matmul(self, path: str, key):
        def call(lhs, rhs, group_sizes, preferred_element_type=None):
            y = self.grouped(lhs, rhs, group_sizes, preferred_element_type)
            return self._out(path, y, ("grouped",), (lhs, rhs, group_sizes))

        return call


def capture(workdir: str, step: int) -> list[dict]:
    """The GEMMs of one training batch through the model at checkpoint `step`: [{"name", "x", "w", "dy"}] of float32
    NumPy arrays [M, K], [K, N], [M, N] (one entry per expert for grouped GEMMs, experts without tokens left out)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from core.train.step import lm_loss
    from experiments import build, load
    from quant import recipes

    config, model = load.trained_model(workdir, precision="float", step=step)
    slot = Taps(model.precision.grouped_matmul("", None), lambda p: recipes.UFP4.keeps(p, config.model.num_layers))
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "precision"):
            module.precision = slot
    _, batches = build.build_data(config)
    tokens = jnp.asarray(batches.train_batch(step))

    def loss(taps):
        slot.taps = taps
        value, _ = lm_loss(model, tokens)
        return value, dict(slot.operands)

    jax.eval_shape(loss, None)  # the outputs' shapes, for the taps
    taps = {p: jnp.zeros(y.shape, y.dtype) for p, y in slot.outputs.items()}
    dys, operands = jax.jit(jax.grad(loss, has_aux=True))(taps)
    out = []
    for path, arrays in operands.items():
        dy = np.asarray(dys[path], np.float32)
        if slot.kinds[path][0] == "dense":
            _, lc, rc = slot.kinds[path]
            lhs, rhs = (np.asarray(a, np.float32) for a in arrays)
            x = np.moveaxis(lhs, lc, -1).reshape(-1, lhs.shape[lc])
            w = np.moveaxis(rhs, rc, 0).reshape(rhs.shape[rc], -1)
            out.append({"name": f"{step}:{path}", "x": x, "w": w, "dy": dy.reshape(x.shape[0], w.shape[1])})
            continue
        lhs, rhs, sizes = (np.asarray(a) for a in arrays)
        start = 0
        for g, n in enumerate(sizes.tolist()):
            if n:
                x, w = lhs[start : start + n].astype(np.float32), rhs[g].astype(np.float32)
                out.append({"name": f"{step}:{path}[{g}]", "x": x, "w": w, "dy": dy[start : start + n]})
            start += n
    return out


def _operands(kind: str):
    """(a, b, axis_a, axis_b, weight, einsum) of one GEMM kind in prepare_operands' [1, M, K] / [1, K, N] layout."""
    return {
        "fprop": ("x", "w", 2, 1, 1, "bmk,bkn->bmn"),
        "dgrad": ("dy", "w", 2, 2, 1, "bmn,bkn->bmk"),
        "wgrad": ("x", "dy", 1, 1, None, "bmk,bmn->bkn"),
    }[kind]


@functools.cache
def _quantiser(recipe_name: str, kind: str):
    """A jitted (a, b, keys [D], seeds [D]) -> both quantised operands of GEMM `kind` under the recipe, one per draw
    (key: stochastic rounding; seed: the random RHT signs), [D, ...] each: the library's own path."""
    import jax

    from quant import recipes
    from quant.gemm import GemmConfig, prepare_operands
    from quant.quantize import quantize

    recipe = recipes.get(recipe_name)
    gemm = getattr(recipe, kind)
    _, _, axis_a, axis_b, weight, _ = _operands(kind)
    stochastic = (gemm.stochastic_dy and kind == "dgrad", gemm.stochastic_dy and kind == "wgrad")

    def one(a, b, key, seed):
        cfg = GemmConfig(recipe, quantize, seed)
        return prepare_operands(a, b, axis_a, axis_b, gemm, cfg, key=key, stochastic=stochastic, weight=weight)

    return jax.jit(jax.vmap(one, in_axes=(None, None, 0, 0)))


def random_draws(recipe_name: str) -> bool:
    """True if the recipe's GEMMs draw randomness (stochastic rounding, random RHT signs): evaluated DRAWS times."""
    from quant import recipes

    r = recipes.get(recipe_name)
    return r.needs_key or any(g.random_rotation for g in (r.fprop, r.dgrad, r.wgrad))


def _padded(t: dict) -> dict:
    m = t["x"].shape[0]
    pad = ((0, -m % BUCKET), (0, 0))
    return {**t, "x": np.pad(t["x"], pad), "dy": np.pad(t["dy"], pad)}


def gemm_metrics(t: dict, kind: str, recipes: Sequence[str], draws: int, index: int) -> dict[str, dict[str, float]]:
    """{recipe: SQNR (dB, mean over draws), gain and (wgrad) cosine} of one captured GEMM of kind `kind`, each
    recipe against the same float64 product; the draws' keys come from `index` (the GEMM's own)."""
    import jax

    a_name, b_name, _, _, _, spec = _operands(kind)
    t = _padded(t)
    a64, b64 = (t[n].astype(np.float64)[None] for n in (a_name, b_name))
    exact = np.einsum(spec, a64, b64)
    norm2 = float(np.sum(exact**2))
    out = {}
    for recipe_name in recipes:
        n = draws if random_draws(recipe_name) else 1
        keys = jax.random.split(jax.random.key(index), n)
        qa, qb = _quantiser(recipe_name, kind)(a64.astype(np.float32), b64.astype(np.float32), keys, np.arange(n))
        qa, qb = np.asarray(qa, np.float64), np.asarray(qb, np.float64)
        results = [np.einsum(spec, qa[d], qb[d]) for d in range(n)]
        sqnr = [10 * np.log10(norm2 / max(float(np.sum((q - exact) ** 2)), 1e-300)) for q in results]
        mean = np.mean(results, axis=0)
        out[recipe_name] = {"sqnr_db": float(np.mean(sqnr)), "gain": float(np.sum(mean * exact) / norm2 - 1)}
        if kind == "wgrad":
            cosines = [np.sum(q * exact) / np.sqrt(np.sum(q**2) * norm2) for q in results]
            out[recipe_name]["cosine"] = float(np.mean(cosines))
    return out


def bootstrap(values: np.ndarray, seed: int = 0) -> np.ndarray:
    """Means of `values` [recipes, gemms] over BOOTSTRAP resamples of the GEMMs (axis 1), the same resample for
    every recipe: [BOOTSTRAP, recipes]."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, values.shape[1], (BOOTSTRAP, values.shape[1]))
    return values[:, picks].mean(-1).T


def summarise(table: dict[str, list[float]], *, lower_is_better: bool = False) -> dict[str, Any]:
    """For one GEMM kind and metric, {recipe: [value per captured GEMM]} -> per recipe mean and 95% interval, and the
    ranking (best first: descending mean, or ascending with `lower_is_better`) with each adjacent pair's paired
    difference (better minus worse), its 95% interval and whether it resolves (the interval excludes 0)."""
    names = list(table)
    values = np.asarray([table[n] for n in names], np.float64)
    boot = bootstrap(values)
    means = values.mean(1)
    low, high = np.percentile(boot, [2.5, 97.5], axis=0)
    order = list(np.argsort(means if lower_is_better else -means, kind="stable"))
    pairs = []
    for i, j in itertools.pairwise(order):
        diff = boot[:, i] - boot[:, j]
        lo, hi = np.percentile(diff, [2.5, 97.5])
        pairs.append({"above": names[i], "below": names[j], "difference": float(means[i] - means[j]),
                      "interval": [float(lo), float(hi)], "resolved": bool(lo > 0 or hi < 0)})  # fmt: skip
    return {
        "recipes": {
            n: {"mean": float(means[k]), "interval": [float(low[k]), float(high[k])]} for k, n in enumerate(names)
        },
        "ranking": [names[k] for k in order],
        "pairs": pairs,
    }


METRICS = ("sqnr_db", "gain", "cosine")
RANKED = ("sqnr_db", "abs_gain", "cosine")  # abs_gain: |gain| per GEMM, lower is better (the bias's size)


def fidelity_all(study: harness.Study, steps: int, config: str) -> dict:
    """Trains (or reuses) the source run of `config` for `steps` steps, captures its GEMMs at its checkpoints and
    measures every recipe on them (one `study.progress` line per checkpoint); writes fidelity.md, fidelity.json
    and fidelity.png into `study.out`, which state the command `--parts fidelity` (with `--jobs 1`); returns the
    record written."""
    from core import checkpoint as checkpoint_lib

    out = study.out
    workdir = source_run(out, steps, config)
    checkpointer = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
    points = checkpointer.all_steps()
    checkpointer.close()
    per_gemm: dict[str, dict[str, dict[str, list[float]]]] = {k: {r: {} for r in RECIPES} for k in GEMMS}
    names: list[str] = []
    for i, step in enumerate(points):
        tensors = capture(workdir, step)
        for t in tensors:
            for kind in GEMMS:
                for r, values in gemm_metrics(t, kind, RECIPES, DRAWS, len(names)).items():
                    for metric, v in values.items():
                        per_gemm[kind][r].setdefault(metric, []).append(v)
            names.append(t["name"])
        study.progress(i + 1, len(points), f"fidelity: step {step}, {len(tensors)} GEMMs done")
    summary = {kind: summaries(per_gemm[kind]) for kind in GEMMS}
    result = {
        "source": {"workdir": os.path.relpath(workdir, out), "steps": steps, "checkpoints": points},
        "draws": DRAWS,
        "bucket": BUCKET,
        "bootstrap": BOOTSTRAP,
        "gemms": names,
        "per_gemm": per_gemm,
        "summary": summary,
    }
    return study.write("fidelity", result, markdown, {"fidelity.png": plot}, parts=["fidelity"], jobs=1)


def summaries(per_recipe: dict[str, dict[str, list[float]]]) -> dict[str, dict]:
    """One GEMM kind's {recipe: {metric: [value per GEMM]}} -> {metric: summarise(...)} for the measured METRICS and
    abs_gain (|gain| ranked lower first)."""
    measured = [m for m in METRICS if m in per_recipe[RECIPES[0]]]
    out = {m: summarise({r: per_recipe[r][m] for r in RECIPES}) for m in measured}
    out["abs_gain"] = summarise({r: list(np.abs(per_recipe[r]["gain"])) for r in RECIPES}, lower_is_better=True)
    return out


def _cell(s: dict, scale: float, digits: int) -> str:
    lo, hi = s["interval"]
    return f"{s['mean'] * scale:.{digits}f} [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"


def gemm_kinds(names: list[str]) -> str:
    """The kinds of captured GEMMs named "step:blocks.i.attn.q" / "step:blocks.i.ffn.experts.up[e]", as a phrase:
    "attention k, o, q, v and each expert's down, up" (what the model has, not a fixed list)."""
    leaf = sorted({n.rsplit(".", 1)[-1].split("[")[0] for n in names})
    attention = [k for k in leaf if k in ("q", "k", "v", "o")]
    expert = [k for k in leaf if k not in attention]
    parts = [
        f"attention {', '.join(attention)}" if attention else "",
        f"each expert's {', '.join(expert)}" if expert else "",
    ]
    return " and ".join(p for p in parts if p)


def markdown(result: dict) -> str:
    """fidelity.md: per GEMM kind, each recipe's SQNR, gain and (wgrad) cosine with 95% intervals; the rankings."""
    s = result["summary"]
    src = result["source"]
    lines = [
        "# UFP4: GEMM fidelity on the quickstart model's own tensors",
        "",
        f"`{result['command']}`",
        "",
        f"{len(result['gemms'])} GEMMs ({gemm_kinds(result['gemms'])}) captured at steps "
        f"{src['checkpoints']} of the bf16 quickstart MoE; each recipe's quantised product in float64 against the "
        f"float64 product, {result['draws']} draws for recipes with randomness. Mean over the GEMMs [95% bootstrap "
        "interval]. Gain: <mean Q, E> / |E|^2 - 1 in %, negative = shrinkage.",
        "",
        "| recipe | " + " | ".join(f"{k} SQNR dB | {k} gain %" for k in GEMMS) + " | wgrad cosine |",
        "|---|" + "---|" * (2 * len(GEMMS) + 1),
    ]
    for r in RECIPES:
        cells = [
            f"{_cell(s[k]['sqnr_db']['recipes'][r], 1, 2)} | {_cell(s[k]['gain']['recipes'][r], 100, 3)}" for k in GEMMS
        ]
        lines.append(f"| {r} | " + " | ".join(cells) + f" | {_cell(s['wgrad']['cosine']['recipes'][r], 1, 5)} |")
    lines += ["", "Rankings, best first (SQNR and cosine: higher; |gain| in %: lower), each adjacent pair's paired "
              "difference (better minus worse) and its 95% interval:", ""]  # fmt: skip
    for kind in GEMMS:
        for metric in (m for m in RANKED if m in s[kind]):
            pairs = s[kind][metric]["pairs"]
            scale = 100 if metric == "abs_gain" else 1
            text = " ".join(
                f"{p['above']} {'>' if p['resolved'] else '~'} ({p['difference'] * scale:+.3f} "
                f"[{p['interval'][0] * scale:+.3f}, {p['interval'][1] * scale:+.3f}])"
                for p in pairs
            )
            lines.append(f"- {kind} {metric}: {text} {pairs[-1]['below']}")
    lines += ["", "`>`: the interval excludes 0 (resolved); `~`: it does not."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """fidelity.png: SQNR and gain per recipe (with 95% intervals), one column per GEMM kind."""
    plt = plotting.pyplot()
    fig, axes = plt.subplots(2, len(GEMMS), figsize=(13, 6.5))
    for col, kind in enumerate(GEMMS):
        for row, (metric, scale, label) in enumerate((("sqnr_db", 1, "SQNR (dB)"), ("gain", 100, "gain (%)"))):
            ax = axes[row][col]
            stats = result["summary"][kind][metric]["recipes"]
            means = [stats[r]["mean"] * scale for r in RECIPES]
            errors = [[(stats[r]["mean"] - stats[r]["interval"][0]) * scale for r in RECIPES],
                      [(stats[r]["interval"][1] - stats[r]["mean"]) * scale for r in RECIPES]]  # fmt: skip
            ax.errorbar(range(len(RECIPES)), means, yerr=errors, fmt="o", color="#4c72b0", capsize=3)
            ax.set_xticks(range(len(RECIPES)), RECIPES, rotation=45, ha="right", fontsize=7)
            ax.set_title(f"{kind}: {label}", fontsize=9)
            if metric == "gain":
                ax.axhline(0, color="black", lw=0.6)
            ax.grid(alpha=0.3)
    fig.suptitle(result["command"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
