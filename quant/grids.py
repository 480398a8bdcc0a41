"""The 4-bit element grids of quant's formats and their rounding (docs/ufp4.md); the numerics live in core.lowbit.

Each grid is symmetric; its non-negative levels are listed in code order (code i = sign bit + 3-bit index i):
  e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6     (FP4 E2M1, non-uniform; max 6; also the element grid of mxfp4 and nvfp4)
  e1m2: 0, 0.25, 0.5, ..., 1.75         (uniform; max 1.75)
  int4: 0, 1, ..., 7                    (uniform, -8 unused; max 7)
With a per-block FP32 amax scale, e1m2 and int4 are the same grid up to the scale.

Block scales (`SCALES`; a format's own is `FORMAT_SCALES[fmt]`, and any grid takes any of them: `scale_of`):
  fp32   amax(block) / grid max, exact in float32 (e2m1, e1m2, int4)
  e4m3   an FP8 E4M3 scale per block under an FP32 scale of the tensor (NVIDIA's NVFP4; nvfp4)
  ue8m0  a power of two per block, 2^(floor(log2 amax) - floor(log2 grid max)) (OCP MX; mxfp4)
Scale selection (`SELECTIONS`): "max" maps each block's amax to the grid's max; "4over6" ("Four Over Six",
arXiv 2512.02010) tries mapping it to 6 and to 4 and keeps, per block, the one with the smaller squared error (the
e2m1 grid with fp32 or e4m3 scales only: on a uniform grid the smaller target only drops levels). "grid" (Grid
Games, arXiv 2605.12327) rounds every block on two grids, e2m1 (its scale maps amax to 6) and the uniform
`GRID_GAMES_UNIFORM` (int4: amax to 7), and keeps, per block, the one with the smaller squared error (e2m1 on ties);
the choice costs no storage: it is the sign bit of the block scale, which a positive scale leaves spare (E4M3's
sign bit for nvfp4, FP32's for fp32 scales; UE8M0 has no spare bit, so "grid" refuses ue8m0). The decoder reads
the grid from that bit: quant.quantize.encode_signalled / decode_signalled.

`round_to_grid(y, fmt)` rounds values already divided by their block scale: round-to-nearest with ties to the
level of even code (the mantissa's last bit 0: for e2m1 0, 1, 2, 4; for the uniform grids even integers of
steps), or unbiased stochastic rounding between the two neighbouring levels. Values beyond the grid saturate.
"""

from __future__ import annotations

import jax
import numpy as np

from core import lowbit
from core.lowbit import GRIDS, uniform

__all__ = [
    "FORMATS",
    "FORMAT_SCALES",
    "GRIDS",
    "GRID_GAMES_UNIFORM",
    "ROUNDINGS",
    "SCALES",
    "SELECTIONS",
    "grid_max",
    "grid_name",
    "levels",
    "round_quotient",
    "round_to_grid",
    "scale_of",
    "uniform",
]

FORMATS = ("e2m1", "e1m2", "int4", "mxfp4", "nvfp4")  # mxfp4 and nvfp4 use the e2m1 grid
ROUNDINGS = ("nearest", "stochastic")
SCALES = ("fp32", "e4m3", "ue8m0")
FORMAT_SCALES = {"e2m1": "fp32", "e1m2": "fp32", "int4": "fp32", "mxfp4": "ue8m0", "nvfp4": "e4m3"}
SELECTIONS = ("max", "4over6", "grid")
GRID_GAMES_UNIFORM = "int4"  # select="grid": the uniform grid a block may choose instead of e2m1


def grid_name(fmt: str) -> str:
    """The element grid ("e2m1", "e1m2", "int4") of the format `fmt` (one of FORMATS)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt = {fmt!r}; allowed: {list(FORMATS)}.")
    return "e2m1" if fmt in ("mxfp4", "nvfp4") else fmt


def scale_of(fmt: str, scale: str | None = None, select: str = "max") -> str:
    """The block-scale encoding (one of SCALES) that `fmt` quantises with: `scale` when given, else the format's
    own (FORMAT_SCALES). ValueError naming the argument and what is allowed for an unknown fmt, scale or select,
    and for "4over6" or "grid" on a grid other than e2m1 or with ue8m0 scales."""
    grid = grid_name(fmt)
    if scale is not None and scale not in SCALES:
        raise ValueError(f"scale = {scale!r}; allowed: None (the format's own) or one of {list(SCALES)}.")
    if select not in SELECTIONS:
        raise ValueError(f"select = {select!r}; allowed: {list(SELECTIONS)}.")
    scale = FORMAT_SCALES[fmt] if scale is None else scale
    if select in ("4over6", "grid") and (grid != "e2m1" or scale == "ue8m0"):
        raise ValueError(
            f"select = {select!r} with fmt = {fmt!r} (grid {grid}) and scale = {scale!r}: it needs the e2m1 grid "
            "(e2m1, mxfp4, nvfp4) with fp32 or e4m3 scales."
        )
    return scale


def levels(fmt: str) -> np.ndarray:
    """All levels of the format's symmetric grid, ascending: float64 [15], -max .. max."""
    return lowbit.signed_levels(grid_name(fmt))


def grid_max(fmt: str) -> float:
    """The largest level of the format's grid (6 for e2m1, mxfp4, nvfp4; 1.75 for e1m2; 7 for int4)."""
    return GRIDS[grid_name(fmt)][-1]


def round_to_grid(y: jax.Array, fmt: str, *, rounding: str = "nearest", key: jax.Array | None = None) -> jax.Array:
    """y (float32, any shape, already scaled) -> the grid level chosen for each entry (float32, same shape).

    nearest: the closest level, ties to the even code (`core.lowbit.round_nearest`); stochastic: the upper
    neighbour with probability (|y| - lower) / (upper - lower), so E[result] = y inside the grid's range (needs
    `key`; the uniform draws are `uniform(key, y.shape)`, `core.lowbit.round_stochastic`). |y| beyond the grid's
    max saturates; nan stays nan.
    """
    key = _check_rounding(rounding, key)
    grid = grid_name(fmt)
    if key is None:
        return lowbit.round_nearest(y, grid)
    return lowbit.round_stochastic(y, grid, uniform(key, y.shape))


def round_quotient(
    num: jax.Array, den: jax.Array, fmt: str, *, rounding: str = "nearest", key: jax.Array | None = None
) -> jax.Array:
    """The grid level of num / den (num float32 of any shape, den > 0 broadcasting against it, e.g. per block),
    chosen as `round_to_grid(num / den, ...)` would with an exact quotient, but decided by comparing num with
    products of den (`core.lowbit.round_ratio`): exact ties go to the even code even where a float32 division
    would round the quotient off the midpoint. Float32, num's shape; stochastic draws `uniform(key, num.shape)`."""
    key = _check_rounding(rounding, key)
    u = None if key is None else uniform(key, num.shape)
    return lowbit.round_ratio(num, den, grid_name(fmt), u=u)


def _check_rounding(rounding: str, key: jax.Array | None) -> jax.Array | None:
    """The key stochastic rounding draws from (None for nearest rounding); ValueError on a bad rounding or a
    missing key."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding = {rounding!r}; allowed: {list(ROUNDINGS)}.")
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding = 'stochastic' needs a PRNG key (key=...).")
    return key if rounding == "stochastic" else None
