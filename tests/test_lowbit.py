"""core.lowbit against ml_dtypes casts and exact NumPy references; quant's MXFP4 / NVFP4 block scaling (built on it)
against exact NumPy quantisers over block exponents -100..100, blocks whose max is exactly 2^k, exact ties on bf16
data, tiny, subnormal and zero tensors; the reproductions of the defects once found there as regression tests."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import scipy.linalg

from core import lowbit
from quant import quantize

from helpers import jit_quantize

# XLA:CPU flushes float32 subnormals to zero in arithmetic (inputs and results); references follow the platform
FLUSHES = float(jax.jit(lambda v: v * 2.0)(jnp.float32(2.0**-140))) == 0.0
TINY = 2.0**-126  # the smallest normal float32


def _flush(x: np.ndarray) -> np.ndarray:
    """x with float32 subnormals set to zero where the platform flushes them (float64 values kept otherwise)."""
    return np.where(np.abs(x) < TINY, 0.0 * x, x) if FLUSHES else x


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.int32)


def _float32_specials(rng) -> np.ndarray:
    """Every power of two of float32 (subnormal ones too), its neighbours, random mantissas at every exponent,
    zeros, infinities and nan."""
    p = np.ldexp(1.0, np.arange(-149, 128)).astype(np.float32)
    random = np.ldexp(rng.uniform(1, 2, p.size), np.arange(-149, 128)).astype(np.float32)
    x = np.concatenate(
        [p, np.nextafter(p, np.float32(0)), np.nextafter(p, np.float32(np.inf)), random, [0.0, np.inf, np.nan]]
    ).astype(np.float32)
    return np.concatenate([x, -x])


# ----------------------------------------------------------------------------------------- exponent bits


def test_floor_log2_is_exact_on_every_float32_exponent():
    """floor(log2 |x|) equals np.frexp's exponent - 1 for normal and subnormal x (read from bits, so even where
    the platform's arithmetic flushes subnormals); 0 -> FLOOR_LOG2_ZERO, inf / nan -> FLOOR_LOG2_NONFINITE."""
    x = _float32_specials(np.random.default_rng(0))
    got = np.asarray(jax.jit(lowbit.floor_log2)(jnp.asarray(x)))
    finite = np.isfinite(x) & (x != 0)
    np.testing.assert_array_equal(got[finite], np.frexp(x[finite].astype(np.float64))[1] - 1)
    assert set(got[x == 0]) == {lowbit.FLOOR_LOG2_ZERO} and set(got[~np.isfinite(x)]) == {lowbit.FLOOR_LOG2_NONFINITE}
    assert got[finite].min() == -149 and got[finite].max() == 127
    bf16 = jnp.asarray([3.0, -0.75], jnp.bfloat16)  # other float dtypes are cast to float32 first
    np.testing.assert_array_equal(lowbit.floor_log2(bf16), [1, -1])


def test_pow2_and_ue8m0_are_bit_exact_against_numpy_and_ml_dtypes():
    """pow2(e) has the bits of float32(2^e): normal, subnormal (e >= -149), 0 below, inf above; UE8M0 bytes decode
    as ml_dtypes' float8_e8m0fnu (s = 0 is 2^-127, s = 255 is nan)."""
    e = np.arange(-160, 140)
    got = np.asarray(jax.jit(lowbit.pow2)(jnp.asarray(e, jnp.int32)))
    with np.errstate(over="ignore"):
        want = np.ldexp(1.0, e).astype(np.float32)  # 0 below 2^-149, inf above 2^127
    np.testing.assert_array_equal(_bits(got), _bits(want))
    s = np.arange(256, dtype=np.uint8)
    want = s.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = np.asarray(jax.jit(lowbit.ue8m0_value)(jnp.asarray(s)))
    np.testing.assert_array_equal(_bits(got[:255]), _bits(want[:255]))
    assert np.isnan(got[255]) and np.isnan(want[255])


