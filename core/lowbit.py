"""Exact low-bit numerics shared by quant and kvcache: 4-bit grids and their rounding, exact powers of two and
floor(log2), UE8M0 and E4M3 scales, the Sylvester Hadamard matrix (docs/ufp4.md, docs/kvcache.md).

Every array function here is elementwise and gather-free (compares, selects, integer and bit operations, casts), so
XLA fuses it into the surrounding computation and Pallas lowers it inside Triton kernels. Powers of two and
floor(log2) are read from and written into float32 exponent bits, never computed with exp2 / log2: those are
inexact on XLA:CPU (exp2(32.) is 4294963456, log2(8192.) is 12.999999).

Grids: the non-negative levels in code order; a 4-bit code is the sign (bit 3) and the magnitude index 0..7.
  e2m1  0, 0.5, 1, 1.5, 2, 3, 4, 6     OCP FP4 E2M1 (max 6 = 1.5 * 2^E2M1_EMAX); the index is the E2M1 bit pattern
  e1m2  0, 0.25, 0.5, ..., 1.75         uniform, step 0.25
  int4  0, 1, ..., 7                    uniform, step 1 (-8 unused)
Round-to-nearest resolves a value exactly half-way between two levels to the level of even index (for e2m1 the
level whose mantissa bit is 0: 0, 1, 2, 4), as IEEE round-to-nearest-even does; values beyond the grid saturate.

Subnormal float32 (below 2^-126): XLA:CPU flushes them to zero in arithmetic (an operand below 2^-126 reads as 0,
a product below 2^-126 becomes 0); GPUs keep them by default. Functions built from bits (`floor_log2`, `pow2`,
`ue8m0_value`, `encode_e2m1`, `decode_e2m1`) are exact on every float32, subnormals included. Functions that multiply
(`ldexp`) use only normal operands and are exact whenever the result is a normal float32; a subnormal result is
rounded, or flushed to zero where the platform flushes.

Quotients: XLA:CPU divides by a value broadcast over a block as a multiplication by its rounded reciprocal, so a
quotient that is exactly a midpoint can come out one ulp off it. `round_ratio` and `round_e4m3_ratio` round num / den
by comparing num with products of den instead, exactly whenever those products are.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "E2M1_EMAX",
    "E2M1_LEVELS",
    "E4M3_MAX",
    "FLOOR_LOG2_NONFINITE",
    "FLOOR_LOG2_ZERO",
    "GRIDS",
    "UE8M0_BIAS",
    "UE8M0_MAX_EXPONENT",
    "UE8M0_MIN_EXPONENT",
    "cast_e4m3",
    "decode_code",
    "decode_e2m1",
    "encode_code",
    "encode_e2m1",
    "floor_log2",
    "hadamard",
    "ldexp",
    "mx_exponent",
    "nearest_index",
    "pow2",
    "round_e4m3",
    "round_e4m3_ratio",
    "round_nearest",
    "round_ratio",
    "round_stochastic",
    "signed_levels",
    "ue8m0_value",
    "uniform",
]

GRIDS: dict[str, tuple[float, ...]] = {
    "e2m1": (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    "e1m2": tuple(0.25 * i for i in range(8)),
    "int4": tuple(float(i) for i in range(8)),
}
E2M1_LEVELS = GRIDS["e2m1"]
E2M1_EMAX = 2  # floor(log2 6): the OCP MX shared exponent is floor(log2 amax) - E2M1_EMAX
E4M3_MAX = 448.0  # largest finite FP8 E4M3 (fn) value, 1.75 * 2^8
UE8M0_BIAS = 127  # a UE8M0 byte s stands for 2^(s - 127); s = 255 is NaN
UE8M0_MIN_EXPONENT, UE8M0_MAX_EXPONENT = -127, 127
FLOOR_LOG2_ZERO = -150  # floor_log2(0): below the exponent of every non-zero float32 (the smallest is 2^-149)
FLOOR_LOG2_NONFINITE = 128  # floor_log2(inf) and floor_log2(nan): above every finite float32's exponent

_MANTISSA_BITS = 23
_EXPONENT_BIAS = 127
_MIN_NORMAL_EXPONENT, _MIN_SUBNORMAL_EXPONENT, _MAX_EXPONENT = -126, -149, 127
_INF_BITS = 0x7F800000


def _grid(grid: str) -> tuple[float, ...]:
    if grid not in GRIDS:
        raise ValueError(f"grid = {grid!r}; allowed: {list(GRIDS)}.")
    return GRIDS[grid]


def signed_levels(grid: str) -> np.ndarray:
    """All 15 levels of the symmetric grid `grid` ("e2m1", "e1m2", "int4"), ascending: float64 [15], -max .. max."""
    pos = np.asarray(_grid(grid))
    return np.concatenate([-pos[:0:-1], pos])


# ------------------------------------------------------------------------------------- exponent bits of float32


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.float32), jnp.int32)


def floor_log2(x: jax.Array) -> jax.Array:
    """floor(log2 |x|) as int32, exact for every non-zero float32 x (normal: the exponent field - 127; subnormal
    m 2^-149: floor(log2 m) - 149, read from the exponent of float32(m), which is exact since m < 2^23). Any float
    dtype is cast to float32 first; any shape.

    floor_log2(+-0) = FLOOR_LOG2_ZERO (-150); floor_log2(+-inf) = floor_log2(nan) = FLOOR_LOG2_NONFINITE (128). Range
    for finite non-zero x: [-149, 127]. Bit operations only: a subnormal x gets its exact exponent even where the
    platform's arithmetic reads it as zero.
    """
    bits = _bits(x) & 0x7FFFFFFF
    biased = bits >> _MANTISSA_BITS
    mantissa = bits & ((1 << _MANTISSA_BITS) - 1)
    subnormal = (_bits(mantissa.astype(jnp.float32)) >> _MANTISSA_BITS) - _EXPONENT_BIAS + _MIN_SUBNORMAL_EXPONENT
    return jnp.where(biased > 0, biased - _EXPONENT_BIAS, jnp.where(mantissa > 0, subnormal, FLOOR_LOG2_ZERO))


def pow2(e: jax.Array) -> jax.Array:
    """2^e as float32 for integer e (any integer dtype and shape), written into the bits, so exact:
    e in [-126, 127]   the normal power of two
    e in [-149, -127]  the subnormal power of two (read as 0 by arithmetic on platforms that flush subnormals,
                       such as XLA:CPU: multiply with `ldexp` instead)
    e > 127            +inf;    e < -149   0
    """
    e = jnp.asarray(e).astype(jnp.int32)
    normal = (jnp.clip(e, _MIN_NORMAL_EXPONENT, _MAX_EXPONENT) + _EXPONENT_BIAS) << _MANTISSA_BITS
    subnormal = 1 << jnp.clip(e - _MIN_SUBNORMAL_EXPONENT, 0, _MANTISSA_BITS - 1)
    bits = jnp.where(e >= _MIN_NORMAL_EXPONENT, normal, jnp.where(e >= _MIN_SUBNORMAL_EXPONENT, subnormal, 0))
    return jax.lax.bitcast_convert_type(jnp.where(e > _MAX_EXPONENT, _INF_BITS, bits), jnp.float32)


def ldexp(x: jax.Array, e: jax.Array) -> jax.Array:
    """x 2^e (float32; x float, e integer, broadcast together) as x * 2^h * 2^(e - h) with h = floor(e / 2): both
    factors are normal powers of two for |e| <= 252, so the result is exact whenever it is a normal float32 (even
    where 2^e alone is subnormal, as the UE8M0 scale 2^-127 is); a subnormal result is rounded, or flushed to zero
    on platforms that flush (XLA:CPU); beyond the float32 range it is +-inf."""
    e = jnp.asarray(e).astype(jnp.int32)
    half = e >> 1
    return jnp.asarray(x).astype(jnp.float32) * pow2(half) * pow2(e - half)


def mx_exponent(amax: jax.Array) -> jax.Array:
    """The OCP MX shared exponent floor(log2 amax) - E2M1_EMAX (int32, amax's shape), exact, before any clamping:
    with scale 2^e, amax / scale lies in [4, 8) and E2M1 values above 6 saturate. amax = 0 gives
    FLOOR_LOG2_ZERO - 2, inf / nan FLOOR_LOG2_NONFINITE - 2; callers clamp to their scale's range (OCP UE8M0:
    [UE8M0_MIN_EXPONENT, UE8M0_MAX_EXPONENT])."""
    return floor_log2(amax) - E2M1_EMAX


def ue8m0_value(scale: jax.Array) -> jax.Array:
    """The float32 value 2^(s - 127) of UE8M0 bytes s (any integer dtype and shape): exact for s in [0, 254]
    (s = 0 is the subnormal 2^-127), nan for s = 255."""
    s = jnp.asarray(scale).astype(jnp.int32)
    return jnp.where(s == 255, jnp.float32(jnp.nan), pow2(s - UE8M0_BIAS))


def cast_e4m3(x: jax.Array) -> jax.Array:
    """x (float) -> float8_e4m3fn, round-to-nearest-even with saturation at +-E4M3_MAX (an unclipped cast would
    turn values beyond 464 into nan); nan stays nan. Subnormal E4M3 values (multiples of 2^-9 below 2^-6) are kept."""
    x = jnp.asarray(x).astype(jnp.float32)
    return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def round_e4m3(x: jax.Array) -> jax.Array:
    """x rounded to the nearest FP8 E4M3 value (ties to even, saturating at +-448), as float32 of x's shape."""
    return cast_e4m3(x).astype(jnp.float32)


