"""MGUP's selection (docs/mgup.md, "The mask"): which coordinates of each tensor get alpha, without sorting it.

For a direction u and the raw gradient g of one tensor, MGUP gives alpha to the k = int(tau * size) largest entries
of the signed product s = u * g and gamma to the others (`select_masks`, with k from `num_selected`). Three rules
(`SELECTIONS`):

    "exact"   exactly the k largest entries of s (ties at the k-th value: the first positions, row-major)
    "approx"  s >= t, t the k-th largest of a strided sample of APPROX_SAMPLE entries (tensors of more than
              2 APPROX_SAMPLE entries; smaller ones are selected exactly); the realised fraction is estimated
              from a second, disjoint sample
    "sign"    s >= 0 (Cautious-MGUP; tau unused)

The top-k needs counts, not an order. Floats are mapped to unsigned integer keys in the same order (`ordered_keys`);
the k-th largest key is found by a multiway search over the key range: each pass counts the entries at or above
`WAYS` thresholds at once (one variadic reduction, `count_at_least`) and keeps the sub-range that holds the answer.
A first pass tests a bracket from a strided sample's quantiles, so that a float32 tensor needs a handful of passes
instead of 32 / log2(WAYS + 1). The search stops once exactly k keys lie at or above its lower end, or at the k-th
largest key itself; ties there go to the first positions, found from per-row counts. The mask is an elementwise
function of the scores and three scalars, which XLA fuses into the parameter update. A tensor of at most 4096
entries, which the first pass would sort whole for its bracket, gets its k-th largest key from one sort (no search).
`approx_threshold` runs the same search on a strided sample only. Timings: results/bench/optim.md.

k may be a Python int (its edge cases resolved while tracing) or an int32 scalar array (a traced hyperparameter,
e.g. from `optax.inject_hyperparams`); both select the same entries. NaN scores are not supported (they sort above
+inf).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "APPROX_SAMPLE",
    "SELECTIONS",
    "WAYS",
    "Scalar",
    "approx_threshold",
    "count_at_least",
    "is_static",
    "num_selected",
    "ordered_keys",
    "score_dtype",
    "select_masks",
    "selection_key",
    "strided_pairs",
    "strided_sample",
    "top_k_mask",
]

SELECTIONS = ("exact", "approx", "sign")
"""MGUP's selection rules (see the module docstring); `selection=` of the MGUP transforms takes one of them."""

APPROX_SAMPLE = 1024
"""Entries of each strided sample that "approx" and "sign" take of a tensor of more than 2 APPROX_SAMPLE entries."""

WAYS = 6
"""Thresholds counted per pass of the search (one variadic reduction over the keys)."""

_BRACKET_SAMPLE = 4096

