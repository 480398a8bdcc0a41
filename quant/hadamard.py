"""The blockwise random Hadamard transform (RHT) of UFP4 and NVFP4 (docs/ufp4.md).

rht(x) splits `axis` into blocks of b entries and maps each block v to H_b D v / sqrt(b): D = diag(signs) with
signs in {-1, +1}^b, H_b the Sylvester Hadamard matrix (core.lowbit.hadamard). R = H_b D / sqrt(b) is orthonormal,
so rotating both operands of a product along their contraction axis with the same signs leaves the product
unchanged: <R a, R w> = <a, w>. Default signs: fixed for the run, drawn from the run's seed
(`run_signs(seed, b)` = `random_signs(jax.random.key(seed), b)`; seed 0 unless told), as the paper does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from core import lowbit

__all__ = ["hadamard", "random_signs", "rht", "run_signs"]


def hadamard(n: int) -> np.ndarray:
    """The n x n Sylvester Hadamard matrix, unnormalised (float64 entries +-1; n a power of 2), H H^T = n I:
    `core.lowbit.hadamard(n, normalized=False)`."""
    return lowbit.hadamard(n, normalized=False)


def random_signs(key: jax.Array, block_size: int = 16) -> jax.Array:
    """[block_size] float32 of independent +-1 (Bernoulli(1/2) from `key`)."""
    return jnp.where(jax.random.bernoulli(key, 0.5, (block_size,)), 1.0, -1.0).astype(jnp.float32)


def run_signs(seed: int = 0, block_size: int = 16) -> jax.Array:
    """The run's fixed RHT signs, [block_size] float32 of +-1: `random_signs(jax.random.key(seed), block_size)`.
    The training config's `train.seed` is the seed (experiments/build.py passes it to QuantPrecision); 0 is the
    default."""
    return random_signs(jax.random.key(seed), block_size)


def rht(
    x: jax.Array, *, axis: int = -1, block_size: int = 16, signs: jax.Array | None = None, seed: int = 0
) -> jax.Array:
    """x rotated blockwise along `axis` by H D / sqrt(block_size); x's shape and dtype (float32 arithmetic, or
    float64 for float64 x). `signs`: [block_size] of +-1 (default: the run's fixed signs `run_signs(seed)`)."""
    signs = run_signs(seed, block_size) if signs is None else jnp.asarray(signs)
    if signs.shape != (block_size,):
        raise ValueError(f"rht: signs has shape {signs.shape}; expected ({block_size},).")
    if x.ndim == 0 or x.shape[axis] % block_size:
        raise ValueError(f"rht: axis {axis} of shape {x.shape} is not divisible by block_size = {block_size}.")
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    rotation = jnp.asarray(hadamard(block_size), dtype) * signs.astype(dtype)[None, :] / np.sqrt(block_size)
    axis = axis % x.ndim
    blocks = x.astype(dtype).reshape(*x.shape[:axis], -1, block_size, *x.shape[axis + 1 :])  # split in place
    dims = "abcdefghijklmnopqrstuvwxy"[: blocks.ndim]
    inside = dims[axis + 1]
    spec = f"{dims},z{inside}->{dims.replace(inside, 'z')}"  # rotate the within-block axis, no transpose
    out = jnp.einsum(spec, blocks, rotation, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(x.shape).astype(x.dtype)