def round_e4m3_ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    """round_e4m3(num / den) for num >= 0 and den > 0 (float32, broadcast together), the quotient rounded once:
    the E4M3 value c nearest to the float32 quotient, then moved to its neighbour c' if |num| lies beyond the
    midpoint m = (c + c') / 2, i.e. num > m den (= m den with c' of even code: ties to even). The quotient is
    within a few ulp of num / den (XLA:CPU divides by a broadcast value as a multiplication by its rounded
    reciprocal), so at most one step is off, and the comparisons are exact whenever num and m den are exact
    products (m has at most 5 significant bits). Saturates at E4M3_MAX; float32 of the broadcast shape."""
    num = jnp.asarray(num).astype(jnp.float32)
    den = jnp.asarray(den).astype(jnp.float32)
    code = jax.lax.bitcast_convert_type(cast_e4m3(num / den), jnp.uint8).astype(jnp.int32)  # 0 .. 126 (448)

    def value(k):
        return jax.lax.bitcast_convert_type(k.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)

    c, lower, upper = value(code), jnp.maximum(code - 1, 0), jnp.minimum(code + 1, 126)
    mid_up, mid_down = (c + value(upper)) / 2 * den, (value(lower) + c) / 2 * den
    up = (num > mid_up) | ((num == mid_up) & (upper % 2 == 0))
    down = (num < mid_down) | ((num == mid_down) & (lower % 2 == 0))
    return jnp.where(up, value(upper), jnp.where(down, value(lower), c))


