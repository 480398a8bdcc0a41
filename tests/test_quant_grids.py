"""quant: grids, rounding, block scales (against NumPy), RHT, and the spec's synthetic SQNR / alpha table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quant import analysis, grids, hadamard, quantize, rht, shrinkage_bias


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


def _np_nearest(y, fmt):
    """Brute force: the closest level, ties to the level whose code index (position among |levels|) is even."""
    pos = np.asarray(grids.GRIDS[fmt])
    a = np.minimum(np.abs(y), pos[-1])
    d = np.abs(a[..., None] - pos)
    best = d.min(-1, keepdims=True)
    candidates = np.where(d == best, np.arange(8), 99)
    even = np.where(candidates % 2 == 0, candidates, 99).min(-1)
    index = np.where(even < 99, even, candidates.min(-1))
    return np.sign(y) * pos[index]


@pytest.mark.parametrize("fmt", ["e2m1", "e1m2", "int4"])
def test_nearest_rounding_ties_to_even(fmt):
    pos = np.asarray(grids.GRIDS[fmt])
    mids = (pos[1:] + pos[:-1]) / 2
    y = np.concatenate([mids, -mids, pos, np.random.default_rng(0).uniform(-1.2, 1.2, 4000) * pos[-1]])
    got = np.asarray(grids.round_to_grid(jnp.asarray(y, jnp.float32), fmt))
    np.testing.assert_array_equal(got, _np_nearest(y.astype(np.float32), fmt))
    if fmt == "e2m1":  # the midpoints' even neighbours, spelled out
        np.testing.assert_array_equal(got[:7], [0, 1, 1, 2, 2, 4, 4])


def test_stochastic_rounding_is_unbiased():
    pos = np.asarray(grids.GRIDS["e2m1"])
    y = jnp.asarray(np.random.default_rng(1).uniform(-6, 6, 64), jnp.float32)
    n = 4000
    draws = jax.vmap(lambda k: grids.round_to_grid(y, "e2m1", rounding="stochastic", key=k))(
        jax.random.split(jax.random.key(0), n)
    )
    d = np.asarray(draws)
    lower = np.sign(y) * pos[np.clip(np.searchsorted(pos, np.abs(y), side="right") - 1, 0, 6)]
    gap = np.abs(np.sign(y) * pos[np.clip(np.searchsorted(pos, np.abs(y), side="right"), 1, 7)] - lower)
    assert np.all((d == lower) | (np.abs(d - lower) == gap))  # only the two neighbours
    bound = 5 * gap / 2 / np.sqrt(n)  # std of a two-point variable <= gap / 2
    assert np.all(np.abs(d.mean(0) - np.asarray(y)) <= bound + 1e-6)


def _np_e4m3(s):
    """Round positive float64 to E4M3 (bias 7, 3 mantissa bits, subnormal step 2^-9, max 448), nearest-even."""
    e = np.maximum(np.floor(np.log2(np.where(s > 0, s, 1.0))), -6)
    step = 2.0 ** (e - 3)
    return np.minimum(np.round(s / step) * step, 448.0)  # np.round: half to even


def _np_reference(x, fmt):
    """Independent NumPy MXFP4 / NVFP4 (blocks along the last axis)."""
    b = x.reshape(*x.shape[:-1], -1, 32 if fmt == "mxfp4" else 16).astype(np.float64)
    amax = np.abs(b).max(-1, keepdims=True)
    if fmt == "mxfp4":
        scale = np.where(amax > 0, 2.0 ** (np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2), 0)
    else:
        s_enc = 6 * 448 / np.abs(x).max()
        scale = _np_e4m3(np.minimum(amax / 6 * s_enc, 448)) / s_enc
    y = b / np.where(scale > 0, scale, 1)
    return (_np_nearest(y, "e2m1") * scale).reshape(x.shape)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96)])
def test_mx_and_nv_formats_match_numpy(fmt, shape):
    rng = np.random.default_rng(len(shape))
    x = rng.standard_t(3, size=shape) * np.exp(rng.normal(size=shape[:-1] + (1,)) * 2)  # heavy tails, wide range
    x[0, ..., :16] = 0.0  # an all-zero block
    got = np.asarray(jax.jit(lambda v: quantize(v, fmt))(jnp.asarray(x, jnp.float32)))
    np.testing.assert_allclose(got, _np_reference(x.astype(np.float32), fmt), rtol=1e-6, atol=0)


def test_block_scaling_axis_dtype_and_errors():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(48, 32)), jnp.bfloat16)
    q = quantize(x, "e1m2", axis=0)
    assert q.dtype == jnp.bfloat16 and q.shape == x.shape
    np.testing.assert_array_equal(q, quantize(x.T, "e1m2").T)
    with pytest.raises(ValueError, match="not divisible by block_size = 16"):
        quantize(x[:, :30], "int4")
    with pytest.raises(ValueError, match="allowed"):
        quantize(x, "fp3")
    with pytest.raises(ValueError, match="needs a PRNG key"):
        quantize(x, "int4", rounding="stochastic")


def test_rht_is_orthonormal_and_cancels_in_a_product():
    h = hadamard(16)
    np.testing.assert_array_equal(h @ h.T, 16 * np.eye(16))
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

    def measure(v, fmt):
        q = quantize(v, fmt)
        return float(analysis.sqnr(v, q)), float(analysis.alpha(v, q))

    (e2m1, a_e2m1), (int4, a_int4) = measure(x, "e2m1"), measure(x, "int4")
    assert e2m1 == pytest.approx(20.52, abs=0.2) and int4 == pytest.approx(21.39, abs=0.2)
    assert a_e2m1 == pytest.approx(0.9959, abs=5e-4) and a_int4 == pytest.approx(1.0007, abs=5e-4)
    outliers = x * jnp.asarray(np.where(np.isin(np.arange(256), [3, 77]), 30.0, 1.0), jnp.float32)
    table = {(fmt, r): measure(rht(outliers) if r else outliers, fmt)[0] for fmt in ("e2m1", "int4") for r in (0, 1)}
    for got, want in zip(table.values(), (22.23, 18.88, 20.55, 25.47)):
        assert got == pytest.approx(want, abs=0.2)
    assert table[("e2m1", 0)] > table[("int4", 0)] and table[("e2m1", 1)] < table[("int4", 1)]


def test_uniform_draws_are_uniform_and_independent():
    a = np.asarray(grids.uniform(jax.random.key(0), (1024, 1024))).ravel()
    b = np.asarray(grids.uniform(jax.random.key(1), (1024, 1024))).ravel()
    assert a.min() >= 0 and a.max() < 1
    assert abs(a.mean() - 0.5) < 0.002 and abs(a.var() - 1 / 12) < 0.001
    assert abs(np.histogram(a, 16, (0, 1))[0] / a.size - 1 / 16).max() < 0.002
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.005 and abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.005