Scalar = float | jax.Array
"""A hyperparameter: a Python number, or a scalar array (e.g. traced, from optax.inject_hyperparams)."""


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
    of windowed reductions; a lone threshold is therefore counted together with its complement.
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
    so XLA can fuse it into whatever consumes it; at most 4096, the k-th largest from one sort of the keys."""
    n = score.size
    static = isinstance(k, int)
    if n == 0 or (static and k <= 0):
        return jnp.zeros(score.shape, bool)
    if static and k >= n:
        return jnp.ones(score.shape, bool)
    kk = k if static else jnp.clip(jnp.asarray(k, jnp.int32), 1, n)  # the search needs 1 <= k <= n
    flat = ordered_keys(score.ravel())
    if n <= _BRACKET_SAMPLE:
        # The k-th largest key t from one sort of the keys alone (a sort carrying positions, as argsort's, costs
        # several times more on XLA:CPU); of the keys equal to t, the first k - #(keys > t) are taken. The ranks
        # (0 taken, n not) are written by a scatter, which XLA does not fuse into the consumer: the update that
        # reads the mask stays a plain elementwise loop, with the arithmetic it had when the ranks came from sorts.
        t = jnp.sort(flat)[n - kk]
        tie = flat == t
        taken = (flat > t) | (tie & (jnp.cumsum(tie, dtype=jnp.int32) <= kk - jnp.sum(flat > t, dtype=jnp.int32)))
        everywhere = jnp.arange(n, dtype=jnp.int32)
        rank = jnp.zeros(n, jnp.int32).at[everywhere].set(jnp.where(taken, 0, n), unique_indices=True)
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


def strided_pairs(x: jax.Array, size: int) -> jax.Array:
    """Both strided samples of x at once, [m, 2]: column 0 is strided_sample(x, size), column 1 the second one.

    Read pair by pair: the two entries of a pair lie half a stride apart, so they often share a memory page, where
    two separate samples of a large tensor would each miss the TLB on every entry."""
    if x.size <= size:
        return jnp.stack([x.ravel()] * 2, axis=1)
    stride = x.size // size
    rows = x.ravel()[: size * stride].reshape(size, stride)
    return jnp.stack([rows[:, 0], rows[:, stride // 2]], axis=1)


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


# MGUP's per-tensor selection on top of the search above.


def is_static(x: Any) -> bool:
    """Whether a hyperparameter is a Python or NumPy number (not a JAX array): k is then computed while tracing."""
    return isinstance(x, numbers.Real) and not isinstance(x, jax.Array)


def num_selected(mask_ratio: Scalar, size: int) -> int | jax.Array:
    """k = int(mask_ratio * size), the number of coordinates MGUP gives alpha in a tensor of `size` entries.

    A Python number gives a Python int (Python's double product, floored: the reference's rule). A scalar array
    gives an int32 scalar computed on device with the same value as int(float(mask_ratio) * size): float64 by the
    same double product; float32 (bfloat16 and float16 are widened exactly) by the exact floor of m * size / 2^s
    for mask_ratio = m 2^-s, in 32-bit integer limbs (no float64 needed; equal to the double product's floor for
    size < 2^29, where that product is exact). Values outside [0, 1] are clipped to k in [0, size].
    """
    if is_static(mask_ratio):
        return int(float(mask_ratio) * size)
    r = jnp.asarray(mask_ratio)
    k = jnp.floor(r * size) if r.dtype == jnp.float64 else _floor_times(r.astype(jnp.float32), size)
    return jnp.clip(k, 0, size).astype(jnp.int32)


def _floor_times(r: jax.Array, n: int) -> jax.Array:
    """floor(r * n) exactly, for a float32 scalar r in [0, 1] and 0 <= n < 2^31 (int32; r < 0 gives 0)."""
    u32 = jnp.uint32
    bits = jax.lax.bitcast_convert_type(r, u32)
    exponent = (bits >> 23) & u32(0xFF)
    mantissa = (bits & u32(0x7FFFFF)) | jnp.where(exponent > 0, u32(1 << 23), u32(0))  # r = mantissa * 2^-shift
    shift = u32(150) - jnp.maximum(exponent, u32(1))  # >= 23 for r < 2
    # mantissa * n as hi * 2^32 + lo from 16-bit limbs (every partial product fits in 32 bits).
    a1, a0 = mantissa >> 16, mantissa & u32(0xFFFF)
    b1, b0 = u32(n >> 16), u32(n & 0xFFFF)
    low = a0 * b0
    mid = a0 * b1 + a1 * b0  # < 2^32: a0 * b1 < 2^31, a1 * b0 < 2^24
    lo = low + (mid << 16)
    hi = a1 * b1 + (mid >> 16) + (lo < low).astype(u32)
    small = jnp.minimum(shift, u32(31))  # shift < 32: the result takes bits of hi and lo
    below = (hi << (u32(32) - small)) | (lo >> small)
    big = jnp.maximum(shift, u32(32)) - u32(32)  # shift >= 32: of hi alone
    above = jnp.where(big < 32, hi >> jnp.minimum(big, u32(31)), u32(0))
    k = jnp.where(shift < 32, below, above)
    return jnp.where(r >= 1, u32(n), jnp.where(r > 0, k, u32(0))).astype(jnp.int32)


def score_dtype(update: jax.Array) -> jnp.dtype:
    """The dtype MGUP ranks and scales a tensor in: the update's, widened to at least float32."""
    return jnp.promote_types(update.dtype, jnp.float32)


def _product(u: jax.Array, g: jax.Array, dtype) -> jax.Array:
    """The score s = u * g in `dtype`."""
    return u.astype(dtype) * g.astype(dtype)


