"""Split-KV decode in plain XLA: the kernel's algorithm (partials per partition, log-sum-exp merge) as a loop.

`reference.decode_attention` gathers a sequence's whole context, dequantises it to float32 and runs one softmax:
at 128K tokens that is several passes over hundreds of MB that no cache holds. Here the context is cut into
partitions of `blocks_per_partition` blocks; `lax.map` visits them one at a time (gather, dequantise, scores, a
local softmax: everything stays in cache) and keeps (output, lse) per partition, merged at the end:

    out = sum_p exp(lse_p - LSE) out_p,   LSE = logsumexp_p lse_p.

Partitions past a batch's longest sequence are skipped (`lax.cond`). Same signature and result as
`reference.decode_attention`; the CPU fast path (`implementation="xla_split"`).

Per partition, the keys and values are dequantised into float32 tiles [B, K, L, w] (`_tiles`), never into a copy of
the whole context. A side stored as 4-bit codes (`kvcache.codecs.Block4`: fp4, nvfp4, k8v4's values) is read from
its packed bytes once and yields two half-width tiles, the low nibbles (columns [0, Dp/2)) and the high ones
([Dp/2, Dp)) of split-half packing: each tile meets its half of the query (K; the two partial scores are added) or
gives its half of the output (V; the halves are concatenated), so the levels are never concatenated (on XLA:CPU a
copy of the largest array of the step). Each tile's decode (nibble, level, times its block's scale) is one fused
loop; E2M1 levels come from the hardware's half-precision conversion (`_e2m1_levels`), UE8M0 scales from their bits
(`_ue8m0`), both exact. Every element is its level times its scale, as the reference dequantises it; only the order
of a score's additions differs (two halves, then their sum): float32 rounding. The scores are laid out [B, K, L, G]
(tile rows against the query's few columns: the product XLA:CPU runs fastest).

Partitions default to `partition_blocks(fmt, D)` blocks: `FULL_TILE_BLOCKS` when a side is dequantised at full width,
twice that when every side comes as half-width tiles (the same float32 tile size per dot, half the loop steps).

As in the reference, positions past a sequence's length (its last block's tail, the blocks behind padding columns
of the block table, the columns padded onto the table to fill the last partition) are excluded by selection: their
scores become -inf and their values 0 by `jnp.where` (for a 4-bit side, their block scales: every level is finite).
Those slots may hold NaN or Inf, and a zero probability times NaN or Inf is NaN, so multiplying by the zero
probability alone would not exclude them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from core import lowbit
from kvcache.codecs import Block4
from kvcache.formats import Format

__all__ = ["FULL_TILE_BLOCKS", "decode_attention", "partition_blocks"]

FULL_TILE_BLOCKS = 64  # 1,024 tokens at block size 16: a partition's float32 K/V tiles stay in a CPU's L2/L3
_HIGHEST = jax.lax.Precision.HIGHEST


def partition_blocks(fmt: Format, head_dim: int) -> int:
    """Blocks per partition for heads of `head_dim`: `FULL_TILE_BLOCKS`, doubled when both sides are 4-bit codes
    (dequantised as half-width tiles, so a partition twice as long has tiles of the same size)."""
    fmt.check_head_dim(head_dim)
    half_width = all(isinstance(codec, Block4) for codec in fmt.codecs())
    return 2 * FULL_TILE_BLOCKS if half_width else FULL_TILE_BLOCKS


def _e2m1_levels(nibbles: jax.Array) -> jax.Array:
    """E2M1 levels (float32) of 4-bit codes 0..15 (uint8): `core.lowbit.decode_e2m1`, exactly. The code's magnitude
    bits (e1 e0 m) placed as a float16's two lowest exponent bits and top mantissa bit, with the sign in bit 15, are
    the level times 2^-14 (e = 0: the subnormal 0 or 2^-15); the conversion to float32 is exact, subnormals included
    (no flushing: it is a conversion, not arithmetic), and so is the product by 2^14."""
    n = nibbles.astype(jnp.uint16)
    half = jax.lax.bitcast_convert_type(((n & 7) << 9) | ((n & 8) << 12), jnp.float16)
    return half.astype(jnp.float32) * jnp.float32(2.0**14)


def _ue8m0(scale: jax.Array) -> jax.Array:
    """`kvcache.codecs.scale_value` of UE8M0 bytes, from their bits: 2^(s - 127) is s in the float32 exponent field,
    s = 0 the subnormal 2^-127, s = 255 nan. A shift and two selects (cheap where fused per element)."""
    s = scale.astype(jnp.int32)
    bits = jnp.where(s == 0, 1 << 22, s << 23)
    return jnp.where(s == 255, jnp.float32(jnp.nan), jax.lax.bitcast_convert_type(bits, jnp.float32))


def _tiles(fmt: Format, kv: dict[str, jax.Array], prefix: str, keep: jax.Array | None) -> list[jax.Array]:
    """Side `prefix` ("k" / "v") of a partition's fields [B, K, L, ...] -> float32 tiles [B, K, L, w] that, side by
    side, are `fmt.dequantize(kv, rotated=True)`'s rows [B, K, L, Dp]: the whole row, or for a 4-bit side its two
    halves (w = Dp / 2). With `keep` [B, L], the rows of positions it marks False are 0 whatever their slots hold."""
    codec = fmt.codec(prefix)
    if not isinstance(codec, Block4):
        rows = codec.decode(kv, prefix)
        return [rows if keep is None else jnp.where(keep[:, None, :, None], rows, 0.0)]
    codes, scales = kv[prefix + "_codes"], kv[prefix + "_scales"]  # [B, K, L, Dp/2], [B, K, L, Dp/block]
    scales = _ue8m0(scales) if codec.scale == "ue8m0" else scales.astype(jnp.float32)
    if keep is not None:  # every level is finite: a zero scale zeroes the row
        scales = jnp.where(keep[:, None, :, None], scales, 0.0)
    per_half = scales.shape[-1] // 2  # split-half packing: byte j holds column j (low) and j + Dp/2 (high)
    tiles = []
    for n, nibbles in enumerate((codes & 15, codes >> 4)):
        levels = _e2m1_levels(nibbles) if codec.grid == "e2m1" else lowbit.decode_code(nibbles, codec.grid)
        levels = levels.reshape(*codes.shape[:-1], per_half, codec.block)
        tiles.append((levels * scales[..., n * per_half : (n + 1) * per_half, None]).reshape(codes.shape))
    return tiles


def decode_attention(
    q: jax.Array,
    fields: dict[str, jax.Array],
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    fmt: Format,
    sm_scale: float | None = None,
    blocks_per_partition: int | None = None,
) -> jax.Array:
    """q [B, H, D] -> [B, H, D] float32; see `reference.decode_attention`.

    out = sum_p exp(lse_p - LSE) out_p over partitions p of `blocks_per_partition` blocks (None: `partition_blocks`;
    at most the table's width), where out_p and lse_p are the softmax-weighted values and the log-sum-exp of the
    scores q k^T * sm_scale of the partition's positions below `seq_lens` (the others are excluded by selection), at
    the format's padded head dim Dp (zero columns add nothing to a score), cut back to D by `fmt.finish_output`;
    sm_scale defaults to 1 / sqrt(D). Equals the reference up to float32 rounding (the order of additions).
    """
    b, h, d = q.shape
    num_kv, block_size = next(iter(fields.values())).shape[1:3]
    groups = h // num_kv
    scale = d**-0.5 if sm_scale is None else sm_scale
    per = partition_blocks(fmt, d) if blocks_per_partition is None else blocks_per_partition
    per = min(per, block_tables.shape[1])
    parts = -(-block_tables.shape[1] // per)
    tables = jnp.pad(block_tables, ((0, 0), (0, parts * per - block_tables.shape[1])))
    tables = tables.reshape(b, parts, per).transpose(1, 0, 2)  # [P, B, per]
    qk = fmt.prepare_query(q)  # [B, H, Dp]: padded with zeros to the stored head dim, rotated like K
    dp = qk.shape[-1]
    qk = qk.reshape(b, num_kv, groups, dp)
    longest = jnp.max(seq_lens)

    def partial(p, table):
        def compute(_):
            kv = {n: jnp.moveaxis(x[table], 2, 1) for n, x in fields.items()}  # [B, K, per, bs, ...]
            kv = {n: x.reshape(b, num_kv, per * block_size, *x.shape[4:]) for n, x in kv.items()}
            pos = p * per * block_size + jnp.arange(per * block_size)
            owned = pos[None, :] < seq_lens[:, None]  # [B, L]: the other slots may hold NaN / Inf
            s, start = jnp.float32(0.0), 0
            for keys in _tiles(fmt, kv, "k", None):  # [B, K, L, w]: against the query's columns [start, start + w)
                s = s + jnp.einsum("bkld,bkgd->bklg", keys, qk[..., start : start + keys.shape[-1]], precision=_HIGHEST)
                start += keys.shape[-1]
            s = jnp.where(owned[:, None, :, None], s * scale, -jnp.inf)  # [B, K, L, G]
            m = jnp.max(s, axis=2)
            m_safe = jnp.where(jnp.isfinite(m), m, 0.0)  # [B, K, G]
            e = jnp.exp(s - m_safe[:, :, None])
            l = jnp.sum(e, axis=2)
            l_safe = jnp.where(l > 0, l, 1.0)
            halves = [  # values selected: 0 x NaN would be NaN
                jnp.einsum("bklg,bkld->bkgd", e, values, precision=_HIGHEST) for values in _tiles(fmt, kv, "v", owned)
            ]
            out = jnp.concatenate(halves, axis=-1) if len(halves) > 1 else halves[0]
            return out / l_safe[..., None], jnp.where(l > 0, m_safe + jnp.log(l_safe), -jnp.inf)

        def skip(_):
            return jnp.zeros((b, num_kv, groups, dp), jnp.float32), jnp.full((b, num_kv, groups), -jnp.inf)

        return jax.lax.cond(p * per * block_size < longest, compute, skip, None)

    outs, lse = jax.lax.map(lambda args: partial(*args), (jnp.arange(parts), tables))
    total = jax.nn.logsumexp(lse, axis=0)
    weights = jnp.exp(lse - jnp.where(jnp.isfinite(total), total, 0.0))
    out = jnp.sum(weights[..., None] * outs, axis=0)  # [B, K, G, D]
    return fmt.finish_output(out.reshape(b, h, dp), d)
