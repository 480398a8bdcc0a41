"""Split-KV decode in plain XLA: the kernel's algorithm (partials per partition, log-sum-exp merge) as a loop.

`reference.decode_attention` gathers a sequence's whole context, dequantises it to float32 and runs one softmax:
at 128K tokens that is several passes over hundreds of MB that no cache holds. Here the context is cut into
partitions of `blocks_per_partition` blocks; `lax.map` visits them one at a time (gather, dequantise, scores, a
local softmax: everything stays in cache) and keeps (output, lse) per partition, merged at the end:

    out = sum_p exp(lse_p - LSE) out_p,   LSE = logsumexp_p lse_p.

Partitions past a batch's longest sequence are skipped (`lax.cond`). Same signature and result as
`reference.decode_attention`; the CPU fast path (`implementation="xla_split"`).

As in the reference, positions past a sequence's length (its last block's tail, the blocks behind padding columns
of the block table, the columns padded onto the table to fill the last partition) are excluded by selection: their
scores become -inf and their values 0 by `jnp.where`. Those slots may hold NaN or Inf, and a zero probability times
NaN or Inf is NaN, so multiplying by the zero probability alone would not exclude them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvcache.formats import Format

__all__ = ["BLOCKS_PER_PARTITION", "decode_attention"]

BLOCKS_PER_PARTITION = 64  # 1,024 tokens at block size 16: one partition's float32 K/V fit in a CPU's L2/L3


def decode_attention(
    q: jax.Array,
    fields: dict[str, jax.Array],
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    fmt: Format,
    sm_scale: float | None = None,
    blocks_per_partition: int = BLOCKS_PER_PARTITION,
) -> jax.Array:
    """q [B, H, D] -> [B, H, D] float32; see `reference.decode_attention`.

    out = sum_p exp(lse_p - LSE) out_p over partitions p of `blocks_per_partition` blocks, where out_p and lse_p are
    the softmax-weighted values and the log-sum-exp of the scores q k^T * sm_scale of the partition's positions
    below `seq_lens` (the others are excluded by selection), at the format's padded head dim Dp (zero columns add
    nothing to a score), cut back to D by `fmt.finish_output`; sm_scale defaults to 1 / sqrt(D).
    """
    b, h, d = q.shape
    num_kv, block_size = next(iter(fields.values())).shape[1:3]
    groups = h // num_kv
    scale = d**-0.5 if sm_scale is None else sm_scale
    per = min(blocks_per_partition, block_tables.shape[1])
    parts = -(-block_tables.shape[1] // per)
    tables = jnp.pad(block_tables, ((0, 0), (0, parts * per - block_tables.shape[1])))
    tables = tables.reshape(b, parts, per).transpose(1, 0, 2)  # [P, B, per]
    qk = fmt.prepare_query(q)  # [B, H, Dp]: padded with zeros to the stored head dim
    dp = qk.shape[-1]
    qk = qk.reshape(b, num_kv, groups, dp)
    longest = jnp.max(seq_lens)

    def partial(p, table):
        def compute(_):
            kv = {n: jnp.moveaxis(x[table], 2, 1) for n, x in fields.items()}  # [B, K, per, bs, ...]
            kv = {n: x.reshape(b, num_kv, per * block_size, *x.shape[4:]) for n, x in kv.items()}
            keys, values = fmt.dequantize(kv, rotated=True)  # [B, K, L, D]
            s = jnp.einsum("bkgd,bkld->bkgl", qk, keys, precision=jax.lax.Precision.HIGHEST) * scale
            pos = p * per * block_size + jnp.arange(per * block_size)
            owned = pos[None, :] < seq_lens[:, None]  # [B, L]: the other slots may hold NaN / Inf
            s = jnp.where(owned[:, None, None], s, -jnp.inf)
            values = jnp.where(owned[:, None, :, None], values, 0.0)  # selection: 0 x NaN would be NaN
            m = jnp.max(s, axis=-1, keepdims=True)
            m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
            e = jnp.exp(s - m_safe)
            l = jnp.sum(e, axis=-1, keepdims=True)
            out = jnp.einsum("bkgl,bkld->bkgd", e, values, precision=jax.lax.Precision.HIGHEST)
            out = out / jnp.where(l > 0, l, 1.0)
            return out, jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)[..., 0]

        def skip(_):
            return jnp.zeros((b, num_kv, groups, dp), jnp.float32), jnp.full((b, num_kv, groups), -jnp.inf)

        return jax.lax.cond(p * per * block_size < longest, compute, skip, None)

    outs, lse = jax.lax.map(lambda args: partial(*args), (jnp.arange(parts), tables))
    total = jax.nn.logsumexp(lse, axis=0)
    weights = jnp.exp(lse - jnp.where(jnp.isfinite(total), total, 0.0))
    out = jnp.sum(weights[..., None] * outs, axis=0)  # [B, K, G, D]
    return fmt.finish_output(out.reshape(b, h, dp), d)
