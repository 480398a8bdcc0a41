"""The shrinkage-bias analysis of UFP4 (docs/ufp4.md, "The finding").

shrinkage_bias(fmt): for an interior level q_i with neighbours q_{i-1} < q_i < q_{i+1}, round-to-nearest maps
the bin [(q_{i-1} + q_i) / 2, (q_i + q_{i+1}) / 2) to q_i; under a locally uniform density the mean rounding
error q_i - x over the bin is (2 q_i - q_{i-1} - q_{i+1}) / 4. E2M1: -0.125 at 2, -0.25 at 4 (and the mirror
images at -2, -4), 0 elsewhere; uniform grids: 0 everywhere.
sqnr(x, x_hat) = 10 log10(|x|^2 / |x - x_hat|^2) dB; alpha(x, x_hat) = <x_hat, x> / |x|^2 (the coherent gain;
alpha < 1 is shrinkage); bucket_entropy: the entropy in bits of how often each level's code is used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quant.grids import levels
from quant.quantize import DEFAULT_BLOCK, check_format, encode_blocks, split_blocks

__all__ = ["alpha", "bucket_entropy", "report", "shrinkage_bias", "sqnr"]


def shrinkage_bias(fmt: str) -> dict[float, float]:
    """{interior level: mean rounding error of its bin} in grid units, under locally uniform density."""
    q = levels(fmt)
    return {float(q[i]): float((2 * q[i] - q[i - 1] - q[i + 1]) / 4) for i in range(1, len(q) - 1)}


def sqnr(x: jax.Array, x_hat: jax.Array) -> jax.Array:
    """Signal-to-quantisation-noise ratio in dB (float32 scalar)."""
    x, x_hat = x.astype(jnp.float32), x_hat.astype(jnp.float32)
    return 10 * jnp.log10(jnp.sum(x * x) / jnp.sum((x - x_hat) ** 2))


def alpha(x: jax.Array, x_hat: jax.Array) -> jax.Array:
    """<x_hat, x> / |x|^2 (float32 scalar)."""
    x, x_hat = x.astype(jnp.float32), x_hat.astype(jnp.float32)
    return jnp.sum(x_hat * x) / jnp.sum(x * x)


def bucket_entropy(x: jax.Array, fmt: str, *, axis: int = -1, block_size: int | None = None) -> jax.Array:
    """Entropy (bits, at most log2(15)) of the distribution of x's quantised codes over the grid's 15 levels,
    round-to-nearest with the same block scales as `quantize`."""
    check_format(fmt)
    blocks, inner = split_blocks(x.astype(jnp.float32), axis, DEFAULT_BLOCK[fmt] if block_size is None else block_size)
    q = encode_blocks(blocks, fmt, inner)[0]
    grid = jnp.asarray(levels(fmt), jnp.float32)
    counts = jnp.sum(q.reshape(-1, 1) == grid[None, :], axis=0)
    p = counts / jnp.sum(counts)
    return -jnp.sum(jnp.where(p > 0, p * jnp.log2(jnp.where(p > 0, p, 1.0)), 0.0))


def report(x: jax.Array, x_hat: jax.Array, fmt: str, **block) -> dict[str, float]:
    """{"sqnr_db", "alpha", "entropy_bits"} of one tensor and its quantisation."""
    return {
        "sqnr_db": float(sqnr(x, x_hat)),
        "alpha": float(alpha(x, x_hat)),
        "entropy_bits": float(bucket_entropy(x, fmt, **block)),
    }
