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

import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FORMATS", "GRIDS", "grid_max", "levels", "round_to_grid", "uniform"]

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
    # the neighbours as sums of steps (no table lookup: on CPU a gather costs more than all the rest)
    steps = [grid[j + 1] - grid[j] for j in range(len(grid) - 1)]
    above = [a >= grid[j] for j in range(1, len(grid) - 1)]
    index = sum(b.astype(jnp.int32) for b in above)  # the lower neighbour's code, 0..6
    lower = sum(jnp.where(b, step, 0.0) for b, step in zip(above, steps))
    upper = lower + sum(jnp.where(index == j, step, 0.0) for j, step in enumerate(steps))
    if rounding == "nearest":
        mid = (lower + upper) / 2
        up = (a > mid) | ((a == mid) & (index % 2 == 1))  # tie: the upper code index + 1 is even
    else:
        up = uniform(key, a.shape) * (upper - lower) < a - lower
    return jnp.sign(y) * jnp.where(up, upper, lower)


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijection of uint32 whose output bits each depend on every input bit."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform float32 in [0, 1) (24 random bits) for each position of `shape`: a hash of (position, key).

    Two rounds of MurmurHash3's finaliser over the element counter, keyed by two words drawn from `key`; elementwise,
    so XLA fuses it into the rounding (jax.random's threefry and XLA's Philox write the bits to memory first and
    cost several times more here on CPU). Stochastic rounding needs independent uniform draws, not cryptographic
    strength.
    """
    seed = jax.random.bits(key, (2,), jnp.uint32)
    count = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
    h = _mix(_mix(count * jnp.uint32(0x9E3779B9) + seed[0]) ^ seed[1])
    return (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))
