"""The 4-bit KV codecs beyond UltraQuant's E2M1 against exact float64 NumPy quantisers written here (ml_dtypes gives
the E4M3 values): the uniform E1M2 / INT4 grids under both UE8M0 rules, NVFP4's E4M3 scales per 16 with "max" and
"4 over 6" selection, K8V4 as fp8 keys beside fp4 values; the edges (block maxima at and next to powers of two,
tiny and huge magnitudes, zeros and -0, inf and nan); sizes and refused options."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from core import lowbit
from kvcache import codecs, formats

_quantize = jax.jit(lambda fmt, k, v: fmt.quantize(k, v), static_argnums=0)
_dequantize = jax.jit(lambda fmt, fields: fmt.dequantize(fields), static_argnums=0)
# every finite non-negative E4M3 value, from ml_dtypes' bit patterns 0x00 .. 0x7E, in code order
E4M3_VALUES = np.arange(127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _round_trip(fmt, k, v):
    return [np.asarray(x, np.float64) for x in _dequantize(fmt, _quantize(fmt, jnp.asarray(k), jnp.asarray(v)))]


def nearest(x: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Nearest of the ascending non-negative `levels` to |x| by brute force (ties to the even index, saturating at
    the last), with x's sign."""
    a = np.minimum(np.abs(x), levels[-1])
    dist = np.abs(a[..., None] - levels)
    tie = dist == dist.min(-1, keepdims=True)
    idx = np.where(tie & (np.arange(len(levels)) % 2 == 0), np.arange(len(levels)), 999).min(-1)
    idx = np.where(idx < 999, idx, np.where(tie, np.arange(len(levels)), 999).min(-1))
    return np.sign(x) * levels[idx]


def numpy_ue8m0(x: np.ndarray, grid: str, rule: str) -> np.ndarray:
    """x [..., D] float64, per 32 elements a power-of-two scale 2^e by the rule (codecs' docstring, written out
    here), then the grid's nearest level; a group holding inf or nan is nan."""
    levels = np.array(lowbit.GRIDS[grid])
    g = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    out = np.zeros_like(g)
    for idx in np.ndindex(g.shape[:-1]):
        a = np.abs(g[idx]).max()
        if not np.isfinite(a):
            out[idx] = np.nan
            continue
        if a == 0:
            continue
        if rule == "mx":
            e = math.floor(math.log2(a)) - math.floor(math.log2(levels[-1]))
        else:
            e = math.floor(math.log2(0.156 * (6 / levels[-1]) * a) + 0.5)
        e = min(max(e, -126), 126)
        out[idx] = nearest(g[idx] / 2.0**e, levels) * 2.0**e
    return out.reshape(x.shape)


def numpy_nvfp4(x: np.ndarray, select: str) -> np.ndarray:
    """x [..., D] float64, per 16 elements an E4M3 scale s = e4m3(absmax / 6) (and, for "4over6", e4m3(absmax / 4)
    when its squared error is smaller), then E2M1 of x / s; a zero scale stores zeros; inf or nan gives nan."""
    levels = np.array(lowbit.GRIDS["e2m1"])
    g = x.astype(np.float64).reshape(*x.shape[:-1], -1, 16)
    out = np.zeros_like(g)
    for idx in np.ndindex(g.shape[:-1]):
        a = np.abs(g[idx]).max()
        if not np.isfinite(a):
            out[idx] = np.nan
            continue
        best_err = np.inf
        for top in (6.0, 4.0) if select == "4over6" else (6.0,):
            s = nearest(np.array(a / top), E4M3_VALUES)
            q = nearest(g[idx] / s, levels) * s if s > 0 else np.zeros(16)
            err = np.sum((q - g[idx]) ** 2)
            if err < best_err:
                best_err, out[idx] = err, q
    return out.reshape(x.shape)


