"""The 4-bit element grids and their rounding (spec: ../shared/specs/ufp4.md).

Each grid is symmetric; its non-negative levels are listed in code order (code i = sign bit + 3-bit index i):
  e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6     (FP4 E2M1, non-uniform; max 6)
  e1m2: 0, 0.25, 0.5, ..., 1.75         (uniform; max 1.75)
  int4: 0, 1, ..., 7                    (uniform, -8 unused; max 7)
With a per-block FP32 amax scale, e1m2 and int4 are the same grid up to the scale.

`round_to_grid(y, fmt)` rounds values already divided by their block scale: round-to-nearest with ties to the
level of even code (the mantissa's last bit 0: for e2m1 0, 1, 2, 4; for the uniform grids even integers of
steps), or unbiased stochastic rounding between the two neighbouring levels. Values beyond the grid saturate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FORMATS", "GRIDS", "levels", "grid_max", "round_to_grid"]

GRIDS: dict[str, tuple[float, ...]] = {
    "e2m1": (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    "e1m2": tuple(0.25 * i for i in range(8)),
    "int4": tuple(float(i) for i in range(8)),
}
FORMATS = ("e2m1", "e1m2", "int4", "mxfp4", "nvfp4")  # mxfp4 and nvfp4 use the e2m1 grid
ROUNDINGS = ("nearest", "stochastic")


def _grid(fmt: str) -> tuple[float, ...]:
    name = "e2m1" if fmt in ("mxfp4", "nvfp4") else fmt
    if name not in GRIDS:
        raise ValueError(f"fmt = {fmt!r}; allowed: {list(FORMATS)}.")
    return GRIDS[name]


def levels(fmt: str) -> np.ndarray:
    """All levels of the symmetric grid, ascending (15 values: -max .. max)."""
    pos = np.asarray(_grid(fmt))
    return np.concatenate([-pos[:0:-1], pos])


def grid_max(fmt: str) -> float:
    return _grid(fmt)[-1]


def round_to_grid(y: jax.Array, fmt: str, *, rounding: str = "nearest", key: jax.Array | None = None) -> jax.Array:
    """y (float32, any shape, already scaled) -> the grid level chosen for each entry (float32, same shape).

    nearest: the closest level, ties to the even code; stochastic: the upper neighbour with probability
    (|y| - lower) / (upper - lower), so E[result] = y inside the grid's range (needs `key`).
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding = {rounding!r}; allowed: {list(ROUNDINGS)}.")
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding = 'stochastic' needs a PRNG key (key=...).")
    grid = _grid(fmt)
    a = jnp.minimum(jnp.abs(y), grid[-1])
    index = sum((a >= grid[j]).astype(jnp.int32) for j in range(1, len(grid) - 1))  # lower neighbour, 0..6
    table = jnp.asarray(grid, jnp.float32)
    lower, upper = table[index], table[index + 1]
    if rounding == "nearest":
        mid = (lower + upper) / 2
        up = (a > mid) | ((a == mid) & (index % 2 == 1))  # tie: the upper code index + 1 is even
    else:
        up = jax.random.uniform(key, a.shape, jnp.float32) * (upper - lower) < a - lower
    return jnp.sign(y) * jnp.where(up, upper, lower)
