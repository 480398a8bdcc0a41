"""Selecting the k largest entries of a tensor without sorting it: the top-k behind MGUP's mask (docs/mgup.md).

Design: a full sort (`lax.top_k` of half a tensor lowers to one on XLA:CPU), and even a top_k of a few hundred,
costs several passes over the tensor, while selection only needs counts. Floats are mapped to unsigned integer keys
in the same order (`ordered_keys`); the k-th largest key is found by a multiway search over the key range: each pass
counts the entries at or above `WAYS` thresholds at once (one variadic reduction, about the cost of one count) and
keeps the sub-range that holds the answer. A first pass tests a bracket from a strided sample's quantiles, so a
float32 tensor needs a handful of passes (at most 8 on 1.6M normal, Cauchy and Adam-like products;
tests/test_select.py) instead of 32 / log2(WAYS + 1). The search stops once exactly k keys lie at or above its lower
end, or at the k-th largest key itself; ties there go to the first positions, found from per-row counts (a cumsum
over a whole tensor costs many counting passes on XLA:CPU). The mask is an elementwise function of the scores and
three scalars, which XLA fuses into the parameter update. A tensor of at most 4096 entries, which the first pass would
sort whole for its bracket, is ranked by a stable sort instead (no search: a fraction of the compiled program, since a
model holds many such tensors: norms, biases, routers). `approx_threshold` runs the same search on a strided
sample only. Timings: results/bench/optim.md.

k may be a Python int (its edge cases resolved while tracing) or an int32 scalar array (a traced hyperparameter,
e.g. from `optax.inject_hyperparams`); both select the same entries. NaN scores are not supported (they sort above
+inf).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = [
    "WAYS",
    "approx_threshold",
    "count_at_least",
    "ordered_keys",
    "selection_key",
    "strided_sample",
    "top_k_mask",
]

WAYS = 6  # thresholds per counting pass: up to about 8 cost about one plain count on XLA:CPU
_BRACKET_SAMPLE = 4096


def ordered_keys(x: jax.Array) -> jax.Array:
    """float32 / float64 -> uint32 / uint64 with a < b iff key(a) < key(b) (-0.0 sorts just below +0.0)."""
    bits = {jnp.dtype(jnp.float32): (jnp.uint32, 32), jnp.dtype(jnp.float64): (jnp.uint64, 64)}
    if x.dtype not in bits:
        raise ValueError(f"ordered_keys: dtype {x.dtype} not supported; allowed: float32, float64.")
    utype, width = bits[x.dtype]
    u = jax.lax.bitcast_convert_type(x, utype)
    sign = jnp.asarray(1 << (width - 1), utype)
    return jnp.where(u >= sign, ~u, u | sign)  # negatives: flip all bits; non-negatives: set the sign bit


def count_at_least(keys: jax.Array, thresholds: list[jax.Array]) -> list[jax.Array]:
    """[#(keys >= t) for t in thresholds] in one pass over `keys`: one variadic reduction of int32 indicators.

    XLA:CPU emits a variadic reduction as one vectorised loop, but rewrites a single-operand one into a slower tree
    of windowed reductions (several times slower here); a lone threshold is therefore counted together with its
    complement.
    """
    ops = [(keys >= t).astype(jnp.int32).ravel() for t in thresholds]
    if len(ops) == 1:  # (both results are used, or XLA drops the complement again)
        ops.append((keys < thresholds[0]).astype(jnp.int32).ravel())
    out = jax.lax.reduce(tuple(ops), (jnp.int32(0),) * len(ops), lambda a, b: tuple(x + y for x, y in zip(a, b)), (0,))
    return [(out[0] + keys.size - out[1]) // 2] if len(thresholds) == 1 else list(out)


def _sample_bracket(keys: jax.Array, k: int | jax.Array, sample: int) -> tuple[jax.Array, jax.Array]:
    """Keys that hold the k-th largest of `keys` between them with overwhelming probability: the quantiles
    q -+ (4 sigma + 2 / m) of a sorted strided sample of about `sample` entries (m of them), q = 1 - k / size.
    (A sort of a few thousand entries costs about one counting pass over a large tensor.) Only the number of passes
    depends on it, not the result."""
    n = keys.size
    s = jnp.sort(keys[:: max(1, n // sample)])
    m = s.size
    if isinstance(k, int):
        q = 1.0 - k / n
        margin = 4.0 * math.sqrt(q * (1.0 - q) / m) + 2.0 / m
        return s[max(0, int((q - margin) * m))], s[min(m - 1, math.ceil((q + margin) * m))]
    quantile = 1.0 - k.astype(jnp.float32) / n
    width = 4.0 * jnp.sqrt(quantile * (1.0 - quantile) / m) + 2.0 / m
    lo = jnp.clip(jnp.floor((quantile - width) * m), 0, m - 1).astype(jnp.int32)
    hi = jnp.clip(jnp.ceil((quantile + width) * m), 0, m - 1).astype(jnp.int32)
    return s[lo], s[hi]


def selection_key(
    keys: jax.Array, k: int | jax.Array, *, sample: int = _BRACKET_SAMPLE
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(t, at_least, greater, passes) for a 1-D array of keys [n] and 1 <= k <= n (a Python int, or an int32 scalar
    the caller keeps in range): at_least = #(keys >= t) >= k, and either at_least == k (`keys >= t` selects exactly
    the k largest), or t is the k-th largest key and greater = #(keys > t) (< k; the rest of the k are ties at t).
    passes: the counting passes over `keys` it took. All int32 scalars but t (keys' dtype).

    Invariant of the search: #(keys >= lo) >= k > #(keys >= hi). The first pass counts at the sample bracket, every
    later pass at WAYS thresholds evenly spread over (lo, hi).
    """
    n = keys.size
    if isinstance(k, int) and not 1 <= k <= n:
        raise ValueError(f"selection_key: k = {k} must be in [1, {n}].")
    utype = keys.dtype
    top = jnp.asarray(jnp.iinfo(utype).max, utype)

    def narrow(state, thresholds):
        lo, hi, c_lo, c_hi = state
        for t, c in zip(thresholds, count_at_least(keys, thresholds)):  # in any order
            below = (c >= k) & (t > lo)
            lo, c_lo = jnp.where(below, t, lo), jnp.where(below, c, c_lo)
            above = (c < k) & (t < hi)
            hi, c_hi = jnp.where(above, t, hi), jnp.where(above, c, c_hi)
        return lo, hi, c_lo, c_hi

    # keys >= 0 always counts n >= k; `top` (a NaN pattern) counts at most the NaNs, taken as < k.
    state = (jnp.zeros((), utype), top, jnp.int32(n), jnp.int32(0))
    state = narrow(state, list(_sample_bracket(keys, k, sample)))

    def body(carry):
        state, passes = carry
        lo, hi = state[:2]
        step = (hi - lo) // (WAYS + 1)
        spread = [jnp.where(step > 0, lo + step * j, jnp.minimum(lo + j, hi)) for j in range(1, WAYS + 1)]
        return narrow(state, spread), passes + 1

    # Done when the range is one key (t = lo), or when exactly k keys are >= lo (then `keys >= lo` is the answer's
    # mask, and the k-th largest key, the least of them, is not needed).
    (lo, _, c_lo, c_hi), passes = jax.lax.while_loop(
        lambda c: (c[0][1] - c[0][0] > 1) & (c[0][2] != k), body, (state, jnp.int32(1))
    )
    return lo, c_lo, c_hi, passes


def _position_of_nth(flags: jax.Array, nth: jax.Array, row: int = 1024) -> jax.Array:
    """The flat index of the nth (1-based) True of a 1-D bool array, without a cumsum over all of it (XLA:CPU's
    costs many counting passes): count per row of `row` entries, find the row from the (short) running count of rows,
    then the column from a running count inside that one row."""
    n = flags.size
    rows = -(-n // row)
    grid = jnp.pad(flags, (0, rows * row - n)).reshape(rows, row)
    running = jnp.cumsum(jnp.sum(grid, axis=1, dtype=jnp.int32))
    r = jnp.minimum(jnp.searchsorted(running, nth), rows - 1)
    before = jnp.where(r > 0, running[jnp.maximum(r - 1, 0)], 0)
    inside = jnp.cumsum(jax.lax.dynamic_index_in_dim(grid, r, keepdims=False).astype(jnp.int32))
    return r * row + jnp.searchsorted(inside, nth - before)


def top_k_mask(score: jax.Array, k: int | jax.Array) -> jax.Array:
    """Bool mask (score's shape) of exactly the k largest entries of `score` (any shape, float32 or float64; ties at
    the k-th value go to the first positions in row-major order). k: a Python int or an int32 scalar array; k <= 0
    selects nothing, k >= size everything. Above 4096 entries an elementwise function of `score` and three scalars,
    so XLA can fuse it into whatever consumes it; at most 4096, the ranks of one stable sort."""
    n = score.size
    static = isinstance(k, int)
    if n == 0 or (static and k <= 0):
        return jnp.zeros(score.shape, bool)
    if static and k >= n:
        return jnp.ones(score.shape, bool)
    kk = k if static else jnp.clip(jnp.asarray(k, jnp.int32), 1, n)  # the search needs 1 <= k <= n
    flat = ordered_keys(score.ravel())
    if n <= _BRACKET_SAMPLE:
        rank = jnp.argsort(jnp.argsort(~flat, stable=True))  # 0 for the largest; ties: the first position first
        mask = (rank < kk).reshape(score.shape)
        return mask if static else (mask & (k > 0)) | (k >= n)
    t, at_least, greater, _ = selection_key(flat, kk)
    # The last position among the keys equal to t that is taken: all of them unless there are more ties than needed.
    # (full_like: the branch carries the data's mesh-axis type, as the other does inside shard_map)
    last = jax.lax.cond(
        at_least == kk, lambda: jnp.full_like(at_least, n, jnp.int32), lambda: _position_of_nth(flat == t, kk - greater)
    )
    keys = ordered_keys(score)
    position = (
        sum(
            jax.lax.broadcasted_iota(jnp.int32, score.shape, d) * math.prod(score.shape[d + 1 :])
            for d in range(score.ndim)
        )
        if score.ndim
        else jnp.int32(0)
    )
    mask = (keys > t) | ((keys == t) & (position <= last))
    return mask if static else (mask & (k > 0)) | (k >= n)


def strided_sample(x: jax.Array, size: int, *, second: bool = False) -> jax.Array:
    """`size` entries of x (flattened) at a fixed stride, or all of x if it has at most `size`; `second=True` takes
    the disjoint sample half a stride further on."""
    if x.size <= size:
        return x.ravel()
    stride = x.size // size
    return x.ravel()[(stride // 2 if second else 0) :: stride][:size]


def approx_threshold(sample: jax.Array, check: jax.Array, fraction: float | jax.Array) -> tuple[jax.Array, jax.Array]:
    """(t, estimate) from two samples of a tensor's scores (float32 or float64, m and any number of entries).

    t: the k-th largest key (`ordered_keys`) of `sample`, k = round(fraction m) clipped to [1, m], for the test
    ordered_keys(score) >= t; estimate: the fraction of `check` (a disjoint sample) at or above t, an unbiased
    estimate of the fraction the test realises on the whole tensor (standard error about 0.5 / sqrt(check.size)),
    float32. `fraction`: a Python float or a float scalar array (k is then computed on device, as Python's round
    when fraction m is exact: always for float64, and for float32 when m is a power of two, as MGUP's samples are).
    """
    keys = ordered_keys(sample.ravel())
    m = keys.size
    if isinstance(fraction, (int, float)):
        k: int | jax.Array = max(1, min(m, round(fraction * m)))
    else:
        f = jnp.asarray(fraction)
        k = jnp.clip(jnp.round(f.astype(jnp.promote_types(f.dtype, jnp.float32)) * m), 1, m).astype(jnp.int32)
    lo = selection_key(keys, k, sample=min(m, 512))[0]
    # The search may stop at any key with exactly k keys at or above it; the least of those keys is the k-th largest
    # itself, so that t depends on the sample only (not on the search's path).
    t = jnp.min(jnp.where(keys >= lo, keys, jnp.asarray(jnp.iinfo(keys.dtype).max, keys.dtype)))
    return t, jnp.mean(ordered_keys(check.ravel()) >= t, dtype=jnp.float32)
