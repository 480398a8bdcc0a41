"""Grouped matrix multiplication: rows of `lhs` sorted by group, each group multiplied by its own matrix.

    out[i] = lhs[i] @ rhs[g(i)]     g(i) = the group whose row range [start_g, start_g + group_sizes[g]) holds i

with the signature and semantics of `jax.lax.ragged_dot`: lhs [M, K], rhs [G, K, N], group_sizes [G] int32,
rows at and beyond sum(group_sizes) are zero in the output. This is the expert computation of a dropless MoE
(tokens sorted by expert) and the precision slot's second callable (a quantised version has the same signature).

Implementations, chosen per backend by `grouped_matmul(..., implementation="auto")`:
  * "ragged_dot": `jax.lax.ragged_dot`, native on GPU and TPU. On XLA:CPU it lowers to a generic loop far slower
    than a dense product of the same FLOPs (measured: results/bench/moe.md, `python -m experiments.bench.moe`).
  * "windowed" (the CPU default): a `lax.fori_loop` over row windows of W rows, each window a plain 2-D matmul
    with its group's matrix. A group of n rows takes ceil(n / W) windows; the last one overlaps the next group and
    its extra rows are overwritten by that group's windows, which run later. The trip count is dynamic, so only
    windows holding real rows are computed (at most M / W + G, usually far fewer), which also makes rows past
    sum(group_sizes) free: expert-parallel receive buffers sized for the worst case cost memory, not FLOPs.
    A custom VJP runs one loop over the same windows for both gradients: d(lhs) (rhs transposed) and d(rhs)
    accumulated per window.
  * "batched" (the CPU default when groups average at least `BATCHED_MIN_MEAN` rows): each group's first C rows
    (`default_capacity`: the mean group size plus two standard deviations of balanced routing) gathered into
    [G, C, K] and multiplied as one batched matmul, both gradients likewise; the rows past C of a fuller group run
    in "windowed"'s loop over those rows alone. XLA:CPU runs the batched product as one op instead of a loop of
    small ones, and the loop is short or empty. Padding rows cost FLOPs here (G x C rows at least), so a call whose
    groups hold fewer than 3/4 of the M rows (an expert-parallel receive buffer sized for the worst case) runs
    "windowed" instead, chosen on the device (`lax.cond`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = [
    "IMPLEMENTATIONS",
    "GroupedMatmul",
    "GroupedMatmulFn",
    "batched_grouped_matmul",
    "default_capacity",
    "default_window",
    "grouped_matmul",
    "windowed_grouped_matmul",
]

GroupedMatmul = Callable[..., jax.Array]
"""`(lhs [M, K], rhs [G, K, N], group_sizes [G] int32, *, preferred_element_type=None) -> [M, N]`."""

IMPLEMENTATIONS = ("auto", "ragged_dot", "windowed", "batched")
BATCHED_MIN_MEAN = 32  # "auto" on the CPU: "batched" when M / G is at least this, else "windowed"


def default_window(num_rows: int, num_groups: int) -> int:
    """Rows per window: the mean group size rounded down to a power of two, within [2, 512].

    Smaller windows waste fewer rows at group ends (about W/2 per group); larger ones run each 2-D matmul, above
    all the d(rhs) product that contracts over the window's rows, more efficiently (XLA:CPU runs small matmuls on
    one core). Every window reads its group's whole matrix, so few rows per group (a decode step: 32 rows of 16
    tokens over 8 groups) take windows of about their size, not of 32 mostly empty rows.
    """
    mean = max(num_rows // max(num_groups, 1), 1)
    return int(min(512, max(2, 1 << (mean.bit_length() - 1))))


def default_capacity(num_rows: int, num_groups: int) -> int:
    """Rows per group in "batched"'s batched product: the mean group size m = ceil(M / G) plus 2 sqrt(m) (two
    standard deviations of a group's size when rows are routed uniformly), rounded up to a multiple of 8."""
    mean = -(-num_rows // max(num_groups, 1))
    return int(-(-(mean + 2 * math.isqrt(mean)) // 8) * 8)


def _check(lhs, rhs, group_sizes):
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            f"grouped_matmul expects lhs [M, K], rhs [G, K, N], group_sizes [G]; got shapes "
            f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}."
        )
    if lhs.shape[1] != rhs.shape[1] or rhs.shape[0] != group_sizes.shape[0]:
        raise ValueError(
            f"grouped_matmul: lhs {lhs.shape} and rhs {rhs.shape} need lhs[1] == rhs[1] (K) and "
            f"group_sizes {group_sizes.shape} one entry per rhs group ({rhs.shape[0]})."
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped_matmul: group_sizes must be integer, got {group_sizes.dtype}.")


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type=None,
    *,
    implementation: str = "auto",
    window: int | None = None,
) -> jax.Array:
    """`out[i] = lhs[i] @ rhs[group(i)]` (see the module docstring); ragged_dot's signature and semantics.

    Args:
      lhs: [M, K], rows sorted by group. rhs: [G, K, N]. group_sizes: [G] int32 with sum <= M.
      preferred_element_type: accumulation/output dtype (default lhs.dtype).
      implementation: "auto" (ragged_dot on GPU/TPU; on CPU batched when M / G >= `BATCHED_MIN_MEAN`, else
        windowed), "ragged_dot", "windowed" or "batched".
      window: rows per window for "windowed" (default `default_window(M, G)`); "batched"'s loop over the rows past
        its capacity takes windows of min(16, that) rows.
    Returns:
      [M, N] in `preferred_element_type` (or lhs.dtype); rows >= sum(group_sizes) are zero.
    """
    _check(lhs, rhs, group_sizes)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"grouped_matmul implementation = {implementation!r}; allowed: {list(IMPLEMENTATIONS)}.")
    m, g = lhs.shape[0], rhs.shape[0]
    if implementation == "auto":
        cpu = jax.default_backend() == "cpu"
        implementation = ("batched" if m >= BATCHED_MIN_MEAN * g else "windowed") if cpu else "ragged_dot"
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    if implementation == "ragged_dot":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
    window = default_window(m, g) if window is None else int(window)
    # Under shard_map the operands may vary over different mesh axes (tokens over data and expert, weights over
    # expert only). Adding a zero of the other's type gives both the union; autodiff then sums the weight gradient
    # over the extra axes, which the custom VJP below could not do itself.
    lhs, rhs = lhs + jax.lax.full_like(rhs, 0, lhs.dtype, ()), rhs + jax.lax.full_like(lhs, 0, rhs.dtype, ())
    if implementation == "windowed":
        return windowed_grouped_matmul(lhs, rhs, group_sizes, window, out_dtype)
    return jax.lax.cond(
        4 * jnp.sum(group_sizes) >= 3 * m,
        lambda: batched_grouped_matmul(lhs, rhs, group_sizes, default_capacity(m, g), min(16, window), out_dtype),
        lambda: windowed_grouped_matmul(lhs, rhs, group_sizes, window, out_dtype),
    )


