"""quant: grids and formats on top of core.lowbit, block scaling (axes, dtypes, errors), block scales, RHT, and the
spec's synthetic SQNR / alpha table. The numerics themselves (nearest and stochastic rounding of every grid, MXFP4
and NVFP4 against exact NumPy references) are tested in test_lowbit.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import lowbit
from quant import analysis, block_scales, grids, hadamard, quantize, rht, shrinkage_bias

from helpers import jit_quantize


def test_levels_and_shrinkage_bias():
    np.testing.assert_array_equal(grids.levels("e2m1")[7:], [0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert len(grids.levels("int4")) == 15 and grids.levels("int4")[0] == -7
    bias = shrinkage_bias("e2m1")
    assert bias[2.0] == -0.125 and bias[4.0] == -0.25 and bias[-4.0] == 0.25
    assert all(v == 0 for q, v in bias.items() if abs(q) not in (2.0, 4.0))
    for fmt in ("e1m2", "int4"):
        assert set(shrinkage_bias(fmt).values()) == {0.0}
    # the formula is the bin's mean error: integrate numerically for level 4 of e2m1 (bin [3.5, 5))
    x = np.linspace(3.5, 5.0, 100_001)[:-1]
    assert np.mean(4.0 - x) == pytest.approx(bias[4.0], abs=1e-4)


@pytest.mark.parametrize(
    "fmt, grid", [("e2m1", "e2m1"), ("e1m2", "e1m2"), ("int4", "int4"), ("mxfp4", "e2m1"), ("nvfp4", "e2m1")]
)
def test_formats_round_on_their_core_grid(fmt, grid):
    """round_to_grid(fmt) is core.lowbit's nearest / stochastic rounding on the format's grid (mxfp4 and nvfp4 on
    e2m1), the stochastic draws being uniform(key, shape); round_quotient(num, den) equals rounding num / den where
    the quotient is exact."""
    y = jnp.asarray(np.random.default_rng(0).uniform(-1.2, 1.2, (40, 16)) * grids.grid_max(fmt), jnp.float32)
    np.testing.assert_array_equal(grids.round_to_grid(y, fmt), lowbit.round_nearest(y, grid))
    key = jax.random.key(4)
    np.testing.assert_array_equal(
        grids.round_to_grid(y, fmt, rounding="stochastic", key=key),
        lowbit.round_stochastic(y, grid, lowbit.uniform(key, y.shape)),
    )
    den = jnp.asarray([[0.25], [4.0]] * 20, jnp.float32)  # powers of two: y * den / den is exact
    np.testing.assert_array_equal(grids.round_quotient(y * den, den, fmt), lowbit.round_nearest(y, grid))
    draws = grids.round_quotient(y * den, den, fmt, rounding="stochastic", key=key)
    np.testing.assert_array_equal(draws, lowbit.round_stochastic(y, grid, lowbit.uniform(key, y.shape)))
    assert grids.grid_max(fmt) == lowbit.GRIDS[grid][-1]


def test_block_scaling_axis_dtype_and_errors():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(48, 32)), jnp.bfloat16)
    q = jit_quantize(x, "e1m2", axis=0)
    assert q.dtype == jnp.bfloat16 and q.shape == x.shape
    np.testing.assert_array_equal(q, jit_quantize(x.T, "e1m2").T)
    for kwargs, error in [
        (dict(x=x[:, :30], fmt="int4"), "not divisible by block_size = 16"),
        (dict(fmt="fp3"), "allowed"),
        (dict(fmt="int4", rounding="stochastic"), "needs a PRNG key"),
        (dict(fmt="int4", axis=2), "axis = 2 is out of range"),
        (dict(fmt="nvfp4", rounding="up"), "rounding = 'up'; allowed"),
    ]:
        with pytest.raises(ValueError, match=error):  # while tracing, before anything runs
            jax.eval_shape(lambda kw=kwargs: quantize(**{"x": x, **kw}))


@pytest.mark.parametrize("fmt", ["e2m1", "e1m2", "int4", "mxfp4", "nvfp4"])
def test_block_scales_times_levels_are_the_quantised_values(fmt):
    """block_scales gives one decode scale per block with x_hat = scale * level, level on the format's grid;
    mxfp4's scales are exact powers of two (UE8M0), nvfp4's equal s_b t / 2688 for an E4M3 value s_b."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_t(3, size=(6, 64)) * np.exp(rng.normal(size=(6, 1)) * 3), jnp.float32)
    block = {"mxfp4": 32}.get(fmt, 16)
    scales = np.asarray(jax.jit(block_scales, static_argnums=1)(x.reshape(6, -1, block), fmt), np.float64)
    q = np.asarray(jit_quantize(x, fmt), np.float64).reshape(6, -1, block)
    level = q / scales
    np.testing.assert_allclose(level, _snap(level, grids.levels(fmt)), atol=1e-5)
    if fmt == "mxfp4":
        np.testing.assert_array_equal(scales, 2.0 ** np.round(np.log2(scales)))
    if fmt == "nvfp4":
        s_b = scales * 2688 / float(jnp.max(jnp.abs(x)))
        np.testing.assert_allclose(s_b, lowbit.round_e4m3(jnp.asarray(s_b, jnp.float32)), rtol=1e-6)