# --------------------------------------------------------------------------------------------- grid rounding


def _uniform_step(levels: tuple[float, ...]) -> float | None:
    """The step of a uniform grid whose step is a power of two (division by it is exact), else None."""
    step = levels[1] - levels[0]
    uniform = all(b - a == step for a, b in itertools.pairwise(levels))
    return step if uniform and math.frexp(step)[0] == 0.5 else None


def nearest_index(a: jax.Array, grid: str) -> jax.Array:
    """The magnitude index (int32 0..7) of the level of `grid` nearest to a (float32 >= 0, any shape), ties to the
    even index, saturating at 7: sum over the 7 midpoints m_j = (q_j + q_{j+1}) / 2 of [a > m_j] (or [a >= m_j]
    where j + 1 is even, so that an exact midpoint goes to the even index)."""
    levels = _grid(grid)
    index = jnp.zeros(jnp.shape(a), jnp.int32)
    for j in range(len(levels) - 1):
        mid = (levels[j] + levels[j + 1]) / 2
        index += ((a >= mid) if (j + 1) % 2 == 0 else (a > mid)).astype(jnp.int32)
    return index


def round_nearest(y: jax.Array, grid: str) -> jax.Array:
    """y (float32, any shape, already divided by its scale) -> the nearest level of the symmetric grid (float32,
    same shape), ties to the level of even index, |y| saturating at the grid's max; nan stays nan.

    Uniform grids: k = floor(|y| / step), f = |y| / step - k (both exact: the step is a power of two), up if
    f > 1/2 or f = 1/2 and k odd. E2M1: the sum of the steps whose midpoints |y| passes (`nearest_index`).
    """
    levels = _grid(grid)
    y = jnp.asarray(y).astype(jnp.float32)
    a = jnp.minimum(jnp.abs(y), levels[-1])
    step = _uniform_step(levels)
    if step is not None:
        z = a * (1.0 / step)
        k = jnp.floor(z)
        f = z - k
        odd = (k.astype(jnp.int32) & 1) == 1
        value = (k + jnp.where((f > 0.5) | ((f == 0.5) & odd), 1.0, 0.0)) * step
    else:
        value = jnp.zeros_like(a)
        for j in range(len(levels) - 1):
            mid = (levels[j] + levels[j + 1]) / 2
            up = (a >= mid) if (j + 1) % 2 == 0 else (a > mid)
            value += jnp.where(up, levels[j + 1] - levels[j], 0.0)
    return jnp.sign(y) * value