@dataclasses.dataclass(frozen=True)
class GroupedMatmulFn:
    """`grouped_matmul` with a fixed implementation, as a hashable value (a module may hold it statically)."""

    implementation: str = "auto"
    window: int | None = None

    def __call__(self, lhs, rhs, group_sizes, preferred_element_type=None):
        return grouped_matmul(
            lhs, rhs, group_sizes, preferred_element_type, implementation=self.implementation, window=self.window
        )


def _spans(sizes: jax.Array, starts: jax.Array, num_rows: int, window: int):
    """Windows of `window` rows over rows [starts[g], starts[g] + sizes[g]) of each group g, in group order (sizes
    summing to at most `num_rows`): (count, group of window i, first row of window i)."""
    num_groups = sizes.shape[0]
    per_group = (sizes + window - 1) // window
    win_end = jnp.cumsum(per_group)
    win_start = win_end - per_group
    i = jnp.arange(-(-num_rows // window) + num_groups, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(win_end, i, side="right"), num_groups - 1).astype(jnp.int32)
    return win_end[-1], group, starts[group] + (i - win_start[group]) * window


def _windows(group_sizes: jax.Array, num_rows: int, window: int):
    """The windows of "windowed"'s loop: (count, group of window i, first row of window i, end row of each group)."""
    row_end = jnp.cumsum(group_sizes)
    return (*_spans(group_sizes, row_end - group_sizes, num_rows, window), row_end)


def _zeros(shape, dtype, *like: jax.Array) -> jax.Array:
    """Zeros that vary over the same `shard_map` axes as the arrays `like` (a loop carry must keep its type);
    `full_like` carries that type on every supported jax version."""
    out = jax.lax.full_like(like[0], 0, dtype, shape)
    for a in like[1:]:
        out = out + jax.lax.full_like(a, 0, dtype, ())
    return out


def _padded(x: jax.Array, window: int) -> jax.Array:
    """x [M, n] with `window` zero rows appended, so that a window starting at any row < M can be sliced whole."""
    return jnp.concatenate([x, jnp.zeros((window, x.shape[1]), x.dtype)])


def _real_rows(out: jax.Array, m: int, row_end: jax.Array) -> jax.Array:
    """The first m rows of a loop's output [M + window, n], rows >= sum(group_sizes) (= row_end[-1]) zeroed."""
    return jnp.where((jnp.arange(m) < row_end[-1])[:, None], out[:m], 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def windowed_grouped_matmul(lhs, rhs, group_sizes, window: int, out_dtype):
    """The "windowed" implementation (module docstring): out[rows of window i] = lhs[rows] @ rhs[group i] for every
    window, in order. `window` and `out_dtype` are static."""
    m = lhs.shape[0]
    count, group, first_row, row_end = _windows(group_sizes, m, window)
    out = _forward_loop(_padded(lhs, window), rhs, (count, group, first_row), window, out_dtype)
    return _real_rows(out, m, row_end)


def _forward_loop(padded, rhs, spans, window: int, out_dtype):
    """out [M + window, N]: out[rows of window i] = padded[rows] @ rhs[group i] for the windows `spans` (`_spans`),
    in order; other rows zero."""
    count, group, first_row = spans

    def body(i, out):
        rows = jax.lax.dynamic_slice_in_dim(padded, first_row[i], window)
        w = jax.lax.dynamic_index_in_dim(rhs, group[i], keepdims=False)
        y = jax.lax.dot_general(rows, w, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, y, first_row[i], 0)

    return jax.lax.fori_loop(0, count, body, _zeros((padded.shape[0], rhs.shape[2]), out_dtype, padded, rhs))


def _fwd(lhs, rhs, group_sizes, window, out_dtype):
    return windowed_grouped_matmul(lhs, rhs, group_sizes, window, out_dtype), (lhs, rhs, group_sizes)


def _bwd(window, out_dtype, res, g):
    """One loop over the windows for both gradients: window i's rows of d(lhs) = g[rows] @ rhs[group i]^T (written in
    order, like the forward's rows) and d(rhs)[group i] += lhs[rows of the group]^T g[rows] (the window's rows of the
    next group masked out of lhs), both from one slice of g. d(lhs)'s product contracts rhs's last axis in place (a
    transposed copy of rhs would be multiplied more slowly on XLA:CPU)."""
    lhs, rhs, group_sizes = res
    m = lhs.shape[0]
    count, group, first_row, row_end = _windows(group_sizes, m, window)
    x_pad, g_pad = _padded(lhs, window), _padded(g, window)
    d_rhs = _zeros(rhs.shape, jnp.float32, lhs, g)
    d_lhs, d_rhs = _backward_loop(x_pad, g_pad, rhs, (count, group, first_row), row_end, window, d_rhs)
    return _real_rows(d_lhs, m, row_end).astype(lhs.dtype), d_rhs.astype(rhs.dtype), None


def _backward_loop(x_pad, g_pad, rhs, spans, row_end, window: int, d_rhs):
    """Both gradients over the windows `spans`: (d(lhs) [M + window, K], its window rows written in order; d_rhs
    plus each window's lhs[rows of its group]^T g[rows])."""
    count, group, first_row = spans

    def body(i, carry):
        d_lhs, d_rhs = carry
        start, gid = first_row[i], group[i]
        dy = jax.lax.dynamic_slice_in_dim(g_pad, start, window)
        w = jax.lax.dynamic_index_in_dim(rhs, gid, keepdims=False)
        dx = jax.lax.dot_general(dy, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        mine = (start + jnp.arange(window) < row_end[gid])[:, None]
        x = jnp.where(mine, jax.lax.dynamic_slice_in_dim(x_pad, start, window), 0)
        dw = jax.lax.dynamic_index_in_dim(d_rhs, gid, keepdims=False) + jax.lax.dot_general(
            x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return (
            jax.lax.dynamic_update_slice_in_dim(d_lhs, dx, start, 0),
            jax.lax.dynamic_update_index_in_dim(d_rhs, dw, gid, 0),
        )

    d_lhs = _zeros((x_pad.shape[0], x_pad.shape[1]), jnp.float32, x_pad, g_pad)
    return jax.lax.fori_loop(0, count, body, (d_lhs, d_rhs))


windowed_grouped_matmul.defvjp(_fwd, _bwd)


def _capacity_layout(group_sizes: jax.Array, m: int, capacity: int):
    """The "batched" layout: (row_end; source [G, C]: the row of each group's c-th slot, m (a zero row of the padded
    operand) past its size; main [M]: row i is in its group's first C rows; slot [M]: its index in the flattened
    [G * C] product; over_start [G]: each group's first row past its C)."""
    row_end = jnp.cumsum(group_sizes)
    starts = row_end - group_sizes
    c = jnp.arange(capacity)
    source = jnp.where(c[None] < group_sizes[:, None], starts[:, None] + c[None], m)
    row = jnp.arange(m)
    group = jnp.minimum(jnp.searchsorted(row_end, row, side="right"), group_sizes.shape[0] - 1)
    at = row - starts[group]
    return row_end, source, at < capacity, group * capacity + jnp.minimum(at, capacity - 1), starts + capacity


def _combine(main, slot, batched: jax.Array, loop: jax.Array, m: int, row_end) -> jax.Array:
    """Rows [M, n] from the batched product [G, C, n] (rows in their group's first C: `main`, at `slot`) or the
    loop [M + W, n]."""
    out = jnp.where(main[:, None], batched.reshape(-1, batched.shape[-1])[slot], loop[:m])
    return _real_rows(out, m, row_end)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def batched_grouped_matmul(lhs, rhs, group_sizes, capacity: int, window: int, out_dtype):
    """The "batched" implementation (module docstring): group g's first `capacity` rows in one batched product
    [G, C, K] x [G, K, N], its rows past them in windows of `window` rows. `capacity`, `window` and `out_dtype` are
    static; the result is that of any implementation, for any group sizes."""
    m = lhs.shape[0]
    row_end, source, main, slot, over_start = _capacity_layout(group_sizes, m, capacity)
    padded = _padded(lhs, window)
    y = jnp.einsum("gck,gkn->gcn", padded[source], rhs, preferred_element_type=out_dtype)
    spans = _spans(jnp.maximum(group_sizes - capacity, 0), over_start, m, window)
    return _combine(main, slot, y, _forward_loop(padded, rhs, spans, window, out_dtype), m, row_end)


def _batched_fwd(lhs, rhs, group_sizes, capacity, window, out_dtype):
    return batched_grouped_matmul(lhs, rhs, group_sizes, capacity, window, out_dtype), (lhs, rhs, group_sizes)


def _batched_bwd(capacity, window, out_dtype, res, g):
    """Both gradients as the forward: batched products over the first C rows of each group, the loop over the rest."""
    lhs, rhs, group_sizes = res
    m = lhs.shape[0]
    row_end, source, main, slot, over_start = _capacity_layout(group_sizes, m, capacity)
    x_pad, g_pad = _padded(lhs, window), _padded(g, window)
    x, dy = x_pad[source], g_pad[source]
    dx = jnp.einsum("gcn,gkn->gck", dy, rhs, preferred_element_type=jnp.float32)
    d_rhs = jnp.einsum("gck,gcn->gkn", x, dy, preferred_element_type=jnp.float32)
    spans = _spans(jnp.maximum(group_sizes - capacity, 0), over_start, m, window)
    d_loop, d_rhs = _backward_loop(x_pad, g_pad, rhs, spans, row_end, window, d_rhs)
    d_lhs = _combine(main, slot, dx, d_loop, m, row_end)
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), None


batched_grouped_matmul.defvjp(_batched_fwd, _batched_bwd)