def test_ldexp_is_exact_for_normal_results():
    """x 2^e equals NumPy's exact ldexp wherever the result is a normal float32, including e = -127 (UE8M0's
    smallest scale, a subnormal power of two) and e beyond +-126; subnormal results follow the platform."""
    rng = np.random.default_rng(1)
    x = (rng.choice([-1, 1], 4000) * rng.uniform(0.25, 8, 4000)).astype(np.float32)
    e = rng.integers(-260, 260, 4000)
    e[:64] = -127
    want = np.ldexp(x.astype(np.float64), e)
    got = np.asarray(jax.jit(lowbit.ldexp)(jnp.asarray(x), jnp.asarray(e, jnp.int32)), np.float64)
    normal = (np.abs(want) >= TINY) & (np.abs(want) <= np.finfo(np.float32).max)
    assert normal.sum() > 1000
    np.testing.assert_array_equal(got[normal], want[normal])
    huge = np.abs(want) > np.finfo(np.float32).max
    np.testing.assert_array_equal(got[huge], np.sign(x[huge]) * np.inf)
    sub = np.abs(want) < TINY
    assert np.all((got[sub] == 0) if FLUSHES else np.abs(got[sub] - want[sub]) <= 2.0**-150)


def test_mx_exponent_is_floor_log2_minus_two_at_every_power_of_two():
    """The OCP shared exponent floor(log2 a) - 2 is exact at, just below and just above every power of two (where
    float log2 rounds across integers: log2(8192.) = 12.999999 on XLA:CPU)."""
    k = np.arange(-126, 128)
    p = np.ldexp(1.0, k).astype(np.float32)
    a = np.concatenate([p, np.nextafter(p, np.float32(0)), np.nextafter(p, np.float32(np.inf))])
    a = a[np.isfinite(a)]
    got = np.asarray(jax.jit(lowbit.mx_exponent)(jnp.asarray(a)))
    np.testing.assert_array_equal(got, np.frexp(a.astype(np.float64))[1] - 1 - 2)


# ------------------------------------------------------------------------------------------- E4M3, E2M1


def test_e4m3_rounding_matches_ml_dtypes():
    """round_e4m3 = ml_dtypes' float8_e4m3fn cast (nearest, ties to even, subnormals 2^-9 .. 2^-6) after clipping
    to +-448, on every E4M3 value, every midpoint between neighbours, random values over the range, and beyond."""
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    values = np.unique(values[np.isfinite(values)])
    mids = (values[1:] + values[:-1]) / 2
    rng = np.random.default_rng(2)
    x = np.concatenate([values, mids, rng.normal(size=3000) * 10.0 ** rng.uniform(-4, 3, 3000), [500.0, -1e9, 464.0]])
    x = x.astype(np.float32)
    want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    got = np.asarray(jax.jit(lowbit.cast_e4m3)(jnp.asarray(x)))
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(lowbit.round_e4m3(jnp.asarray(x))), want.astype(np.float32))
    assert (
        float(lowbit.round_e4m3(jnp.float32(464.0))) == 448.0
        and float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max) == lowbit.E4M3_MAX
    )


def test_e2m1_codes_and_rounding_match_ml_dtypes():
    """encode_e2m1 / decode_e2m1 / round_nearest(., "e2m1") agree with ml_dtypes' float4_e2m1fn cast (nearest,
    ties to even, saturating at +-6) on levels, midpoints, bf16 values and random values; decode(code) is the
    float4_e2m1fn value of the same 4 bits; -0 encodes as 8."""
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(
        np.asarray(lowbit.decode_e2m1(jnp.asarray(codes))), codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    )
    levels = np.asarray(lowbit.E2M1_LEVELS)
    mids = (levels[1:] + levels[:-1]) / 2
    rng = np.random.default_rng(3)
    bf16 = np.asarray(jnp.asarray(rng.uniform(-7, 7, 2000), jnp.bfloat16), np.float32)
    x = np.concatenate([levels, mids, -mids, bf16, rng.uniform(-7, 7, 2000), [7.0, -100.0, 5.0001, 1e30]])
    x = x.astype(np.float32)
    want = x.astype(ml_dtypes.float4_e2m1fn)  # ml_dtypes saturates at +-6
    code = np.asarray(jax.jit(lowbit.encode_e2m1)(jnp.asarray(x)))
    np.testing.assert_array_equal(code, want.view(np.uint8) & 15)
    np.testing.assert_array_equal(np.asarray(lowbit.decode_e2m1(jnp.asarray(code))), want.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(lowbit.round_nearest(jnp.asarray(x), "e2m1")), want.astype(np.float32))
    np.testing.assert_array_equal(
        np.asarray(lowbit.round_nearest(jnp.asarray(mids, jnp.float32), "e2m1")), [0, 1, 1, 2, 2, 4, 4]
    )
    assert int(lowbit.encode_e2m1(jnp.float32(-0.0))) == 8


