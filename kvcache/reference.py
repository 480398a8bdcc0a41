"""XLA references of the paged-attention kernels (same signatures as `kvcache.kernels`), also the CPU fallback.

Shapes: T query tokens of a ragged batch (all sequences' new tokens, concatenated), B sequences, H query heads,
K KV heads (H % K == 0, G = H / K), D head dim, NB pool blocks of `bs` tokens, MB block-table width.

Pool fields (one layer): `fields[name]` is [NB, K, bs, *trailing] (see `formats.Format.fields`).
Sequence b holds `seq_lens[b]` tokens in blocks `block_tables[b, :ceil(seq_lens[b] / bs)]`; its queries are tokens
`query_start_loc[b] : query_start_loc[b + 1]` of q, the last new tokens of the sequence (their keys and values are
already in the cache): query j of a q_len-token chunk sits at position seq_lens[b] - q_len + j and attends the
positions <= its own (causal inside the chunk, everything before it).

Masked positions are excluded by selection, never by a zero weight. A sequence's gathered context also holds slots
it does not own: the unused tail of its last block, and whole blocks behind the padding columns of its block table
(a freed block of another request, or one never written). Those bytes are arbitrary and may decode to NaN or Inf
(an fp8 NaN code, a NaN scale, fp4's scale byte 0xFF = 2^128); a probability of exactly zero does not remove them,
since 0 * NaN = 0 * Inf = NaN. So the scores of positions a query may not see are set to -inf by `jnp.where`, and
the values of positions past the sequence's length to 0 by `jnp.where`, before the products that would mix them in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvcache.formats import Format

__all__ = ["decode_attention", "gather_sequences", "unified_attention", "write"]


def gather_sequences(fields: dict[str, jax.Array], block_tables: jax.Array) -> dict[str, jax.Array]:
    """Pool fields [NB, K, bs, ...] -> per sequence [B, K, MB * bs, ...], in position order."""
    out = {}
    for name, x in fields.items():
        g = x[block_tables]  # [B, MB, K, bs, ...]
        g = jnp.moveaxis(g, 2, 1)  # [B, K, MB, bs, ...]
        out[name] = g.reshape(g.shape[0], g.shape[1], -1, *g.shape[4:])
    return out


def unified_attention(
    q: jax.Array,
    fields: dict[str, jax.Array],
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    fmt: Format,
    max_query_len: int | None = None,
    sm_scale: float | None = None,
) -> jax.Array:
    """Attention of a ragged batch of query chunks over the paged cache: softmax(q k^T * sm_scale + mask) v.

    Args:
      q: [T, H, D] queries of all sequences, concatenated.
      fields: the layer's pool fields [NB, K, bs, ...].
      block_tables: [B, MB] int32; seq_lens: [B] int32 (cached tokens including the new ones, >= 1);
      query_start_loc: [B + 1] int32 cumulative query counts (query_start_loc[-1] = T).
      max_query_len: static bound on any sequence's query count (default T).
      sm_scale: score scale (default 1 / sqrt(D)).
    Returns:
      [T, H, D] float32. Keys and values are dequantised in the basis the format stores them in (at its padded head
      dim Dp: `fmt.padded_head_dim`), the query is prepared by `fmt.prepare_query` (zero padding to Dp, rotation and
      FP8 for fp4) and the output by `fmt.finish_output` (back to D columns), exactly as the kernels do; the default
      sm_scale is the model's 1 / sqrt(D), not Dp's. Positions a query may not see are excluded by selection
      (scores -inf, values of slots past `seq_lens` 0), so whatever those slots hold, NaN and Inf included, never
      reaches the output.
    """
    t, h, d = q.shape
    b = block_tables.shape[0]
    kv = gather_sequences(fields, block_tables)
    keys, values = fmt.dequantize(kv, rotated=True)  # [B, K, S, D]
    num_kv = keys.shape[1]
    max_q = t if max_query_len is None else max_query_len
    scale = d**-0.5 if sm_scale is None else sm_scale

    q_len = query_start_loc[1:] - query_start_loc[:-1]  # [B]
    j = jnp.arange(max_q)
    rows = jnp.clip(query_start_loc[:-1, None] + j[None], 0, t - 1)  # [B, max_q] token index of each query slot
    qp = fmt.prepare_query(q)  # [T, H, Dp]
    dp = qp.shape[-1]
    qb = qp[rows].reshape(b, max_q, num_kv, h // num_kv, dp)
    scores = jnp.einsum("bqkgd,bksd->bkgqs", qb, keys, precision=jax.lax.Precision.HIGHEST) * scale
    q_pos = seq_lens[:, None] - q_len[:, None] + j[None]  # [B, max_q]
    k_pos = jnp.arange(keys.shape[2])
    visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)  # selection: a NaN score becomes -inf
    probs = jax.nn.softmax(scores, axis=-1)
    owned = k_pos[None, :] < seq_lens[:, None]  # [B, S]: slots of the sequence, the rest may hold NaN / Inf
    values = jnp.where(owned[:, None, :, None], values, 0.0)  # so that 0 probability x value is 0, never NaN
    # The product's own output order (values stay [s, d] as the rhs); asking einsum for [b, q, k, g, d] made XLA:CPU
    # transpose the gathered values to [d, s] instead, the decode step's costliest op.
    out = jnp.einsum("bkgqs,bksd->bkgqd", probs, values, precision=jax.lax.Precision.HIGHEST)
    out = jnp.moveaxis(out, 3, 1).reshape(b, max_q, h, dp)
    # Each token reads its slot back: token i of sequence s is slot i - query_start_loc[s].
    seq_of = jnp.searchsorted(query_start_loc[1:], jnp.arange(t), side="right")
    return fmt.finish_output(out[seq_of, jnp.arange(t) - query_start_loc[seq_of]], d)


def decode_attention(
    q: jax.Array,
    fields: dict[str, jax.Array],
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    fmt: Format,
    sm_scale: float | None = None,
) -> jax.Array:
    """One new query token per sequence: q [B, H, D] -> [B, H, D] float32 (`unified_attention` with q_len 1)."""
    b = q.shape[0]
    return unified_attention(
        q,
        fields,
        block_tables,
        seq_lens,
        jnp.arange(b + 1, dtype=jnp.int32),
        fmt=fmt,
        max_query_len=1,
        sm_scale=sm_scale,
    )


def write(
    fields: dict[str, jax.Array], k: jax.Array, v: jax.Array, slot_mapping: jax.Array, *, fmt: Format
) -> dict[str, jax.Array]:
    """Quantise-on-write: k, v [T, K, D] (padded to the format's Dp inside `fmt.quantize`) go to flat slots
    `slot_mapping` [T] (block * bs + offset; negative = skip, e.g. padding). Returns the updated fields
    [NB, K, bs, ...]."""
    new = fmt.quantize(k, v)  # [T, K, ...]
    out = {}
    for name, x in fields.items():
        bs = x.shape[2]
        block, offset = slot_mapping // bs, slot_mapping % bs
        block = jnp.where(slot_mapping < 0, x.shape[0], block)  # out of range: dropped
        out[name] = _set_bits(x, (block, slice(None), offset), new[name])
    return out


def _set_bits(x: jax.Array, index, value: jax.Array) -> jax.Array:
    """x.at[index].set(value in x's dtype, mode="drop"), scattered as x's bits (an unsigned integer of its width):
    XLA:CPU runs a bfloat16 or float8 scatter in float32, converting the whole pool there and back per write."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x.at[index].set(value.astype(x.dtype), mode="drop")
    bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    new = jax.lax.bitcast_convert_type(value.astype(x.dtype), bits)
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, bits).at[index].set(new, mode="drop"), x.dtype)