def round_stochastic(y: jax.Array, grid: str, u: jax.Array) -> jax.Array:
    """Unbiased stochastic rounding of y (float32, any shape, already scaled) to the symmetric grid: |y| between
    neighbouring levels lower <= |y| <= lower + gap goes up with probability (|y| - lower) / gap, decided as
    u gap < |y| - lower with u uniform in [0, 1) of y's shape (e.g. `uniform`), so E[result] = y inside the grid's
    range; beyond it |y| saturates at the max. Float32, y's shape; nan stays nan."""
    levels = _grid(grid)
    y = jnp.asarray(y).astype(jnp.float32)
    a = jnp.minimum(jnp.abs(y), levels[-1])
    step = _uniform_step(levels)
    if step is not None:
        z = a * (1.0 / step)
        k = jnp.floor(z)
        value = (k + jnp.where(u < z - k, 1.0, 0.0)) * step  # u step < |y| - k step, scaled exactly by 1 / step
    else:
        steps = [b - c for c, b in itertools.pairwise(levels)]
        lower, gap = jnp.zeros_like(a), jnp.full_like(a, steps[0])
        for j in range(1, len(levels) - 1):  # the interval [levels[i], levels[i + 1]) that holds a, telescoped
            above = a >= levels[j]
            lower += jnp.where(above, steps[j - 1], 0.0)
            if steps[j] != steps[j - 1]:
                gap += jnp.where(above, steps[j] - steps[j - 1], 0.0)
        value = lower + jnp.where(u * gap < a - lower, gap, 0.0)
    return jnp.sign(y) * value


