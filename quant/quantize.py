"""Block-scaled fake quantisation: x -> the dequantised values of its 4-bit encoding (docs/ufp4.md).

Each format is an element grid (G its max: 6 for e2m1, 1.75 for e1m2, 7 for int4) and a block scale
(quant.grids.SCALES; a format's own unless `scale=` says otherwise), in blocks of `block_size` along `axis`:
  fp32   e2m1 / e1m2 / int4 (default block 16): s = amax(block) / G; x_hat = s * round(x / s), x / s in float32
         (XLA may multiply by the rounded 1 / s instead)
  ue8m0  mxfp4 (OCP MX: E2M1, default block 32): s = 2^e, e = clip(floor(log2 amax) - floor(log2 G), -127, 127)
         (for E2M1 the OCP rule floor(log2 amax) - 2); x_hat = s * round(x / s), x / s saturating at +-G. e is read
         from amax's exponent bits and x / s = x 2^-e is exact, so s is exactly the UE8M0 power of two for every
         block exponent (values below 2^-129 round to zero: UE8M0 cannot scale lower; results below 2^-126 are
         flushed to zero where the platform flushes float32 subnormals, as XLA:CPU does).
  e4m3   nvfp4 (NVIDIA: E2M1, default block 16): E4M3 block scales under an FP32 tensor scale (t = amax of the
         tensor): s_enc = G M / t with M = 448, s_b = e4m3(min(amax(block) / G * s_enc, 448)), d_b = s_b / s_enc,
         x_hat = d_b round(x / d_b)
"4over6" selection (e2m1 grid; arXiv 2512.02010) rounds every block twice and keeps the candidate with the smaller
squared error: fp32 scales amax / 6 and amax / 4; e4m3 scales with M = 256 and s_b computed for amax / 6 and
(1.5 times larger) amax / 4 (so that 1.5 M = 384 stays below 448).
"grid" selection (Grid Games, arXiv 2605.12327) rounds every block on e2m1 and on int4 with the same kind of scale
(fp32: amax / 6 and amax / 7; e4m3: s_b for G = 6 and G = 7 under the one tensor scale t, M = 448) and keeps the
candidate with the smaller squared error (e2m1 on ties); `encode_signalled` stores the choice in the sign bit of
the block scale and `decode_signalled` reads it back, so the storage is nvfp4's (4-bit codes, one 8-bit E4M3 scale
per 16 elements, one FP32 tensor scale).
A block whose amax is 0 (or whose E4M3 scale underflows to 0) encodes zeros; a zero tensor gives zeros.
Rounding: nearest with ties to the even code, or unbiased stochastic (quant.grids.round_to_grid), or "ms_eden"
(MS-EDEN, Quartet II, arXiv 2601.22813): nearest rounding of the elements and the randomness moved to the block
scales. For x already rotated by a random Hadamard transform, per correction group g (`eden_group` elements: whole
blocks and whole rotation blocks) the EDEN factor c_g = <x_g, x_g> / <x_g, x_hat_g> (x_hat_g the nearest-rounded
dequantised group; 1 for a zero group) multiplies every block scale of the group, and the product is rounded
stochastically onto the scale's grid: fp32 scales d' = c d exactly; e4m3 scales (M = 256, so that c s_b <= 448 for
c <= 1.75) s_b' = one of the two E4M3 neighbours of c s_b, the upper with probability (c s_b - lower) / (upper -
lower) (c s_b >= 448 saturates to 448), d' = d s_b' / s_b. So E[x_hat'] = c x_hat over the scale draws, and
<x, c x_hat> = <x, x> per group: EDEN's condition under which the expectation over a uniformly random rotation R of
R^T c Q(R x) is x; with a random-sign Hadamard rotation it holds approximately (tests/test_quant_recipes_new.py
measures it). Arithmetic in
float32; the result has x's dtype and shape. A block holding inf or nan dequantises to nan (for e4m3 scales, the
tensor).

The e4m3 arithmetic, without ever forming s_enc (which overflows float32 for t below G M / FLT_MAX, ~7.9e-36 for
NVFP4) and without dividing: with t = 2^E t' (E = floor(log2 t) from exponent bits, t' in [1, 2)) and
a'_b = amax(block) 2^-E,
  s_b = e4m3(M a'_b / t'),   x / d_b = G M x / (s_b t) = num / den,   num = G M 2^-E x,   den = s_b t'
Both roundings are decided by comparing products, not quotients: the code by |num| against m den for the grid's
midpoints m (quant.grids.round_quotient), s_b by M a'_b against E4M3 midpoints times t'
(core.lowbit.round_e4m3_ratio). For NVFP4 (G M = 2688 = 21 2^7) the products are exact when x has at most 19 and
t at most 17 significant bits (bf16 data; G M = 784 or 3136 = 49 2^k for e1m2 and int4 take one bit more), so
exact midpoints go to the even code and s_b is the exact E4M3 rounding of M amax(block) / t; for float32 data with
longer mantissas each product is correctly rounded. (Dividing is not exact: XLA:CPU turns a division by a
per-block or per-tensor value into a multiplication by its rounded reciprocal.) x_hat = level d_b with
d_b = den / G M 2^E, rounded to float32 and applied in two normal factors, so tiny tensors keep their scale.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from core import lowbit
from core.lowbit import E4M3_MAX, UE8M0_MAX_EXPONENT, UE8M0_MIN_EXPONENT
from quant.grids import (
    FORMATS,
    GRID_GAMES_UNIFORM,
    ROUNDINGS,
    grid_max,
    grid_name,
    round_quotient,
    round_to_grid,
    scale_of,
    uniform,
)

__all__ = [
    "DEFAULT_BLOCK",
    "E4M3_MAX",
    "QUANTIZE_ROUNDINGS",
    "block_scales",
    "check_format",
    "decode_signalled",
    "encode_blocks",
    "encode_signalled",
    "quantize",
    "quantize_tiles",
    "split_blocks",
]

DEFAULT_BLOCK = {"e2m1": 16, "e1m2": 16, "int4": 16, "mxfp4": 32, "nvfp4": 16}
_NV_SPLIT = 100  # e4m3 scales: tensors with t < 2^-100 scale by 2^-E in two factors, each a normal float32
_E4M3_4OVER6 = 256.0  # M under 4 over 6: the "4" candidate's scale, 1.5 M = 384, stays below E4M3_MAX
QUANTIZE_ROUNDINGS = (*ROUNDINGS, "ms_eden")
_EMAX = {grid: math.floor(math.log2(levels[-1])) for grid, levels in lowbit.GRIDS.items()}  # e2m1 2, e1m2 0, int4 2


def check_format(fmt: str) -> None:
    """Raises ValueError naming `fmt` and the allowed formats unless it is one of FORMATS."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt = {fmt!r}; allowed: {list(FORMATS)}.")