def _select(
    updates: list[jax.Array],
    grads: list[jax.Array],
    mask_ratio: Scalar,
    selection: str,
    samples: list | None = None,
) -> list[tuple[jax.Array, jax.Array]]:
    """Per tensor: (the coordinates that get alpha, bool of its shape; their fraction, exact or estimated, float32).

    "approx": tensors of more than 2 APPROX_SAMPLE entries get the threshold of their strided sample, all such
    tensors in one batched search (per-tensor small searches would cost more on CPU than the pass over the tensor);
    smaller ones are selected exactly. "sign" on such tensors reports the fraction of its second sample, not a
    count (which would cost a pass over the tensor). `samples[i]`: (direction, grad) of tensor i at strided_pairs
    (both samples, [m, 2] each), computed elsewhere (optim.transform.with_mgup); by default sliced from the tensors.
    A traced `mask_ratio` takes the same paths with k on device; "approx" then also covers k = 0 and k = size (no
    coordinate, every coordinate) on its large tensors, as the exact path does.
    """
    static = is_static(mask_ratio)
    out: list = [None] * len(updates)
    sampled = []
    for i, (u, g) in enumerate(zip(updates, grads)):
        n = u.size
        k = num_selected(mask_ratio, n) if selection != "sign" else 0
        if n > 2 * APPROX_SAMPLE and (selection == "sign" or (selection == "approx" and (not static or 0 < k < n))):
            sampled.append(i)
        elif selection == "sign":
            chosen = _product(u, g, score_dtype(u)) >= 0
            out[i] = chosen, count_at_least(chosen, [jnp.bool_(True)])[0] / max(n, 1)
        elif static:
            # full_like: the constant carries u's mesh-axis type (a state leaf inside shard_map must)
            fraction = jnp.full_like(u, k, jnp.float32, ()) / max(n, 1)
            out[i] = top_k_mask(_product(u, g, score_dtype(u)), k), fraction
        else:  # (the same float32 division as above)
            fraction = jnp.zeros_like(u, jnp.float32, ()) + jnp.asarray(k).astype(jnp.float32) / max(n, 1)
            out[i] = top_k_mask(_product(u, g, score_dtype(u)), k), fraction
    if not sampled:
        return out
    dtype = functools.reduce(jnp.promote_types, [score_dtype(updates[i]) for i in sampled])

    def pairs(i):  # [m, 2]: the scores at strided_sample (column 0) and at its second sample (column 1)
        if samples is not None and samples[i] is not None:
            u, g = samples[i]
        else:
            u, g = (strided_pairs(x, APPROX_SAMPLE) for x in (updates[i], grads[i]))
        return _product(u, g, dtype)

    both = jnp.stack([pairs(i) for i in sampled])
    first, second = both[..., 0], both[..., 1]
    if selection == "sign":
        fractions = jnp.mean(second >= 0, axis=1, dtype=jnp.float32)
        for j, i in enumerate(sampled):
            out[i] = _product(updates[i], grads[i], dtype) >= 0, fractions[j]
        return out
    thresholds, fractions = jax.vmap(lambda a, b: approx_threshold(a, b, mask_ratio))(first, second)
    for j, i in enumerate(sampled):
        chosen, fraction = ordered_keys(_product(updates[i], grads[i], dtype)) >= thresholds[j], fractions[j]
        if not static:
            n = updates[i].size
            k = num_selected(mask_ratio, n)
            chosen = (chosen & (k > 0)) | (k >= n)
            fraction = jnp.where(k <= 0, 0.0, jnp.where(k >= n, 1.0, fraction))
        out[i] = chosen, fraction
    return out


def select_masks(
    updates: list[jax.Array],
    grads: list[jax.Array],
    mask_ratio: Scalar,
    selection: str,
    samples: list | None = None,
) -> tuple[list[jax.Array], jax.Array]:
    """MGUP's selection on a list of tensors: (chosen_i, f) with chosen_i a bool array of updates[i]'s shape, True on
    the coordinates that get alpha under `selection` (one of SELECTIONS; not checked here) with
    k_i = num_selected(mask_ratio, n_i), and f = sum_i f_i n_i / sum_i n_i (float32 scalar) the selected fraction
    over all their coordinates: f_i = k_i / n_i for "exact", counted or estimated for "approx" and "sign" (see the
    module docstring). updates[i], grads[i]: the direction and the raw gradient of tensor i, one shape each, any
    float dtype. `samples`: optional per-tensor strided_pairs of (direction, gradient), see `_select`."""
    pairs = _select(updates, grads, mask_ratio, selection, samples)
    total = max(sum(u.size for u in updates), 1)
    fraction = sum(f * (u.size / total) for u, (_, f) in zip(updates, pairs))
    return [c for c, _ in pairs], jnp.asarray(fraction, jnp.float32)
