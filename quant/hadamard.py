"""The blockwise random Hadamard transform (RHT) of UFP4 and NVFP4 (spec: ../shared/specs/ufp4.md).

rht(x) splits `axis` into blocks of b entries and maps each block v to H_b D v / sqrt(b): D = diag(signs) with
signs in {-1, +1}^b, H_b the Sylvester Hadamard matrix. R = H_b D / sqrt(b) is orthonormal, so rotating both
operands of a product along their contraction axis with the same signs leaves the product unchanged:
<R a, R w> = <a, w>. Default signs: fixed for the run (`random_signs(jax.random.key(0), b)`), as the paper does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["hadamard", "random_signs", "rht"]


def hadamard(n: int) -> np.ndarray:
    """The n x n Sylvester Hadamard matrix (entries +-1; n a power of 2), H H^T = n I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: n = {n} must be a power of 2.")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def random_signs(key: jax.Array, block_size: int = 16) -> jax.Array:
    """[block_size] float32 of independent +-1."""
    return jnp.where(jax.random.bernoulli(key, 0.5, (block_size,)), 1.0, -1.0).astype(jnp.float32)


def rht(x: jax.Array, *, axis: int = -1, block_size: int = 16, signs: jax.Array | None = None) -> jax.Array:
    """x rotated blockwise along `axis` by H D / sqrt(block_size); x's shape and dtype (float32 arithmetic, or
    float64 for float64 x). `signs`: [block_size] of +-1 (default: fixed signs from key 0)."""
    signs = random_signs(jax.random.key(0), block_size) if signs is None else jnp.asarray(signs)
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
