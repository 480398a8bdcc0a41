"""Quantise-and-write as a Pallas kernel: new tokens' keys and values go into their paged-cache slots.

Same signature as `kvcache.reference.write`. Grid: (T tokens, K KV heads); program (t, h) reads token t's K and V
rows of head h, quantises them in the format's stored form and stores them at slot `slot_mapping[t]` = block * bs +
offset of the pool (updated in place: the pool fields are aliased to the outputs). Negative slots are skipped.

fp4 (per 32-column group: UE8M0 scale by the format's rule, then E2M1 codes, ties to the even code, split-half
packing: chunk c's bytes hold group c in the low and group c + D/64 in the high nibble). K's Hadamard rotation (and
V's, if the format rotates it) is one [T, D] x [D, D] product in XLA before the kernel. fp8: one float32 scale
absmax / 448 per token and head. The element numerics (E2M1 codes, exact powers of two, E4M3 casts) are core.lowbit's,
the same functions the XLA reference uses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from core.lowbit import E4M3_MAX, cast_e4m3, encode_e2m1, pow2
from kvcache.formats import GROUP, Format, ue8m0_exponent

__all__ = ["write"]


def _kernel(slots_ref, k_ref, v_ref, *refs, fmt: Format, names: tuple[str, ...], head_dim: int, block_size: int):
    outs = dict(zip(names, refs[len(names) :]))  # refs[:len(names)] are the aliased inputs
    t, h = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[t]

    @pl.when(slot >= 0)
    def _():
        blk, off = slot // block_size, slot % block_size
        for prefix, src in (("k", k_ref), ("v", v_ref)):
            row = src[pl.ds(t, 1), h, :].astype(jnp.float32)  # [1, D]
            if fmt.name == "bf16":
                outs[prefix][blk, h, pl.ds(off, 1), :] = row.astype(jnp.bfloat16)
            elif fmt.name == "fp8":
                absmax = jnp.max(jnp.abs(row))
                scale = jnp.where(absmax > 0, absmax / E4M3_MAX, 1.0)
                outs[prefix][blk, h, pl.ds(off, 1), :] = cast_e4m3(row / scale)
                outs[prefix + "_scale"][blk, h, pl.ds(off, 1)] = jnp.reshape(scale, (1,))
            else:
                half = head_dim // (2 * GROUP)
                codes, scales = [], []
                for g in range(head_dim // GROUP):
                    group = src[pl.ds(t, 1), h, pl.ds(g * GROUP, GROUP)].astype(jnp.float32)
                    e = ue8m0_exponent(jnp.max(jnp.abs(group)), fmt.scale_rule)
                    codes.append(encode_e2m1(group * pow2(-e)))
                    scales.append(e + 127)
                for c in range(half):
                    packed = (codes[c] | (codes[c + half] << 4)).astype(jnp.uint8)
                    outs[prefix + "_codes"][blk, h, pl.ds(off, 1), pl.ds(c * GROUP, GROUP)] = packed
                for g, s in enumerate(scales):
                    outs[prefix + "_scales"][blk, h, pl.ds(off, 1), pl.ds(g, 1)] = jnp.reshape(s, (1, 1)).astype(
                        jnp.uint8
                    )


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
    t, num_kv, d = k.shape
    fmt.check_head_dim(d)

    def rotate(x, rot):
        return (
            x
            if rot is None
            else jnp.einsum("tkd,de->tke", x.astype(jnp.float32), jnp.asarray(rot), precision=jax.lax.Precision.HIGHEST)
        )

    k, v = rotate(k, fmt.rotation(d)), rotate(v, fmt.value_rotation(d))
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
