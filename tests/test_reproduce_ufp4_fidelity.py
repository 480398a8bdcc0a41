"""experiments.reproduce.ufp4_fidelity: the captured GEMMs are the model's (x^T dY is each weight's gradient), the
metrics against independent references (ml_dtypes' bfloat16, the spec's per-operand alpha on Gaussians), the
paired bootstrap's rankings, the report. The measurement itself (minutes) is the committed results' command."""

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from experiments.reproduce import ufp4_fidelity as fid


def _gaussian_gemm(seed=1, m=512, k=256, n=128):
    rng = np.random.default_rng(seed)
    return {name: rng.normal(size=s).astype(np.float32) for name, s in (("x", (m, k)), ("w", (k, n)), ("dy", (m, n)))}


def test_the_gain_is_the_grids_shrinkage_on_gaussians():
    """On i.i.d. N(0, 1) operands a GEMM's gain is about the sum of its nearest-rounded operands' alpha - 1 (the
    spec's 1 x 16 table: E2M1 0.9959, INT4 / E1M2 1.0007; stochastic rounding of dY adds none): E2M1's fprop about
    -0.82%, its wgrad (x nearest, dY stochastic) -0.41%; UFP4's +0.14% and +0.07%."""
    t = _gaussian_gemm()
    for recipe, kind, want in [
        ("e2m1_baseline", "fprop", -0.82),
        ("e2m1_baseline", "wgrad", -0.41),
        ("ufp4", "fprop", 0.14),
        ("ufp4", "wgrad", 0.07),
    ]:
        got = fid.gemm_metrics(t, kind, [recipe], 4, 0)[recipe]
        assert got["gain"] * 100 == pytest.approx(want, abs=0.1), (recipe, kind, got)
        assert 14 < got["sqnr_db"] < 20


@pytest.mark.parametrize("kind, m", [("fprop", 300), ("dgrad", 300), ("wgrad", 37)])
def test_bf16_rows_equal_products_of_ml_dtypes_bfloat16_operands(kind, m):
    """The bf16 recipe's SQNR, gain and cosine equal those of the float64 product of operands rounded by ml_dtypes
    (ragged token counts: the zero padding to BUCKET rows changes nothing)."""
    t = _gaussian_gemm(seed=2, m=m, k=48, n=40)
    a, b, spec = {
        "fprop": ("x", "w", "mk,kn->mn"),
        "dgrad": ("dy", "w", "mn,kn->mk"),
        "wgrad": ("x", "dy", "mk,mn->kn"),
    }[kind]
    exact = np.einsum(spec, t[a].astype(np.float64), t[b].astype(np.float64))
    rounded = [t[n].astype(ml_dtypes.bfloat16).astype(np.float64) for n in (a, b)]
    q = np.einsum(spec, *rounded)
    got = fid.gemm_metrics(t, kind, ["bf16"], 4, 0)["bf16"]
    assert got["sqnr_db"] == pytest.approx(10 * np.log10(np.sum(exact**2) / np.sum((q - exact) ** 2)), abs=1e-9)
    assert got["gain"] == pytest.approx(np.sum(q * exact) / np.sum(exact**2) - 1, abs=1e-12)
    if kind == "wgrad":
        assert got["cosine"] == pytest.approx(np.sum(q * exact) / np.linalg.norm(q) / np.linalg.norm(exact), abs=1e-12)


def test_random_draws_follow_the_recipes_randomness():
    assert fid.random_draws("ufp4") and fid.random_draws("nvfp4") and fid.random_draws("mxfp4")
    assert not fid.random_draws("bf16") and not fid.random_draws("mxfp4_amd")  # nearest, deterministic Hadamard