def _edge_rows(d: int, seed: int) -> np.ndarray:
    """Rows [n, 1, d] of normals times per-row magnitudes over 2^-120 .. 2^120, with a row whose groups' maxima sit
    at and next to powers of two, a zero row with a -0, and rows of magnitudes where E4M3 scales underflow (1e-4)
    and saturate (1e4)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(12, 1, d)) * 2.0 ** rng.integers(-120, 121, size=(12, 1, 1))
    x[1] = rng.uniform(-1, 1, size=(1, d))
    for g in range(d // 16):  # group maxima 2^j, just below 2^j, just above
        j = g % 7 - 3
        x[1, 0, 16 * g] = [2.0**j, np.nextafter(np.float32(2.0**j), 0), np.nextafter(np.float32(2.0**j), 9)][g % 3]
    x[2] = 0.0
    x[2, 0, 5] = -0.0
    x[3], x[4] = rng.normal(size=(1, d)) * 1e-4, rng.normal(size=(1, d)) * 1e4
    x[5] = rng.normal(size=(1, d))
    return x.astype(np.float32)


@pytest.mark.parametrize("rule", codecs.SCALE_RULES)
@pytest.mark.parametrize("grid,head_dim", [("e1m2", 64), ("int4", 128), ("e2m1", 64)])
def test_uniform_grids_match_numpy(grid, rule, head_dim):
    """fp4 with `grid` (K unrotated, V) equals the float64 NumPy quantiser element for element, over magnitudes
    2^-120 .. 2^120, power-of-two group maxima, zeros and -0."""
    x = _edge_rows(head_dim, seed=head_dim)
    fmt = formats.get("fp4", grid=grid, scale_rule=rule, rotate_k=False)
    k_hat, v_hat = _round_trip(fmt, x, x[::-1].copy())
    np.testing.assert_array_equal(k_hat, numpy_ue8m0(x, grid, rule))
    np.testing.assert_array_equal(v_hat, numpy_ue8m0(x[::-1], grid, rule))


def test_e1m2_and_int4_store_the_same_values():
    """E1M2 and INT4 are the same grid scaled by 4, and both scale rules move with the grid's max: equal codes,
    scale bytes 2 apart (but for the zero row's, both 127), equal values."""
    x = _edge_rows(64, seed=1)
    for rule in codecs.SCALE_RULES:
        e1m2, int4 = (formats.get("fp4", grid=g, scale_rule=rule) for g in ("e1m2", "int4"))
        a, b = (_quantize(f, jnp.asarray(x), jnp.asarray(x)) for f in (e1m2, int4))
        np.testing.assert_array_equal(a["k_codes"], b["k_codes"])
        gap = np.asarray(a["v_scales"], int) - np.asarray(b["v_scales"], int)
        assert np.all(gap[2] == 0) and np.all(np.delete(gap, 2, axis=0) == 2), rule
        np.testing.assert_array_equal(_round_trip(e1m2, x, x)[0], _round_trip(int4, x, x)[0])


@pytest.mark.parametrize("select", codecs.E4M3_SELECTIONS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_nvfp4_matches_numpy(select, head_dim):
    """nvfp4 K and V equal the float64 NumPy quantiser with ml_dtypes' E4M3 values, over the same edges (where the
    scale underflows the block stores zeros, where it saturates the values clip at 6 x 448)."""
    x = _edge_rows(head_dim, seed=2 + head_dim)
    fmt = formats.get("nvfp4", select=select)
    k_hat, v_hat = _round_trip(fmt, x, x[::-1].copy())
    np.testing.assert_array_equal(k_hat, numpy_nvfp4(x, select))
    np.testing.assert_array_equal(v_hat, numpy_nvfp4(x[::-1], select))
    assert np.all(k_hat[3] == 0) and np.abs(k_hat[4]).max() == 6 * 448


def test_four_over_six_never_worse_per_block():
    """ "4 over 6" picks per block the scale with the smaller squared error: never worse than "max" on any block,
    better on many; both stored scales are E4M3 values."""
    x = np.random.default_rng(3).standard_t(4, size=(256, 1, 64)).astype(np.float32)
    plain, four6 = (_round_trip(formats.get("nvfp4", select=s), x, x)[0] for s in ("max", "4over6"))
    err = [((y - x) ** 2).reshape(-1, 16).sum(-1) for y in (plain, four6)]
    assert np.all(err[1] <= err[0] * (1 + 1e-6)) and np.mean(err[1] < err[0]) > 0.2
    scales = np.asarray(_quantize(formats.get("nvfp4", select="4over6"), jnp.asarray(x), jnp.asarray(x))["k_scales"])
    assert scales.dtype == jnp.float8_e4m3fn and scales.shape == (256, 1, 4)


def test_k8v4_is_fp8_keys_and_fp4_values():
    """k8v4's keys are fp8's bit for bit, its values fp4's (unrotated, the same grid and rule); its query stays
    float32; 3 D / 2 + D / 32 + 4 bytes per token and head."""
    rng = np.random.default_rng(4)
    k, v = (rng.normal(size=(5, 2, 128)).astype(np.float32) for _ in range(2))
    fmt = formats.get("k8v4", grid="e1m2", scale_rule="mx")
    k_hat, v_hat = _round_trip(fmt, k, v)
    np.testing.assert_array_equal(k_hat, _round_trip(formats.get("fp8"), k, v)[0])
    np.testing.assert_array_equal(v_hat, _round_trip(formats.get("fp4", grid="e1m2", scale_rule="mx"), k, v)[1])
    np.testing.assert_array_equal(np.asarray(fmt.prepare_query(jnp.asarray(k))), k)
    assert fmt.bytes_per_token(1, 128) == 128 + 4 + 64 + 4 == 3 * 128 // 2 + 128 // 32 + 4


@pytest.mark.parametrize("name,options", [("fp4", {"grid": "int4"}), ("nvfp4", {}), ("k8v4", {})])
def test_non_finite_groups_decode_as_nan(name, options):
    """A group holding inf or nan decodes as nan (its scale is nan), as core.lowbit's quantisers do; the other
    groups of the row are unaffected."""
    x = np.random.default_rng(5).normal(size=(3, 1, 64)).astype(np.float32)
    bad = x.copy()
    bad[1, 0, 3], bad[2, 0, 40] = np.inf, np.nan
    fmt = formats.get(name, **options)
    _, clean = _round_trip(fmt, x, x)
    _, v_hat = _round_trip(fmt, bad, bad)
    block = 32 if name != "nvfp4" else 16
    assert np.isnan(v_hat[1, 0, :block]).all() and np.isnan(v_hat[2, 0, 32 : 32 + block]).all()
    np.testing.assert_array_equal(v_hat[0], clean[0])
    np.testing.assert_array_equal(v_hat[1, 0, 32:], clean[1, 0, 32:])


def test_sizes():
    """Bytes per token and head: fp4 any grid D + D/16 (136 at D = 128), nvfp4 D + D/8 (144), k8v4 200."""
    for grid in codecs.GRIDS:
        assert formats.get("fp4", grid=grid).bytes_per_token(1, 128) == 136
    assert formats.get("nvfp4").bytes_per_token(2, 256) == 2 * (256 + 32)
    assert formats.get("k8v4").bytes_per_token(1, 128) == 200


def test_bad_options_are_named():
    with pytest.raises(ValueError, match=r"grid = 'e3m0' unknown; allowed: \['e2m1', 'e1m2', 'int4'\]"):
        formats.get("fp4", grid="e3m0")
    with pytest.raises(ValueError, match="select = 'mse' unknown for e4m3 scales; allowed: \\['max', '4over6'\\]"):
        formats.get("nvfp4", select="mse")
    with pytest.raises(ValueError, match="unknown nvfp4 options \\['grid'\\]"):
        formats.get("nvfp4", grid="e1m2")
    with pytest.raises(ValueError, match="select = '4over6' chooses between E2M1's levels"):
        codecs.Block4("int4", "e4m3", "4over6")
    with pytest.raises(ValueError, match="scale_rule = 'max' unknown for ue8m0"):
        formats.get("k8v4", scale_rule="max")