def round_ratio(num: jax.Array, den: jax.Array, grid: str, *, u: jax.Array | None = None) -> jax.Array:
    """The grid level of the quotient num / den (float32, num's shape; den > 0 broadcasts against num, e.g. one
    value per block), decided without dividing, by comparing |num| with level and midpoint multiples of den:
      nearest (u None):  the sum of the steps q_{j+1} - q_j whose midpoint m_j has m_j den < |num| (<= where j + 1
                         is even: an exact midpoint goes to the even index); saturates at the max
      stochastic (u):    with lower = q_i the largest level with q_i den <= |num| and gap = q_{i+1} - q_i, up if
                         u gap den < |num| - q_i den (u uniform in [0, 1) of num's shape): unbiased
    The sign is num's; nan stays nan. A float32 division by a value broadcast over a block is not exact on XLA:CPU
    (it becomes a multiplication by the rounded reciprocal), so a quotient that is exactly a midpoint can come out
    one ulp off; here the decisions are exact whenever num and m_j den are exact products (num with at most 24 and
    den with at most 21 significant bits).
    """
    levels = _grid(grid)
    num = jnp.asarray(num).astype(jnp.float32)
    den = jnp.asarray(den).astype(jnp.float32)
    a = jnp.abs(num)
    if u is None:
        value = jnp.zeros_like(a)
        for j in range(len(levels) - 1):
            threshold = (levels[j] + levels[j + 1]) / 2 * den
            up = (a >= threshold) if (j + 1) % 2 == 0 else (a > threshold)
            value += jnp.where(up, levels[j + 1] - levels[j], 0.0)
        return jnp.sign(num) * value
    a = jnp.minimum(a, levels[-1] * den)
    steps = [b - c for c, b in itertools.pairwise(levels)]
    lower, gap = jnp.zeros_like(a), jnp.full_like(a, steps[0])
    for j in range(1, len(levels) - 1):
        above = a >= levels[j] * den
        lower += jnp.where(above, steps[j - 1], 0.0)
        if steps[j] != steps[j - 1]:
            gap += jnp.where(above, steps[j] - steps[j - 1], 0.0)
    return jnp.sign(num) * (lower + jnp.where(u * (gap * den) < a - lower * den, gap, 0.0))


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijection of uint32 whose output bits each depend on every input bit."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform float32 in [0, 1) (24 random bits) for each position of `shape`: a hash of (position, key).

    Two rounds of MurmurHash3's finaliser over the element counter, keyed by two words drawn from `key`; elementwise,
    so XLA fuses it into the rounding, where jax.random's threefry and XLA's Philox write their bits to memory first.
    Stochastic rounding needs independent uniform draws, not cryptographic strength.
    """
    seed = jax.random.bits(key, (2,), jnp.uint32)
    count = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
    h = _mix(_mix(count * jnp.uint32(0x9E3779B9) + seed[0]) ^ seed[1])
    return (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


# ------------------------------------------------------------------------------------------------ E2M1 codes


def encode_e2m1(x: jax.Array) -> jax.Array:
    """Nearest E2M1 code (int32 0..15) of x (float, any shape, already divided by its scale): magnitude index
    `nearest_index(|x|, "e2m1")` (ties to even, saturating at +-6) with the sign in bit 3 (so -0 encodes as 8,
    which decodes to 0); nan encodes as 0 or 8. `encode_code(x, "e2m1")`."""
    return encode_code(x, "e2m1")


def encode_code(x: jax.Array, grid: str) -> jax.Array:
    """Nearest 4-bit code (int32 0..15) of x (float, any shape, already divided by its scale) on `grid`: the
    magnitude index `nearest_index(|x|, grid)` (ties to even, saturating at the grid's max) with the sign in bit 3
    (-0 encodes as 8, which decodes to 0). For "e2m1" this is `encode_e2m1`."""
    x = jnp.asarray(x).astype(jnp.float32)
    return nearest_index(jnp.abs(x), grid) | jnp.where(_bits(x) < 0, 8, 0)


def decode_code(code: jax.Array, grid: str) -> jax.Array:
    """The level (float32, code's shape) of 4-bit codes 0..15 (any integer dtype) on `grid`, by arithmetic (no table):
    `decode_e2m1` for "e2m1"; sign times magnitude index times the step for a uniform grid (0.25 for e1m2, 1 for
    int4: exact)."""
    levels = _grid(grid)
    if grid == "e2m1":
        return decode_e2m1(code)
    code = jnp.asarray(code).astype(jnp.int32)
    step = _uniform_step(levels)
    if step is None:
        raise ValueError(f"grid = {grid!r}: decode_code takes e2m1 or a uniform grid with a power-of-two step")
    return jnp.where(code & 8, -step, step) * (code & 7).astype(jnp.float32)


def decode_e2m1(code: jax.Array) -> jax.Array:
    """E2M1 value (float32, code's shape) of codes 0..15 (any integer dtype) by bit arithmetic (no table, no exp2).

    Magnitude index m = 2e + f (3 bits) is 2^(e-1) (1 + f/2) for e >= 1: placed at bit 22 of a float32, e lands in
    the exponent field and f in the top mantissa bit, and adding 126 to the exponent field gives exactly that
    value. e = 0 (0 and 0.5) is m / 2. The sign (bit 3) moves to bit 31."""
    code = jnp.asarray(code).astype(jnp.int32)
    m = code & 7
    bits = ((m << 22) + (126 << 23)) | ((code & 8) << 28)
    normal = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(m >= 2, normal, jnp.where(code & 8, -0.5, 0.5) * m.astype(jnp.float32))


# ------------------------------------------------------------------------------------------------- Hadamard


def hadamard(n: int, *, normalized: bool) -> np.ndarray:
    """The n x n Sylvester Hadamard matrix H_n (float64; n a power of two): H_1 = [1], H_2n = [[H, H], [H, -H]].
    Symmetric; H H^T = n I. normalized=False: entries +-1; normalized=True: H_n / sqrt(n), orthogonal and its own
    inverse."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: n = {n!r}; allowed: a power of two >= 1.")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n) if normalized else h