def test_summary_ranks_by_paired_differences():
    """Recipes measured on the same heterogeneous GEMMs: a constant offset of 0.05 is resolved by the paired
    bootstrap although the per-recipe intervals overlap; equal recipes are not; intervals hold their means."""
    rng = np.random.default_rng(3)
    base = rng.normal(20, 3, 60)  # GEMMs differ by far more than the recipes do
    s = fid.summarise({"a": list(base + 0.05), "b": list(base), "c": list(base)})
    assert s["ranking"][0] == "a"
    first, second = s["pairs"]
    assert first["above"] == "a" and first["resolved"] and first["difference"] == pytest.approx(0.05)
    assert not second["resolved"] and second["difference"] == 0.0
    low = fid.summarise({"a": list(base + 0.05), "b": list(base)}, lower_is_better=True)
    assert low["ranking"] == ["b", "a"] and low["pairs"][0]["difference"] == pytest.approx(-0.05)
    ia, ib = s["recipes"]["a"]["interval"], s["recipes"]["b"]["interval"]
    assert ia[0] < ib[1]  # overlapping per-recipe intervals
    for r in s["recipes"].values():
        assert r["interval"][0] <= r["mean"] <= r["interval"][1]


def test_the_report_has_a_row_per_recipe_and_a_ranking_per_metric(tmp_path):
    rng = np.random.default_rng(4)
    summary = {
        k: fid.summaries(
            {r: {m: list(rng.normal(size=8)) for m in fid.METRICS[: 2 + (k == "wgrad")]} for r in fid.RECIPES}
        )
        for k in fid.GEMMS
    }
    result = {"command": "cmd", "machine": "m", "source": {"checkpoints": [1, 2]}, "draws": 8,
              "gemms": ["g"] * 8, "summary": summary}  # fmt: skip
    text = fid.markdown(result)
    assert all(f"| {r} |" in text for r in fid.RECIPES)
    assert text.count("- fprop ") == 2 and text.count("- wgrad ") == 3  # SQNR, |gain|; wgrad's cosine too
    fid.plot(result, str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 10_000


@pytest.mark.slow  # 33 s, the longest default test (default run: 10 min)
def test_captured_gemms_give_every_weights_gradient(tmp_path, tiny_config):
    """A tiny MoE trained 4 steps; at its step-2 checkpoint (not the latest) every captured GEMM's x^T dY equals
    the gradient of the loss with respect to that GEMM's weight (jax.grad of the plain model: per expert for the
    grouped GEMMs), and its x W the layer's product; the head, routers and embeddings are not captured."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from core.train.step import lm_loss
    from experiments import build, load, run

    c = tiny_config
    c.moe.update(every=1, num_experts=4, top_k=2, expert_size=32)
    c.train.steps = 4
    workdir = str(tmp_path / "run")
    assert run.run(c, workdir) == 0
    tensors = fid.capture(workdir, 2)
    with pytest.raises(FileNotFoundError, match=r"step = 3: .* steps \[2, 4\]"):
        load.trained_model(workdir, step=3)
    config, model = load.trained_model(workdir, precision="float", step=2)
    _, batches = build.build_data(config)
    tokens = jnp.asarray(batches.train_batch(2))
    grads = nnx.state(nnx.grad(lambda m: lm_loss(m, tokens)[0])(model))
    names = [t["name"].split(":", 1)[1] for t in tensors]
    assert not any("head" in n or "router" in n or "embed" in n for n in names)
    assert {n.split("[")[0] for n in names} >= {"blocks.0.attn.q", "blocks.1.attn.o", "blocks.1.ffn.experts.down"}
    for t, name in zip(tensors, names):
        path, _, expert = name.partition("[")
        parts = path.split(".")  # the weight: a Dense's kernel, or the MoE's up / gate / down
        parts = [*parts[: parts.index("experts")], parts[-1]] if "experts" in parts else [*parts, "kernel"]
        node: Any = grads
        for p in parts:
            node = node[int(p) if p.isdigit() else p]
        g = np.asarray(jax.device_get(node.get_value() if hasattr(node, "get_value") else node), np.float64)
        if expert:
            g = g[int(expert[:-1])]
        want = t["x"].astype(np.float64).T @ t["dy"].astype(np.float64)
        np.testing.assert_allclose(want, g.reshape(want.shape), rtol=1e-4, atol=1e-6 * np.abs(g).max())