def _snap(v, levels):
    return levels[np.abs(v[..., None] - levels).argmin(-1)]


def test_rht_is_orthonormal_and_cancels_in_a_product():
    np.testing.assert_array_equal(hadamard(16), lowbit.hadamard(16, normalized=False))  # +-1, H H^T = 16 I
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.normal(size=(5, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(64, 7)), jnp.float32)
    signs = jnp.asarray(rng.choice([-1.0, 1.0], 16), jnp.float32)
    ra, rw = rht(a, signs=signs), rht(w, axis=0, signs=signs)
    np.testing.assert_allclose(jnp.linalg.norm(ra, axis=1), jnp.linalg.norm(a, axis=1), rtol=1e-5)
    np.testing.assert_allclose(ra @ rw, np.asarray(a, np.float64) @ np.asarray(w, np.float64), rtol=1e-4, atol=1e-4)
    assert float(jnp.max(jnp.abs(ra - a))) > 0.1  # it does rotate


def test_synthetic_sqnr_table_of_the_spec():
    """2^20 N(0,1) values in 1x16 blocks; then 2 of 256 channels x30 with and without RHT16 (the spec's numbers,
    within 0.2 dB), including the rank flip between E2M1 and INT4 under RHT."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4096, 256)), jnp.float32)

    @functools.partial(jax.jit, static_argnums=1)
    def sqnr_and_alpha(v, fmt):
        q = quantize(v, fmt)
        return analysis.sqnr(v, q), analysis.alpha(v, q)

    def measure(v, fmt):
        return tuple(map(float, sqnr_and_alpha(v, fmt)))

    (e2m1, a_e2m1), (int4, a_int4) = measure(x, "e2m1"), measure(x, "int4")
    assert e2m1 == pytest.approx(20.52, abs=0.2) and int4 == pytest.approx(21.39, abs=0.2)
    assert a_e2m1 == pytest.approx(0.9959, abs=5e-4) and a_int4 == pytest.approx(1.0007, abs=5e-4)
    outliers = x * jnp.asarray(np.where(np.isin(np.arange(256), [3, 77]), 30.0, 1.0), jnp.float32)
    table = {(fmt, r): measure(rht(outliers) if r else outliers, fmt)[0] for fmt in ("e2m1", "int4") for r in (0, 1)}
    for got, want in zip(table.values(), (22.23, 18.88, 20.55, 25.47)):
        assert got == pytest.approx(want, abs=0.2)
    assert table[("e2m1", 0)] > table[("int4", 0)] and table[("e2m1", 1)] < table[("int4", 1)]
