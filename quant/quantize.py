"""Block-scaled fake quantisation: x -> the dequantised values of its 4-bit encoding (spec: ../shared/specs/ufp4.md).

  e2m1 / e1m2 / int4  blocks of `block_size` (default 16) along `axis`, FP32 scale s = amax(block) / grid max;
                      x_hat = s * round(x / s)
  mxfp4 (OCP MX)      E2M1, blocks of 32, UE8M0 scale 2^(floor(log2 amax) - 2); x / s saturates at +-6
  nvfp4 (NVIDIA)      E2M1, blocks of 16, E4M3 block scales under an FP32 tensor scale:
                      s_enc = 6 * 448 / amax(tensor), s_b = e4m3(min(amax(block) / 6 * s_enc, 448)),
                      x_hat = (s_b / s_enc) * round(x / (s_b / s_enc))
A block whose amax is 0 encodes zeros. Arithmetic in float32; the result has x's dtype and shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quant.grids import FORMATS, grid_max, round_to_grid

__all__ = ["DEFAULT_BLOCK", "block_scales", "quantize", "quantize_tiles"]

DEFAULT_BLOCK = {"e2m1": 16, "e1m2": 16, "int4": 16, "mxfp4": 32, "nvfp4": 16}
E4M3_MAX = 448.0


def _blocks(x: jax.Array, axis: int, block: int) -> tuple[jax.Array, int]:
    """(x with `axis` split in place into [n / block, block], the index of the within-block axis). No transpose:
    on CPU moving the axis last and back costs more than the quantiser."""
    x = x.reshape(1) if x.ndim == 0 else x
    axis = axis % x.ndim
    n = x.shape[axis]
    if block < 1 or n % block:
        raise ValueError(
            f"quantize: length {n} of axis {axis} (shape {x.shape}) is not divisible by block_size = "
            f"{block}; pad the axis or pick a block size that divides it."
        )
    return x.reshape(*x.shape[:axis], n // block, block, *x.shape[axis + 1 :]), axis + 1


def block_scales(blocks: jax.Array, fmt: str, axis: int = -1) -> jax.Array:
    """Per-block decode scales s (float32, `blocks`' shape with `axis`, the within-block axis, of size 1) so that
    blocks / s lies on the grid's range; 0 for a block that encodes zeros (amax 0, or an NVFP4 block scale that
    underflows E4M3)."""
    amax = jnp.max(jnp.abs(blocks), axis=axis, keepdims=True)
    if fmt == "mxfp4":
        return jnp.where(amax > 0, jnp.exp2(jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1.0))) - 2), 0.0)
    if fmt == "nvfp4":
        t = jnp.max(amax)
        s_enc = 6.0 * E4M3_MAX / jnp.where(t > 0, t, 1.0)
        stored = jnp.minimum(amax / 6.0 * s_enc, E4M3_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
        return stored / s_enc
    return amax / grid_max(fmt)


def quantize(
    x: jax.Array,
    fmt: str,
    *,
    axis: int = -1,
    block_size: int | None = None,
    rounding: str = "nearest",
    key: jax.Array | None = None,
) -> jax.Array:
    """Fake-quantises x (any float dtype and shape) in blocks along `axis`; returns x's shape and dtype.

    fmt in FORMATS; block_size defaults to DEFAULT_BLOCK[fmt]; rounding "nearest" (ties to even) or "stochastic"
    (unbiased; needs key). Raises ValueError on an unknown fmt / rounding or an axis the block does not divide.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt = {fmt!r}; allowed: {list(FORMATS)}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize: x has dtype {x.dtype}; a floating dtype is required.")
    block = DEFAULT_BLOCK[fmt] if block_size is None else block_size
    blocks, inner = _blocks(x.astype(jnp.float32), axis, block)
    scale = block_scales(blocks, fmt, inner)
    q = round_to_grid(blocks / jnp.where(scale > 0, scale, 1.0), fmt, rounding=rounding, key=key) * scale
    return q.reshape(x.shape).astype(x.dtype)


def quantize_tiles(w: jax.Array, fmt: str, *, tile: int = 16) -> jax.Array:
    """Fake-quantises the last two axes of w ([..., K, N]) in tile x tile blocks (one scale per tile: NVFP4's 2-D
    weight scaling, so that w^T is quantised identically); the last two axes are zero-padded to whole tiles for
    the scales and cropped back. Nearest rounding; w's shape and dtype."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt = {fmt!r}; allowed: {list(FORMATS)}.")
    k, n = w.shape[-2:]
    pk, pn = -k % tile, -n % tile
    x = jnp.pad(w.astype(jnp.float32), [(0, 0)] * (w.ndim - 2) + [(0, pk), (0, pn)])
    lead = x.shape[:-2]
    kt, nt = x.shape[-2] // tile, x.shape[-1] // tile
    blocks = jnp.swapaxes(x.reshape(*lead, kt, tile, nt, tile), -3, -2).reshape(*lead, kt, nt, tile * tile)
    scale = block_scales(blocks, fmt)
    q = round_to_grid(blocks / jnp.where(scale > 0, scale, 1.0), fmt) * scale
    q = jnp.swapaxes(q.reshape(*lead, kt, nt, tile, tile), -3, -2).reshape(x.shape)
    return q[..., :k, :n].astype(w.dtype)