def split_blocks(x: jax.Array, axis: int, block: int) -> tuple[jax.Array, int]:
    """(x with `axis` split in place into [n / block, block], the index of the within-block axis). No transpose:
    on CPU moving the axis last and back costs more than the quantiser."""
    x = x.reshape(1) if x.ndim == 0 else x
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"quantize: axis = {axis} is out of range for x of shape {x.shape}.")
    axis = axis % x.ndim
    n = x.shape[axis]
    if block < 1 or n % block:
        raise ValueError(
            f"quantize: length {n} of axis {axis} (shape {x.shape}) is not divisible by block_size = "
            f"{block}; pad the axis or pick a block size that divides it."
        )
    return x.reshape(*x.shape[:axis], n // block, block, *x.shape[axis + 1 :]), axis + 1


def _power_of_two(blocks, amax, grid, rounding, key):
    """UE8M0 scales 2^e, e = clip(floor(log2 amax) - floor(log2 grid max), -127, 127) (OCP MX for e2m1)."""
    e = jnp.clip(lowbit.floor_log2(amax) - _EMAX[grid], UE8M0_MIN_EXPONENT, UE8M0_MAX_EXPONENT)
    finite = jnp.isfinite(amax)
    # the per-block factors 2^-e and 2^e = 2^h 2^(e - h) (h = floor(e / 2): both normal, also for e = -127), each
    # divided by 1 (nan for a block holding inf or nan): the division makes XLA compute them once per block rather
    # than redo their bit arithmetic for every element of the block
    one = jnp.where(finite, 1.0, jnp.nan)
    half = e >> 1
    inverse, s_hi, s_lo = lowbit.pow2(-e) / one, lowbit.pow2(half) / one, lowbit.pow2(e - half) / one
    q = round_to_grid(blocks * inverse, grid, rounding=rounding, key=key)  # x 2^-e, -e in [-125, 127]: exact
    scale = jnp.where(finite, jnp.where(amax > 0, lowbit.pow2(e), 0.0), jnp.nan)
    return q, q * s_hi * s_lo, scale  # ldexp(q, e): exact


def _tensor_scaled(blocks, amax, grid, rounding, key, *, target=E4M3_MAX, expand=1.0):
    """E4M3 block scales under the tensor's FP32 scale (the module docstring; M = `target`, and the block's E4M3
    scale taken `expand` times larger, which maps its amax to grid max / expand: 4 over 6's candidate)."""
    nv_scale = grid_max(grid) * target  # G M = s_enc t
    t = jnp.max(amax)
    finite = jnp.isfinite(t)
    exponent = jnp.where((t > 0) & finite, lowbit.floor_log2(t), 0)  # E; t reads 0 if flushed as subnormal
    n_hi = jnp.maximum(-exponent - _NV_SPLIT, 0)  # 2^-E = 2^n_lo 2^n_hi; n_hi > 0 only for t < 2^-100
    n_lo = -exponent - n_hi

    def normalise(v):  # v 2^-E, exact (each factor a normal power of two, the result at most 2)
        return v * lowbit.pow2(n_lo) * lowbit.pow2(n_hi)

    t1, a1 = normalise(t), normalise(amax)  # t' in [1, 2), a'_b
    s_b = lowbit.round_e4m3_ratio(target * expand * a1, jnp.where(t1 > 0, t1, 1.0))  # e4m3(M a'_b / t'), exact ties
    d1 = s_b * t1  # G M d_b 2^-E
    # den = d1 2^-n_hi (>= 2^-58, normal), +inf for a block that encodes zeros (every level test fails: level 0).
    # A division (exact: by a power of two, or 1 / 0) ends the per-block computation: XLA computes it once per
    # block, where it would fuse cheaper operations into the per-element loop and redo them for every element.
    den = jnp.where(d1 > 0, d1, 1.0) / jnp.where(d1 > 0, lowbit.pow2(n_hi), 0.0)
    q = round_quotient(blocks * (nv_scale * lowbit.pow2(n_lo)), den, grid, rounding=rounding, key=key)
    e2 = jnp.minimum(exponent + _NV_SPLIT, 0)  # d_b = den 2^(n_hi + E - e2) / G M 2^e2, both factors normal
    d = jnp.where(den < jnp.inf, den * (lowbit.pow2(n_hi + exponent - e2) / nv_scale), 0.0)
    tail = jnp.where(finite, lowbit.pow2(e2), jnp.nan)
    return q, q * d * tail, d * tail


def _amax_scaled(blocks, amax, grid, rounding, key, *, top=None):
    """FP32 scales amax / top (top: the grid's max unless given; 4 over 6's candidate maps amax to 4)."""
    scale = amax / (grid_max(grid) if top is None else top)
    q = round_to_grid(blocks / jnp.where(scale > 0, scale, 1.0), grid, rounding=rounding, key=key)
    return q, q * scale, scale


def _smaller_error(blocks, axis, first, second):
    """Per block, the (levels, x_hat, scales) of the candidate whose squared error is smaller (`first` on ties),
    and whether `second` was taken (bool, one per block)."""
    errors = [jnp.sum(jnp.square(c[1] - blocks), axis=axis, keepdims=True) for c in (first, second)]
    take = errors[1] < errors[0]
    return tuple(jnp.where(take, b, a) for a, b in zip(first, second)), take


def _encode(blocks, fmt, axis, rounding, key, scale, select):
    """encode_blocks' triple and, per block, whether "grid" selection took the uniform grid (False otherwise)."""
    grid, scale = grid_name(fmt), scale_of(fmt, scale, select)
    amax = jnp.max(jnp.abs(blocks), axis=axis, keepdims=True)
    if scale == "ue8m0":
        return (*_power_of_two(blocks, amax, grid, rounding, key), None)
    if scale == "e4m3":
        on = functools.partial(_tensor_scaled, blocks, amax, rounding=rounding, key=key)
        if select == "4over6":
            chosen, _ = _smaller_error(
                blocks, axis, on(grid, target=_E4M3_4OVER6), on(grid, target=_E4M3_4OVER6, expand=1.5)
            )
            return (*chosen, None)
    else:
        on = functools.partial(_amax_scaled, blocks, amax, rounding=rounding, key=key)
        if select == "4over6":
            return (*_smaller_error(blocks, axis, on(grid, top=6.0), on(grid, top=4.0))[0], None)
    if select == "grid":
        chosen, take = _smaller_error(blocks, axis, on("e2m1"), on(GRID_GAMES_UNIFORM))
        return (*chosen, take)
    return (*on(grid), None)


def _stochastic_e4m3(v: jax.Array, u: jax.Array) -> jax.Array:
    """v >= 0 (float32) onto one of its two neighbouring E4M3 values, the upper with probability (v - lower) /
    (upper - lower) (u: uniform draws in [0, 1), v's shape), so E[result] = v for v <= 448; v >= 448 gives 448.
    The E4M3 step below v is 2^(max(floor log2 v, -6) - 3): exact bit arithmetic, no division."""
    e = jnp.maximum(lowbit.floor_log2(v), -6)
    step = lowbit.pow2(e - 3)
    lower = jnp.floor(v * lowbit.pow2(3 - e)) * step
    return jnp.where(v >= E4M3_MAX, E4M3_MAX, jnp.where(u * step < v - lower, lower + step, lower))


def _ms_eden(blocks, inner, fmt, key, scale, group):
    """MS-EDEN (module docstring) of float32 `blocks` (within-block axis `inner`) in correction groups of `group`
    consecutive blocks: the dequantised values."""
    grid, scale = grid_name(fmt), scale_of(fmt, scale)
    amax = jnp.max(jnp.abs(blocks), axis=inner, keepdims=True)
    if scale == "e4m3":
        q, x_hat, d = _tensor_scaled(blocks, amax, grid, "nearest", None, target=_E4M3_4OVER6)
    else:
        q, x_hat, d = _amax_scaled(blocks, amax, grid, "nearest", None)
    sums = jnp.concatenate(
        [jnp.sum(blocks * blocks, axis=inner, keepdims=True), jnp.sum(blocks * x_hat, axis=inner, keepdims=True)],
        axis=inner,
    )  # [..., n / block, 2, ...]: <x, x> and <x, x_hat> per block
    shape = sums.shape
    grouped = sums.reshape(*shape[: inner - 1], shape[inner - 1] // group, group, *shape[inner:])
    total = jnp.broadcast_to(jnp.sum(grouped, axis=inner, keepdims=True), grouped.shape).reshape(shape)
    xx, xq = jnp.split(total, 2, axis=inner)
    c = jnp.where(xq > 0, xx / jnp.where(xq > 0, xq, 1.0), 1.0)
    if scale == "fp32":
        return q * (d * c)
    t = jnp.max(amax)
    s_b = lowbit.round_e4m3(jnp.where(d > 0, d / jnp.where(t > 0, t, 1.0), 0.0) * (grid_max(grid) * _E4M3_4OVER6))
    s_new = _stochastic_e4m3(c * s_b, uniform(key, s_b.shape))
    return q * (d * jnp.where(s_b > 0, s_new / jnp.where(s_b > 0, s_b, 1.0), 0.0))


def encode_signalled(
    x: jax.Array, fmt: str = "nvfp4", *, axis: int = -1, block_size: int | None = None, scale: str | None = None
) -> tuple[jax.Array, jax.Array]:
    """Grid Games storage (arXiv 2605.12327) of x (float, any shape; `axis` a multiple of the block): (codes, int32
    0..15 of x's shape: sign bit 3, magnitude index 0..7 on the block's grid; signed decode scales, float32, x's
    shape with `axis` split into [n / block, 1]: |s| is the block's decode scale and its sign bit the grid, clear
    for e2m1 and set for `GRID_GAMES_UNIFORM`, a zero block's +-0 included). A positive block scale never uses its
    sign bit, so the choice is free: with E4M3 block scales the stored bytes are nvfp4's. Nearest rounding, "grid"
    selection; `decode_signalled(codes, scales)` gives `quantize(x, fmt, select="grid")`'s values."""
    check_format(fmt)
    scale_of(fmt, scale, "grid")
    blocks, inner = split_blocks(
        jnp.asarray(x, jnp.float32), axis, DEFAULT_BLOCK[fmt] if block_size is None else block_size
    )
    levels, _, d, take = _encode(blocks, fmt, inner, "nearest", None, scale, "grid")
    codes = jnp.where(take, lowbit.encode_code(levels, GRID_GAMES_UNIFORM), lowbit.encode_code(levels, "e2m1"))
    return codes.reshape(jnp.shape(x)), jnp.where(take, -d, d)


def decode_signalled(codes: jax.Array, scales: jax.Array, *, axis: int = -1) -> jax.Array:
    """The values (float32, codes' shape) of `encode_signalled`'s (codes, signed scales): per block the grid read
    from the scale's sign bit (set: `GRID_GAMES_UNIFORM`, clear: e2m1), level times |scale|."""
    codes = jnp.asarray(codes)
    axis = axis % max(codes.ndim, 1)
    if scales.ndim != codes.ndim + 1 or scales.shape[axis + 1] != 1 or codes.shape[axis] % scales.shape[axis]:
        raise ValueError(
            f"decode_signalled: scales of shape {scales.shape} do not match codes of shape {codes.shape} split into "
            f"blocks along axis {axis} (expected [..., n / block, 1, ...])."
        )
    blocks, _ = split_blocks(codes, axis, codes.shape[axis] // scales.shape[axis])
    uniform_grid = jnp.signbit(scales)
    levels = jnp.where(uniform_grid, lowbit.decode_code(blocks, GRID_GAMES_UNIFORM), lowbit.decode_code(blocks, "e2m1"))
    return (levels * jnp.abs(scales)).reshape(codes.shape)


def encode_blocks(
    blocks: jax.Array,
    fmt: str,
    axis: int,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    *,
    scale: str | None = None,
    select: str = "max",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the grid level of each element, the dequantised values x_hat, the per-block decode scales) of float32
    `blocks` whose within-block axis is `axis`, on fmt's grid with the block scales `scale` (None: the format's
    own; quant.grids.scale_of) chosen as `select` says. Under "4over6" both candidates round with the same draws."""
    return _encode(blocks, fmt, axis, rounding, key, scale, select)[:3]


def block_scales(
    blocks: jax.Array, fmt: str, axis: int = -1, *, scale: str | None = None, select: str = "max"
) -> jax.Array:
    """Per-block decode scales s (float32, `blocks`' shape with `axis`, the within-block axis, of size 1): x_hat =
    s * level. fp32 scales: amax / grid max (/ 4 for a block that 4 over 6 maps to 4); ue8m0: the power of two
    2^e (2^-127 is a subnormal float32); e4m3: d_b = s_b / s_enc. 0 for a block that encodes zeros (amax 0, or an
    E4M3 block scale that underflows); nan for a ue8m0 block (e4m3 tensor) holding inf or nan. For inspection:
    `quantize` does not divide by these (see the module docstring)."""
    check_format(fmt)
    return encode_blocks(blocks.astype(jnp.float32), fmt, axis, scale=scale, select=select)[2]


def quantize(
    x: jax.Array,
    fmt: str,
    *,
    axis: int = -1,
    block_size: int | None = None,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    scale: str | None = None,
    select: str = "max",
    eden_group: int | None = None,
) -> jax.Array:
    """Fake-quantises x (any float dtype and shape) in blocks along `axis`; returns x's shape and dtype.

    fmt in FORMATS; block_size defaults to DEFAULT_BLOCK[fmt]; rounding "nearest" (ties to even), "stochastic"
    (unbiased; needs key) or "ms_eden" (QUANTIZE_ROUNDINGS; the module docstring: needs key, fp32 or e4m3 scales,
    select "max"; `eden_group` elements per correction group, a multiple of the block dividing the axis, default
    one block; x should already be rotated); scale: the block scales' encoding, one of quant.grids.SCALES (None:
    the format's own: "e1m2" with scale "ue8m0" is a uniform-grid MX format); select: "max", "4over6" or "grid"
    (quant.grids). x_hat = d * round(x / d) per block (the module docstring gives d for each scale). Under
    "4over6" and "grid" stochastic rounding is no longer unbiased: the choice between the two candidates depends
    on the draws. Raises ValueError on an unknown fmt / rounding / scale / select or a combination
    quant.grids.scale_of refuses, a non-float x, an axis out of range, or an axis the block does not divide.
    """
    check_format(fmt)
    scale_of(fmt, scale, select)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize: x has dtype {x.dtype}; a floating dtype is required.")
    block = DEFAULT_BLOCK[fmt] if block_size is None else block_size
    if rounding == "ms_eden":
        group = block if eden_group is None else eden_group
        _check_ms_eden(fmt, scale, select, key, block, group)
        blocks, inner = split_blocks(x.astype(jnp.float32), axis, group)  # whole groups first: a clear error
        blocks, inner = split_blocks(x.astype(jnp.float32), axis, block)
        return _ms_eden(blocks, inner, fmt, key, scale, group // block).reshape(x.shape).astype(x.dtype)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding = {rounding!r}; allowed: {list(QUANTIZE_ROUNDINGS)}.")
    blocks, inner = split_blocks(x.astype(jnp.float32), axis, block)
    x_hat = encode_blocks(blocks, fmt, inner, rounding, key, scale=scale, select=select)[1]
    return x_hat.reshape(x.shape).astype(x.dtype)


def _check_ms_eden(fmt, scale, select, key, block, group):
    """ValueError naming the argument for an MS-EDEN call quantize cannot honour."""
    if scale_of(fmt, scale, select) == "ue8m0" or select != "max":
        raise ValueError(
            f"rounding = 'ms_eden' with fmt = {fmt!r}, scale = {scale!r}, select = {select!r}: it needs fp32 or e4m3 "
            "scales (a UE8M0 scale has no neighbour close enough to carry the correction) and select = 'max'."
        )
    if key is None:
        raise ValueError(
            "rounding = 'ms_eden' needs a PRNG key (key=...): the block scales are rounded stochastically."
        )
    if isinstance(group, bool) or not isinstance(group, int) or group < block or group % block:
        raise ValueError(f"eden_group = {group!r}; allowed: a positive multiple of the block size {block}.")


def quantize_tiles(
    w: jax.Array, fmt: str, *, tile: int = 16, scale: str | None = None, select: str = "max"
) -> jax.Array:
    """Fake-quantises the last two axes of w ([..., K, N]) in tile x tile blocks (one scale per tile: NVFP4's 2-D
    weight scaling, so that w^T is quantised identically); the last two axes are zero-padded to whole tiles for
    the scales and cropped back. Nearest rounding; `scale` and `select` as in `quantize`; w's shape and dtype."""
    check_format(fmt)
    scale_of(fmt, scale, select)
    if w.ndim < 2:
        raise ValueError(f"quantize_tiles: w has shape {w.shape}; at least two axes [..., K, N] are required.")
    if tile < 1:
        raise ValueError(f"quantize_tiles: tile = {tile}; a positive tile size is required.")
    k, n = w.shape[-2:]
    pk, pn = -k % tile, -n % tile
    x = jnp.pad(w.astype(jnp.float32), [(0, 0)] * (w.ndim - 2) + [(0, pk), (0, pn)])
    lead = x.shape[:-2]
    kt, nt = x.shape[-2] // tile, x.shape[-1] // tile
    blocks = jnp.swapaxes(x.reshape(*lead, kt, tile, nt, tile), -3, -2).reshape(*lead, kt, nt, tile * tile)
    q = encode_blocks(blocks, fmt, -1, scale=scale, select=select)[1]
    q = jnp.swapaxes(q.reshape(*lead, kt, nt, tile, tile), -3, -2).reshape(x.shape)
    return q[..., :k, :n].astype(w.dtype)