def _np_nearest(y: np.ndarray, grid: str) -> np.ndarray:
    """Brute force: the closest level, ties to the level whose index (position among the |levels|) is even."""
    pos = np.asarray(lowbit.GRIDS[grid])
    a = np.minimum(np.abs(y), pos[-1])
    d = np.abs(a[..., None] - pos)
    candidates = np.where(d == d.min(-1, keepdims=True), np.arange(8), 99)
    even = np.where(candidates % 2 == 0, candidates, 99).min(-1)
    return np.sign(y) * pos[np.where(even < 99, even, candidates.min(-1))]


@pytest.mark.parametrize("grid", ["e2m1", "e1m2", "int4"])
def test_nearest_rounding_ties_to_even(grid):
    """All three grids against the brute-force nearest level on midpoints (exact ties), levels, bf16 values and
    random values in and beyond the range; nan stays nan; nearest_index is the level's index."""
    pos = np.asarray(lowbit.GRIDS[grid])
    mids = (pos[1:] + pos[:-1]) / 2
    rng = np.random.default_rng(4)
    random = rng.uniform(-1.3, 1.3, 4000) * pos[-1]
    bf16 = np.asarray(jnp.asarray(random, jnp.bfloat16), np.float64)
    y = np.concatenate([mids, -mids, pos, -pos, bf16, random]).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: lowbit.round_nearest(v, grid))(jnp.asarray(y)))
    np.testing.assert_array_equal(got, _np_nearest(y.astype(np.float64), grid))
    np.testing.assert_array_equal(got[: len(mids)], pos[np.arange(1, 8) // 2 * 2])  # each midpoint to its even side
    index = np.asarray(lowbit.nearest_index(jnp.abs(jnp.asarray(y)), grid))
    np.testing.assert_array_equal(pos[index], np.abs(got))
    assert np.isnan(float(lowbit.round_nearest(jnp.float32(jnp.nan), grid)))


@pytest.mark.parametrize("grid", ["e2m1", "e1m2", "int4"])
def test_stochastic_rounding_is_unbiased(grid):
    """Only the two neighbouring levels come out, and the mean of n draws is y within 5 standard errors (the std of
    a two-point variable is at most gap / 2); saturated values stay at the max."""
    pos = np.asarray(lowbit.GRIDS[grid])
    rng = np.random.default_rng(5)
    y = np.concatenate([rng.uniform(-1, 1, 61) * pos[-1], [pos[3], -pos[-1], 2 * pos[-1]]]).astype(np.float32)
    n = 4000
    draws = np.asarray(
        jax.vmap(lambda k: lowbit.round_stochastic(jnp.asarray(y), grid, lowbit.uniform(k, y.shape)))(
            jax.random.split(jax.random.key(0), n)
        )
    )
    a = np.minimum(np.abs(y), pos[-1]).astype(np.float64)
    i = np.clip(np.searchsorted(pos, a, side="right") - 1, 0, 6)
    lower, gap = pos[i], pos[i + 1] - pos[i]
    mag = np.abs(draws)
    assert np.all(np.isclose(mag, lower) | np.isclose(mag, lower + gap)) and np.all(np.sign(draws) * np.sign(y) >= 0)
    assert np.all(np.abs(mag.mean(0) - a) <= 5 * gap / 2 / np.sqrt(n) + 1e-6)
    assert np.all(mag[:, -1] == pos[-1]) and np.all(mag[:, -3] == pos[3])  # a level stays; beyond saturates


def test_uniform_draws_are_uniform_and_independent():
    a = np.asarray(lowbit.uniform(jax.random.key(0), (1024, 1024))).ravel()
    b = np.asarray(lowbit.uniform(jax.random.key(1), (1024, 1024))).ravel()
    assert a.min() >= 0 and a.max() < 1
    assert abs(a.mean() - 0.5) < 0.002 and abs(a.var() - 1 / 12) < 0.001
    assert abs(np.histogram(a, 16, (0, 1))[0] / a.size - 1 / 16).max() < 0.002
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.005 and abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.005


@pytest.mark.parametrize("n", [1, 2, 16, 128])
def test_hadamard_matches_scipy_and_is_orthogonal(n):
    h = lowbit.hadamard(n, normalized=False)
    np.testing.assert_array_equal(h, scipy.linalg.hadamard(n))
    np.testing.assert_array_equal(h @ h.T, n * np.eye(n))
    hn = lowbit.hadamard(n, normalized=True)
    np.testing.assert_array_equal(hn, scipy.linalg.hadamard(n) / np.sqrt(n))
    np.testing.assert_allclose(hn @ hn, np.eye(n), atol=1e-12)  # symmetric and orthogonal: its own inverse
    for bad in (0, 12, -4, 2.0, True):
        with pytest.raises(ValueError, match="power of two"):
            lowbit.hadamard(bad, normalized=True)  # type: ignore[arg-type]  # wrong types on purpose


def test_bad_grid_is_named():
    with pytest.raises(ValueError, match="grid = 'e3m0'; allowed"):
        lowbit.round_nearest(jnp.ones(3), "e3m0")


# ------------------------------------------------------------------------- MXFP4 / NVFP4 block scaling


def _np_mxfp4(x: np.ndarray, grid: str = "e2m1", block: int = 32) -> np.ndarray:
    """Exact UE8M0 block scaling of float32 x [..., block k] in float64 (OCP MXFP4 for e2m1): e = clip(floor(log2
    amax) - floor(log2 G), -127, 127) (frexp; G the grid's max: 6, 1.75, 7), levels of x / 2^e (exact), x_hat =
    level 2^e; subnormal inputs and results flushed where the platform does."""
    b = _flush(x.astype(np.float64)).reshape(*x.shape[:-1], -1, block)
    amax = np.abs(b).max(-1, keepdims=True)
    e = np.clip(np.frexp(amax)[1] - 1 - (np.frexp(lowbit.GRIDS[grid][-1])[1] - 1), -127, 127)
    e = np.where(amax > 0, e, -127)
    return _flush(_np_nearest(np.ldexp(b, -e), grid) * np.ldexp(1.0, e)).reshape(x.shape)


def _np_nvfp4(x: np.ndarray, grid: str = "e2m1", m: float = 448.0, expand: float = 1.0) -> tuple[np.ndarray, int]:
    """Exact E4M3-under-FP32 block scaling of x [..., 16 k] (NVFP4 for e2m1 and the defaults; float64 arithmetic
    on exact products): t = amax(tensor), s_b = e4m3(expand M amax(block) / t) (ml_dtypes), code = nearest level of
    G M x / (s_b t) (G the grid's max) found by exact comparisons of G M |x| with midpoint * s_b * t (ties to the
    even code); x_hat = level s_b t / G M. Returns (x_hat, number of exact ties)."""
    b = _flush(x.astype(np.float64)).reshape(*x.shape[:-1], -1, 16)
    t = np.abs(b).max()
    if not t > 0:
        return np.zeros(x.shape), 0
    amax = np.abs(b).max(-1, keepdims=True)
    s_b = np.minimum(expand * m * amax / t, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    levels = np.asarray(lowbit.GRIDS[grid])
    gm = levels[-1] * m
    num, den = gm * np.abs(b), s_b * t  # exact in float64: <= 30 and <= 28 significant bits
    index, ties = np.zeros(b.shape, int), 0
    for j in range(7):
        rhs = (levels[j] + levels[j + 1]) / 2 * den  # <= 32 significant bits: exact
        ties += int(np.sum((num == rhs) & (den > 0)))
        index += ((num >= rhs) if (j + 1) % 2 == 0 else (num > rhs)) & (den > 0)
    x_hat = np.sign(b) * levels[index] * s_b * t / gm
    return _flush(x_hat).reshape(x.shape), ties


def _assert_codes_equal(got, want, rtol):
    """Values equal to within rtol: a different E2M1 code differs by at least 1/12 relatively, so this checks every
    code exactly and every value to rtol."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=0)


@pytest.mark.parametrize(
    "values, want",
    [
        ({0: 2.0**32}, [2.0**32]),  # came back as 4294963456: exp2(32.) is inexact on XLA:CPU
        ({0: 8192.0, 1: 4096.0}, [8192.0, 4096.0]),  # came back as [6144, 4096]: log2(8192.) = 12.999999
        ({0: 2.0**-124, 1: -(2.0**-125)}, [2.0**-124, -(2.0**-125)]),  # a block max below 2^-123 gave zeros
        ({0: 2.0**-20, 1: 3.0 * 2.0**-22}, [2.0**-20, 3.0 * 2.0**-22]),  # exponent below -12: scale not UE8M0
    ],
)
def test_mxfp4_reproductions_are_fixed(values, want):
    """Issue 15's MXFP4 reproductions: each block comes back exactly (its values are E2M1 levels times 2^e)."""
    x = jnp.zeros(32)
    for i, v in values.items():
        x = x.at[i].set(v)
    np.testing.assert_array_equal(jit_quantize(x, "mxfp4")[: len(want)], want)


@pytest.mark.parametrize("exact_max", [False, True])
def test_mxfp4_over_block_exponents_minus_100_to_100(exact_max):
    """One block per exponent k in -100..100 (gradient-sized blocks included): random values of magnitude ~2^k, or
    a block whose max is exactly +-2^k; every value equals the exact OCP reference (exact UE8M0 scales)."""
    rng = np.random.default_rng(6)
    k = np.arange(-100, 101)
    x = rng.normal(size=(k.size, 64)) * np.ldexp(1.0, k)[:, None]
    if exact_max:
        x = np.clip(x, -np.ldexp(0.99, k)[:, None], np.ldexp(0.99, k)[:, None])
        x[:, 5] = np.ldexp(1.0, k) * rng.choice([-1, 1], k.size)
        x[:, 37] = np.ldexp(1.0, k - 1)  # the second block's max 2^(k-1)
    x = x.astype(np.float32)
    got = np.asarray(jit_quantize(jnp.asarray(x), "mxfp4"), np.float64)
    np.testing.assert_array_equal(got, _np_mxfp4(x))
    if exact_max:
        np.testing.assert_array_equal(got[:, 5], x[:, 5])  # a power of two is a level times its own scale


def test_mxfp4_extremes_of_the_float32_range():
    """Blocks at the top of the float32 range, at the bottom of the normal range (scale exponent clamped at -127),
    subnormal blocks, zero blocks; a block holding inf or nan gives nan (UE8M0 0xFF), the others are unaffected."""
    rng = np.random.default_rng(7)
    maxes = [3.0e38, 2.0**127, 2.0**-120, 2.0**-124, 1.5 * 2.0**-125, 2.0**-126, 2.0**-130, 0.0]
    x = np.stack([rng.uniform(-1, 1, 32) * m for m in maxes]).astype(np.float32)
    x[:6, 0] = np.asarray(maxes[:6], np.float32)
    got = np.asarray(jit_quantize(jnp.asarray(x), "mxfp4"), np.float64)
    np.testing.assert_array_equal(got, _np_mxfp4(x))
    assert np.all(got[:6].max(-1) > 0) and np.all(got[-1] == 0)
    bad = jnp.asarray(x[:3]).at[1, 4].set(jnp.inf).at[2, 9].set(jnp.nan)
    out = np.asarray(jit_quantize(bad, "mxfp4"))
    assert np.all(np.isnan(out[1:])) and np.array_equal(out[0], got[0])


def test_nvfp4_reproduction_tiny_tensors_are_fixed():
    """Issue 15: for 0 < amax(tensor) < ~7.9e-36, s_enc = 2688 / amax overflowed: non-zero blocks came back as 0
    and zero blocks as nan. Now NVFP4 is invariant under power-of-two scaling of the tensor down to 2^-100 and
    matches the exact reference; zero blocks stay zero."""
    rng = np.random.default_rng(8)
    x = (rng.standard_t(3, size=(4, 64)) * np.exp(rng.normal(size=(4, 1)))).astype(np.float32)
    x[1, 16:32] = 0.0
    base = np.asarray(jit_quantize(jnp.asarray(x), "nvfp4"), np.float64)
    for k in (-100, -80, -60, 20, 60):
        scaled = np.ldexp(x, k).astype(np.float32)
        got = np.asarray(jit_quantize(jnp.asarray(scaled), "nvfp4"), np.float64)
        assert np.all(np.isfinite(got))
        np.testing.assert_array_equal(got, np.ldexp(base, k))
        _assert_codes_equal(got, _np_nvfp4(scaled)[0], 2.0**-22)
    assert float(jnp.max(jnp.abs(jit_quantize(jnp.asarray(x * 1e-37), "nvfp4")))) > 0
    np.testing.assert_array_equal(jit_quantize(jnp.asarray(x * 1e-37), "nvfp4")[1, 16:32], 0.0)


def test_nvfp4_near_the_subnormal_range():
    """Tensors whose amax lies at the very bottom of the normal range (2^-126 .. 2^-110): non-zero and finite where
    the exact reference is (flushed where the platform flushes subnormal results)."""
    rng = np.random.default_rng(9)
    for top in (2.0**-110, 2.0**-120, 2.0**-125):
        x = (rng.uniform(-1, 1, (2, 32)) * top).astype(np.float32)
        x[0, 0] = top
        x = np.where(np.abs(x) < TINY, 0, x).astype(np.float32)
        got = np.asarray(jit_quantize(jnp.asarray(x), "nvfp4"), np.float64)
        want, _ = _np_nvfp4(x)
        assert np.all(np.isfinite(got)) and got[0, 0] == top
        _assert_codes_equal(got, want, 2.0**-22)


@pytest.mark.parametrize(
    "fmt, knobs",
    [(f, {}) for f in ("e2m1", "e1m2", "int4", "mxfp4", "nvfp4")]
    + [("e1m2", {"scale": "ue8m0"}), ("int4", {"scale": "e4m3"}), ("nvfp4", {"select": "4over6"})]
    + [("e2m1", {"select": "4over6"})],
)
def test_zero_subnormal_and_nonfinite_tensors(fmt, knobs):
    """A zero tensor quantises to zeros (no nan); a subnormal-valued tensor to its exact quantisation, which is zero
    where the platform reads subnormals as zero; inf or nan in a block gives nan."""
    z = jnp.zeros((2, 64), jnp.float32)
    np.testing.assert_array_equal(jit_quantize(z, fmt, **knobs), z)
    np.testing.assert_array_equal(jit_quantize(z.astype(jnp.bfloat16), fmt, **knobs), z)
    sub = jnp.asarray(np.random.default_rng(10).uniform(-1, 1, (2, 64)) * 2.0**-130, jnp.float32)
    out = np.asarray(jit_quantize(sub, fmt, **knobs))
    assert np.all(np.isfinite(out)) and (not FLUSHES or np.all(out == 0))
    assert np.all(np.isnan(np.asarray(jit_quantize(z.at[0, 3].set(jnp.nan), fmt, **knobs))[0, :16]))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("shape, axis", [((3, 64), -1), ((2, 5, 96), -1), ((7, 96), 0), ((3, 5, 64), 1)])
def test_mx_and_nv_formats_match_exact_numpy(fmt, shape, axis):
    """Heavy-tailed float32 data over a wide range (`shape` with the blocked axis last, then moved to `axis`), with
    an all-zero block, blocks along a non-last axis and ragged other axes: every code exact, every value exact
    (mxfp4) or to 2^-22 (nvfp4, whose d_b is the float32 rounding of s_b t / 2688)."""
    rng = np.random.default_rng(len(shape) + axis)
    x = rng.standard_t(3, size=shape) * np.exp(rng.normal(size=shape[:-1] + (1,)) * 2)
    x[0, ..., :16] = 0.0
    x = x.astype(np.float32)
    got = jit_quantize(jnp.asarray(np.moveaxis(x, -1, axis)), fmt, axis=axis)
    got = np.moveaxis(np.asarray(got, np.float64), axis, -1)
    if fmt == "mxfp4":
        np.testing.assert_array_equal(got, _np_mxfp4(x))
    else:
        _assert_codes_equal(got, _np_nvfp4(x)[0], 2.0**-22)


@pytest.mark.parametrize("grid", ["e1m2", "int4"])
@pytest.mark.parametrize("scale", ["ue8m0", "e4m3"])
def test_uniform_grids_take_mx_and_nv_scales_exactly(grid, scale):
    """The uniform grids with UE8M0 (32-blocks) and E4M3-under-FP32 (16-blocks) scales against the exact references
    above: heavy-tailed data over block exponents -100..100, one block per exponent whose max is exactly +-2^k
    (a level times its own power-of-two scale: it comes back exactly under UE8M0), an all-zero block; blocks along
    axis 0 of a ragged [96, 7] tensor too."""
    rng = np.random.default_rng({"e1m2": 20, "int4": 21}[grid] + (scale == "e4m3"))
    k = np.arange(-100, 101)
    x = rng.standard_t(3, size=(k.size, 64)) * np.ldexp(1.0, k)[:, None]
    x = np.clip(x, -np.ldexp(0.99, k)[:, None], np.ldexp(0.99, k)[:, None])
    x[:, 5] = np.ldexp(1.0, k) * rng.choice([-1, 1], k.size)
    x[3, :32] = 0.0
    if scale == "e4m3":  # one tensor scale: keep the exponents within E4M3's reach of the tensor's max
        x = x[-20:]
    x = x.astype(np.float32)
    block = 32 if scale == "ue8m0" else 16
    got = np.asarray(jit_quantize(jnp.asarray(x), grid, scale=scale, block_size=block), np.float64)
    if scale == "ue8m0":
        np.testing.assert_array_equal(got, _np_mxfp4(x, grid))
        np.testing.assert_array_equal(got[:, 5], x[:, 5])
    else:
        _assert_codes_equal(got, _np_nvfp4(x, grid)[0], 2.0**-22)
    y = (rng.standard_t(3, size=(96, 7)) * np.exp(rng.normal(size=(1, 7)))).astype(np.float32)
    got = np.asarray(jit_quantize(jnp.asarray(y), grid, scale=scale, block_size=block, axis=0), np.float64)
    want = (_np_mxfp4(y.T, grid) if scale == "ue8m0" else _np_nvfp4(y.T, grid)[0]).T
    _assert_codes_equal(got, want, 0 if scale == "ue8m0" else 2.0**-22)


@pytest.mark.parametrize("fmt", ["e2m1", "nvfp4"])
def test_four_over_six_keeps_the_better_of_two_scales_per_block(fmt):
    """select="4over6" (arXiv 2512.02010) against its definition built from the exact references: per 16-block the
    candidate (amax mapped to 6, or to 4) with the smaller squared error; fp32 scales amax / 6 and amax / 4, E4M3
    scales with M = 256 and the "4" block scale 1.5 times larger. Blocks whose two candidates' errors are within
    float32 rounding of each other may take either. On fp32 scales the choice never does worse than plain e2m1
    (its "6" candidate), and does better on some blocks."""
    rng = np.random.default_rng(30)
    x = (rng.standard_t(4, size=(64, 64)) * np.exp(rng.normal(size=(64, 1)))).astype(np.float32)
    got = np.asarray(jit_quantize(jnp.asarray(x), fmt, select="4over6"), np.float64).reshape(64, 4, 16)
    b = x.astype(np.float64).reshape(64, 4, 16)
    if fmt == "e2m1":
        amax = np.abs(b).max(-1, keepdims=True)
        six, four = (_np_nearest(b / (amax / top), "e2m1") * (amax / top) for top in (6.0, 4.0))
    else:
        six, four = (_np_nvfp4(x, m=256.0, expand=e)[0].reshape(b.shape) for e in (1.0, 1.5))
    err6, err4, err = (np.sum((c - b) ** 2, -1) for c in (six, four, got))
    clear = np.abs(err4 - err6) > 1e-5 * np.maximum(err4, err6)
    want = np.where((err4 < err6)[..., None], four, six)
    _assert_codes_equal(got[clear], want[clear], 2.0**-21)
    np.testing.assert_allclose(err, np.minimum(err4, err6), rtol=1e-5)
    assert 0.05 < np.mean(err4 < err6) < 0.95  # both candidates are taken
    if fmt == "e2m1":
        plain = np.sum((np.asarray(jit_quantize(jnp.asarray(x), "e2m1"), np.float64).reshape(b.shape) - b) ** 2, -1)
        assert np.all(err <= plain * (1 + 1e-6)) and np.sum(err) < 0.97 * np.sum(plain)


def test_bad_scales_and_selections_are_named_before_tracing():
    x = jnp.ones((4, 32))
    for kwargs, error in [
        (dict(fmt="e1m2", scale="e5m2"), "scale = 'e5m2'; allowed: None"),
        (dict(fmt="nvfp4", select="best"), "select = 'best'; allowed"),
        (dict(fmt="e1m2", select="4over6"), "needs the e2m1 grid"),
        (dict(fmt="mxfp4", select="4over6"), "with fp32 or e4m3 scales"),
    ]:
        with pytest.raises(ValueError, match=error):
            jax.eval_shape(lambda kw=kwargs: quantize(x, **kw))


def _bf16_tensors(rng, n):
    """bf16-valued float32 tensors [4, 64] of N(0, s) data, every other one coarse (quarter-integers times a power
    of two, as low-precision activations are), whose amax is planted at 3 2^m or 5 2^m (m the smallest that makes
    it the max: a third of bf16 mantissas are multiples of 3), so that exact E2M1 midpoints occur."""
    for i in range(n):
        x = rng.normal(size=(4, 64)) * rng.uniform(0.01, 100)
        if i % 2:
            x = np.round(x / 2 ** np.floor(np.log2(np.abs(x).max())) * 16) / 16 * 2.0 ** rng.integers(-20, 20)
        x = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
        c = rng.choice([3.0, 5.0])
        x[rng.integers(4), rng.integers(64)] = c * 2.0 ** np.ceil(np.log2(np.abs(x).max() / c)) * rng.choice([-1, 1])
        yield x


def test_nvfp4_resolves_exact_ties_to_even_on_bf16_data():
    """Issue 15: on bf16 data NVFP4 resolved exact E2M1 midpoints in either direction. Against the exact reference
    (exact comparisons of 2688 |x| with midpoint * s_b * t), with many exact ties present, every code is right, both
    for float32 arrays of bf16 values (values to 2^-22) and bf16 arrays (bf16 output, values to 2^-8)."""
    rng = np.random.default_rng(11)
    ties = 0
    for x in _bf16_tensors(rng, 12):
        want, n = _np_nvfp4(x)
        ties += n
        got = np.asarray(jit_quantize(jnp.asarray(x), "nvfp4"))
        _assert_codes_equal(got, want, 2.0**-22)
        got16 = np.asarray(jit_quantize(jnp.asarray(x, jnp.bfloat16), "nvfp4").astype(jnp.float32))
        _assert_codes_equal(got16, want, 2.0**-8)
    assert ties > 100, ties


def test_nvfp4_on_plain_bf16_normal_data():
    """Random bf16 N(0, 1) data (no planted amax): exact codes against the exact reference."""
    rng = np.random.default_rng(12)
    for _ in range(8):
        x = np.asarray(jnp.asarray(rng.normal(size=(16, 64)), jnp.bfloat16), np.float32)
        _assert_codes_equal(np.asarray(jit_quantize(jnp.asarray(x), "nvfp4")), _np_nvfp4(x)[0], 2.0**-22)
