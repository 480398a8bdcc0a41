"""Quantise-and-write as a Mosaic TPU Pallas kernel: new tokens' keys and values go into their paged-cache slots.

Same signature and result as `kvcache.reference.write` (bit for bit), plus `interpret`. The rows are padded to the
stored head dim Dp and rotated as the format stores them in XLA (`Format.stored_rows`: one [T, Dp] x [Dp, Dp]
product); the kernel quantises them and stores each token at slot `slot_mapping[t]` = block * bs + offset of the pool,
updated in place (the pool fields are aliased to the outputs). Negative slots are skipped.

Grid: (T tokens,), "arbitrary" (programs run in order: the outputs alias the pool, which every program may write).
Memory: `slot_mapping` is scalar-prefetched into SMEM (`pltpu.PrefetchScalarGridSpec`); program t gets token t's K and
V rows [K, Dp] float32 as VMEM blocks; the pool fields stay in HBM (`memory_space=pl.ANY`). Per field a VMEM scratch
holds one token of every KV head, [1, K, 1, *trailing] (the pool's layout with one block of one slot), so the
format's own hooks (`Format.kernel_write`, the same ones the Triton write kernel runs) encode each head h into it
with block 0, offset 0; then one DMA per field (`pltpu.make_async_copy`, started for all fields, then waited on)
copies it to [block, :, offset] of the pool. Every byte of the scratch is written before its DMA starts (each hook
stores a head's whole row and its scales), so the NaN-filled scratch of interpret mode never reaches the pool.

`interpret`: as in `kvcache.kernels.tpu_attention` (`interpret_params`): None runs compiled on a TPU backend and
elsewhere in TPU interpret mode with the race detector on and NaN-filled scratch; True always interprets so; False
always compiles (on a CPU this still lowers, for `jax.jit(...).lower(lowering_platforms=("tpu",))`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvcache.formats import Format
from kvcache.kernels.tpu_attention import interpret_params

__all__ = ["write"]


def _kernel(
    slots_ref, k_ref, v_ref, *refs, fmt: Format, names: tuple[str, ...], num_kv: int, head_dim: int, block_size: int
):
    n = len(names)
    outs = refs[n : 2 * n]  # refs[:n] are the aliased inputs (the same HBM buffers)
    bufs = dict(zip(names, refs[2 * n : 3 * n]))
    sems = refs[3 * n]
    slot = slots_ref[pl.program_id(0)]

    @pl.when(slot >= 0)
    def _():
        blk, off = jax.lax.div(slot, block_size), jax.lax.rem(slot, block_size)  # slot >= 0 (jnp // lowers via sign)
        for h in range(num_kv):
            for prefix, src in (("k", k_ref), ("v", v_ref)):

                def row(start=0, size=None, src=src, h=h):
                    columns = slice(None) if size is None else pl.ds(start, size)
                    return src[pl.ds(h, 1), columns]  # [1, Dp] or [1, size] float32

                fmt.kernel_write(bufs, prefix, row, 0, h, 0, head_dim)
        copies = [
            pltpu.make_async_copy(bufs[name].at[0], out.at[blk, :, pl.ds(off, 1)], sems.at[f])
            for f, (name, out) in enumerate(zip(names, outs))
        ]
        for c in copies:
            c.start()
        for c in copies:
            c.wait()


def write(
    fields: dict[str, jax.Array],
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    fmt: Format,
    interpret: bool | None = None,
) -> dict[str, jax.Array]:
    """Quantise-on-write: k, v [T, K, D] -> the updated pool fields [NB, K, bs, ...], equal bit for bit to
    `kvcache.reference.write` (slots block * bs + offset, negative = skip). `interpret`: the module docstring."""
    t, num_kv, _ = k.shape
    k, v = fmt.stored_rows(k, v)  # [T, K, Dp] float32: zero-padded to the stored head dim, rotated as stored
    dp = k.shape[-1]
    names = tuple(fields)
    block_size = fields[names[0]].shape[2]
    kernel = functools.partial(_kernel, fmt=fmt, names=names, num_kv=num_kv, head_dim=dp, block_size=block_size)
    row_spec = pl.BlockSpec((None, num_kv, dp), lambda i, slots: (i, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(t,),
        in_specs=[row_spec, row_spec] + [pl.BlockSpec(memory_space=pl.ANY) for _ in names],
        out_specs=[pl.BlockSpec(memory_space=pl.ANY) for _ in names],
        scratch_shapes=[pltpu.VMEM((1, num_kv, 1, *fields[n].shape[3:]), fields[n].dtype) for n in names]
        + [pltpu.SemaphoreType.DMA((len(names),))],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=tuple(jax.ShapeDtypeStruct(fields[n].shape, fields[n].dtype) for n in names),
        input_output_aliases={3 + i: i for i in range(len(names))},  # (slot_mapping, k, v, *fields)
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret_params(interpret),
        name=f"tpu_kv_write_{fmt.name}",
    )(slot_mapping.astype(jnp.int32), k, v, *(fields[n] for n in names))
    return dict(zip(names, out))
