"""Quantise-and-write as a Pallas kernel: new tokens' keys and values go into their paged-cache slots.

Same signature as `kvcache.reference.write`. Grid: (T tokens, K KV heads); program (t, h) reads token t's K and V
rows of head h, quantises them in the format's stored form and stores them at slot `slot_mapping[t]` = block * bs +
offset of the pool (updated in place: the pool fields are aliased to the outputs). Negative slots are skipped.
What a token row becomes is the format's `Format.kernel_write`; the built-in ones:

fp4 (per 32-column group: UE8M0 scale by the format's rule, then 4-bit codes on its grid, ties to the even code,
split-half packing: chunk c's bytes hold group c in the low and group c + D/64 in the high nibble); nvfp4 (the same
codes and packing, an E4M3 scale per 16 columns by "max" or "4 over 6"). K's Hadamard rotation (and V's, if the
format rotates it) is one [T, Dp] x [Dp, Dp] product in XLA before the kernel, after the zero padding of a head dim
the format pads (80, 96: `Format.padded_head_dim`); the kernel writes Dp columns. fp8 (and k8v4's K): one float32 scale
absmax / 448 per token and head. The element numerics (E2M1 codes, exact powers of two, E4M3 casts) are core.lowbit's,
the same functions the XLA reference uses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvcache.formats import Format

__all__ = ["write"]


def _kernel(slots_ref, k_ref, v_ref, *refs, fmt: Format, names: tuple[str, ...], head_dim: int, block_size: int):
    outs = dict(zip(names, refs[len(names) :]))  # refs[:len(names)] are the aliased inputs
    t, h = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[t]

    @pl.when(slot >= 0)
    def _():
        blk, off = slot // block_size, slot % block_size
        for prefix, src in (("k", k_ref), ("v", v_ref)):

            def row(start=0, size=None, src=src):
                columns = slice(None) if size is None else pl.ds(start, size)
                return src[pl.ds(t, 1), h, columns].astype(jnp.float32)  # [1, D] or [1, size]

            fmt.kernel_write(outs, prefix, row, blk, h, off, head_dim)


def write(
    fields: dict[str, jax.Array],
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    fmt: Format,
    interpret: bool = False,
) -> dict[str, jax.Array]:
    """Quantise-on-write kernel: k, v [T, K, D] -> updated pool fields [NB, K, bs, ...] (see reference.write)."""
    t, num_kv, _ = k.shape
    k, v = fmt.stored_rows(k, v)  # [T, K, Dp] float32: zero-padded to the stored head dim, rotated as stored
    d = k.shape[-1]
    names = tuple(fields)
    block_size = fields[names[0]].shape[2]
    kernel = functools.partial(_kernel, fmt=fmt, names=names, head_dim=d, block_size=block_size)
    out = pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(fields[n].shape, fields[n].dtype) for n in names),
        grid=(t, num_kv),
        input_output_aliases={3 + i: i for i in range(len(names))},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4),  # the Triton backend (not Mosaic GPU)
        name=f"kv_write_{fmt.name}",
    )(slot_mapping.astype(jnp.int32), k, v, *(fields[n] for n in names))
    return dict(zip(names, out))
