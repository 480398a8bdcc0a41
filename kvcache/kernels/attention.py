"""Paged attention as one Pallas kernel: split-KV decode and unified (prefill chunks + decode) attention.

Same signatures as `kvcache.reference.unified_attention` / `decode_attention`; shapes as documented there.

Grid: (B sequences, K KV heads, QT query tiles, P partitions). Program (b, h, i, p) takes TQ query tokens of
sequence b (tile i) with all G query heads of KV head h, as R = TQ * Gp rows (Gp >= G: padded with zero queries
so that R >= 16, the smallest matrix product GPU tensor cores take), and the p-th slice of the KV blocks the tile
can see (causal). It streams those blocks with an online softmax (running max m, exp-sum l, accumulator) and
writes its normalised partial output and log-sum-exp lse = m + log l. A log-sum-exp reduce over partitions
(in XLA: P x rows x D values) merges them: out = sum_p exp(lse_p - LSE) out_p with LSE = logsumexp_p lse_p.

Splitting a long context over P partitions is flash-decoding: without it one program streams a whole 128K
context alone while the rest of the GPU idles (the long-context cliff). `num_partitions` picks P from the
context and the batch.

On-chip budget: before building the kernel, its tiles' shared memory / LDS need (`budgets.triton_attention_bytes`)
is checked against the device family's (`device=`, or detected from `jax.devices()[0].device_kind`; an unknown
device is not checked). When the query tile does not fit and was not given, it is halved until it does; a tile of 1
(decode) that still does not fit raises NotImplementedError with the numbers (`budgets.check`).

Formats are decoded in the kernel, 32 head-dim columns at a time, by the format's own hooks
(`Format.kernel_groups`, `Format.kernel_token_scale`); the built-in ones:
  bf16 / fp8: the columns' values (fp8's per-token scale multiplies the scores and the probabilities);
  fp4: a 32-byte chunk of split-half packed codes gives two 32-column groups (low and high nibbles), decoded
       arithmetically (E2M1, E1M2 or INT4); the UE8M0 group scale multiplies that group's partial scores (K) or
       values (V);
  nvfp4: fp4's chunks with two E4M3 scales per group, applied to its values (no group scale);
  k8v4: K as fp8's, V as fp4's.

Masked positions are excluded by selection inside the tiles already loaded, never by a zero weight alone. A
program reads only the blocks its queries can see, but the last of them may end in slots past the sequence's length
(its unused tail), and those hold arbitrary bytes: NaN or Inf after decoding (an fp8 NaN code or scale, fp4's
scale byte 0xFF). A probability of 0 does not remove them (0 * NaN = 0 * Inf = NaN), so: scores of
invisible positions become -inf (`jnp.where`); the tail's value rows become 0 (values without a group scale:
`jnp.where` on the decoded [bs, 32] columns; with one (UE8M0): on the [bs] group scale, since 4-bit codes are always
finite); fp8's V scale
is selected the same way before it multiplies the probabilities. No extra pass over the cache: one select per
element of a tile that is already in registers.

The query comes prepared by `Format.prepare_query` (zero-padded to the stored head dim Dp for D = 80 / 96,
Hadamard-rotated and FP8-rounded for fp4), so the score product needs no rotation: H^T H = I; the kernel runs at Dp
(zero columns add nothing to a score) and `Format.finish_output` cuts the output back to D. Products accumulate in
float32 at JAX's default matmul precision: TF32 on a GPU, exact for fp4's E2M1 keys times FP8 queries, about 1e-3
relative for bf16 / fp8 queries; under
`jax.default_matmul_precision("highest")` (the GPU tests) they are IEEE float32, as in the XLA reference.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvcache.formats import GROUP, Format
from kvcache.kernels import budgets

__all__ = ["MIN_ROWS", "decode_attention", "fit_tile", "num_partitions", "shared_memory_bytes", "unified_attention"]

MIN_ROWS = 16  # rows of the query tile: tensor-core matrix products need M >= 16
TARGET_PROGRAMS = 512  # programs to aim for when splitting (about 4 per SM on an H200's 132 SMs)
MIN_BLOCKS_PER_PARTITION = 8  # do not split below 8 blocks (128 tokens at block size 16) per partition


def num_partitions(
    max_blocks: int, programs: int, *, target: int = TARGET_PROGRAMS, min_blocks: int = MIN_BLOCKS_PER_PARTITION
) -> int:
    """Partitions per (sequence, KV head, query tile): enough to give about `target` programs in all, never
    fewer than `min_blocks` blocks per partition, at least 1. `programs` = B * K * QT without splitting."""
    by_parallelism = math.ceil(target / max(programs, 1))
    by_length = max(1, max_blocks // min_blocks)
    return max(1, min(by_parallelism, by_length, max_blocks))


def shared_memory_bytes(fmt: Format, *, tile: int, groups: int, head_dim: int, block_size: int) -> int:
    """On-chip bytes of one program at query tile `tile` and GQA group size `groups` (see
    `budgets.triton_attention_bytes`; rows = tile x max(groups, ceil(MIN_ROWS / tile)), the padded query heads; the
    tiles hold the format's stored head dim `fmt.padded_head_dim(head_dim)`)."""
    rows = tile * max(groups, -(-MIN_ROWS // tile))
    return budgets.triton_attention_bytes(
        rows=rows,
        head_dim=fmt.padded_head_dim(head_dim),
        block_size=block_size,
        kv_bytes_per_token=fmt.bytes_per_token(1, head_dim),
    )


def fit_tile(
    fmt: Format, *, tile: int, groups: int, head_dim: int, block_size: int, device: str, shrink: bool = True
) -> int:
    """The largest query tile <= `tile` (halving; only `tile` itself when shrink=False) whose program fits the
    on-chip memory of `device` (a family of `budgets.BUDGETS`); NotImplementedError with the numbers of the smallest
    one tried when none does."""
    return budgets.fit_tile(
        lambda t: shared_memory_bytes(fmt, tile=t, groups=groups, head_dim=head_dim, block_size=block_size),
        tile=tile,
        device_family=device,
        shrink=shrink,
        what=lambda t: f"the Triton attention kernel (query tile {t}, D = {head_dim})",
    )


def _kernel(
    bt_ref,
    seq_lens_ref,
    qsl_ref,
    q_ref,
    *refs,
    fmt: Format,
    names: tuple[str, ...],
    head_dim: int,
    block_size: int,
    tile: int,
    heads: int,
    blocks_per_partition: int,
    sm_scale: float,
):
    fields = dict(zip(names, refs[: len(names)]))
    o_ref, lse_ref = refs[len(names) :]
    b, h, i, p = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    rows = tile * heads
    num_groups = head_dim // GROUP
    seq_len = seq_lens_ref[b]
    q_len = qsl_ref[b + 1] - qsl_ref[b]
    first_pos = seq_len - q_len + i * tile  # position of the tile's first query
    row_pos = first_pos + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // heads  # [R, 1]
    visible_len = jnp.minimum(seq_len, first_pos + tile)  # keys the tile's last query sees
    num_blocks = jnp.where(i * tile < q_len, (visible_len + block_size - 1) // block_size, 0)  # idle tail tiles
    start = p * blocks_per_partition
    stop = jnp.minimum(start + blocks_per_partition, num_blocks)
    q = [q_ref[h, b, pl.ds(i * rows, rows), pl.ds(g * GROUP, GROUP)] for g in range(num_groups)]

    def body(j, carry):
        m, l, acc = carry
        blk = bt_ref[b, j]
        scores = jnp.zeros((rows, block_size), jnp.float32)
        for g, k, scale in fmt.kernel_groups(fields, "k", blk, h, head_dim):
            part = jax.lax.dot_general(q[g], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            scores += part if scale is None else part * scale[None, :]
        k_scale = fmt.kernel_token_scale(fields, "k", blk, h)
        if k_scale is not None:
            scores *= k_scale[None, :]
        key_pos = j * block_size + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
        owned = key_pos < seq_len  # [1, bs]: the block's tail past the sequence may hold NaN / Inf
        owned_rows = (j * block_size + jax.lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)) < seq_len  # [bs, 1]
        visible = (key_pos <= row_pos) & owned
        scores = jnp.where(visible, scores * sm_scale, -jnp.inf)  # selection: a NaN score becomes -inf
        m_new = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that sees nothing yet stays at l = 0
        probs = jnp.exp(scores - m_safe)
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(probs, axis=1, keepdims=True)
        v_scale = fmt.kernel_token_scale(fields, "v", blk, h)
        if v_scale is not None:
            probs = probs * jnp.where(owned, v_scale[None, :], 0.0)
        acc = list(acc)
        for g, values, scale in fmt.kernel_groups(fields, "v", blk, h, head_dim):
            # Selection, not 0 x value: the tail's rows become 0 (via a group scale: 4-bit codes are finite).
            if scale is None:
                v = jnp.where(owned_rows, values, 0.0)
            else:
                v = values * jnp.where(owned_rows, scale[:, None], 0.0)
            acc[g] = alpha * acc[g] + jnp.dot(probs, v, preferred_element_type=jnp.float32)
        return m_new, l, tuple(acc)

    init = (
        jnp.full((rows, 1), -jnp.inf, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        tuple(jnp.zeros((rows, GROUP), jnp.float32) for _ in range(num_groups)),
    )
    m, l, acc = jax.lax.fori_loop(start, jnp.maximum(start, stop), body, init)
    empty = l == 0.0
    inv = 1.0 / jnp.where(empty, 1.0, l)
    for g in range(num_groups):
        o_ref[p, h, b, pl.ds(i * rows, rows), pl.ds(g * GROUP, GROUP)] = acc[g] * inv
    lse_ref[p, h, b, pl.ds(i * rows, rows)] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))[:, 0]


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
    partitions: int | None = None,
    tile: int | None = None,
    interpret: bool = False,
    device: str | None = None,
) -> jax.Array:
    """The Pallas kernel behind `kvcache.unified_attention` (see `kvcache.reference.unified_attention`).

    Extra args:
      partitions: KV partitions per query tile (default `num_partitions(...)`; 1 = no split-KV).
      tile: query tokens per program (default min(max_query_len, 16), rounded to a power of two).
      interpret: run the kernel in Pallas' interpreter (CPU tests).
      device: the device family whose on-chip budget the tiles must fit (`budgets.BUDGETS`; None: detected, and an
        unknown device is not checked). A default tile is halved until it fits; a given one is only checked.
    Raises: NotImplementedError when the tiles do not fit the device (the numbers in the message).
    Returns: [T, H, D] float32. Positions a query may not see, and the slots past a sequence's length, are
      excluded by selection (see the module docstring), so NaN or Inf in them never reaches the output.
    """
    t, num_heads, d = q.shape
    dp = fmt.padded_head_dim(d)  # the stored head dim: the query is padded to it, the output cut back to d
    if fmt.head_dim_of(fields) != dp:
        raise ValueError(f"q.shape = {q.shape}; allowed: a head dim the pool's {fmt.head_dim_of(fields)} columns store")
    _, num_kv, block_size = fields[fmt.key_field].shape[:3]
    batch, max_blocks = block_tables.shape
    groups = num_heads // num_kv
    max_q = t if max_query_len is None else int(max_query_len)
    family = budgets.resolve(device)
    shrink = tile is None
    tile = tile or min(16, pl.next_power_of_2(max_q))
    if family is not None:
        fit = functools.partial(fit_tile, fmt, groups=groups, head_dim=d, block_size=block_size, device=family)
        tile = fit(tile=tile, shrink=shrink)
    heads = max(groups, -(-MIN_ROWS // tile))  # Gp: padded query heads per KV head
    num_tiles = -(-max_q // tile)
    q_pad = num_tiles * tile
    parts = partitions or num_partitions(max_blocks, batch * num_kv * num_tiles)
    if not 1 <= parts <= max_blocks:
        raise ValueError(f"partitions = {parts}; allowed: 1 .. block-table width {max_blocks}")
    blocks_per_partition = -(-max_blocks // parts)

    # Queries per (KV head, sequence): [K, B, q_pad * Gp, Dp], zero rows for padding.
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    j = jnp.arange(q_pad)
    tok = query_start_loc[:-1, None] + j[None]  # [B, q_pad]
    valid = j[None] < q_len[:, None]
    qp = fmt.prepare_query(q).reshape(t, num_kv, groups, dp)[jnp.clip(tok, 0, t - 1)]  # [B, q_pad, K, G, Dp]
    qp = jnp.where(valid[:, :, None, None, None], qp, 0.0)
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, 0), (0, heads - groups), (0, 0)))
    qp = qp.transpose(2, 0, 1, 3, 4).reshape(num_kv, batch, q_pad * heads, dp)

    names = tuple(fields)
    kernel = functools.partial(
        _kernel,
        fmt=fmt,
        names=names,
        head_dim=dp,
        block_size=block_size,
        tile=tile,
        heads=heads,
        blocks_per_partition=blocks_per_partition,
        sm_scale=d**-0.5 if sm_scale is None else float(sm_scale),
    )
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((parts, num_kv, batch, q_pad * heads, dp), jnp.float32),
            jax.ShapeDtypeStruct((parts, num_kv, batch, q_pad * heads), jnp.float32),
        ),
        grid=(batch, num_kv, num_tiles, parts),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4),  # the Triton backend (not Mosaic GPU)
        name=f"paged_attention_{fmt.name}",
    )(
        block_tables.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        query_start_loc.astype(jnp.int32),
        qp,
        *(fields[n] for n in names),
    )

    # Log-sum-exp reduce over partitions; empty partitions (lse = -inf) weigh 0.
    total = jax.nn.logsumexp(lse, axis=0)
    weights = jnp.exp(lse - jnp.where(jnp.isfinite(total), total, 0.0)[None])
    merged = jnp.sum(weights[..., None] * jnp.where(jnp.isfinite(lse)[..., None], out, 0.0), axis=0)
    merged = merged.reshape(num_kv, batch, q_pad, heads, dp)[:, :, :, :groups]  # [K, B, q_pad, G, Dp]
    merged = merged.transpose(1, 2, 0, 3, 4).reshape(batch, q_pad, num_heads, dp)
    seq_of = jnp.searchsorted(query_start_loc[1:], jnp.arange(t), side="right")
    return fmt.finish_output(merged[seq_of, jnp.arange(t) - query_start_loc[seq_of]], d)


def decode_attention(
    q: jax.Array,
    fields: dict[str, jax.Array],
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    fmt: Format,
    sm_scale: float | None = None,
    partitions: int | None = None,
    interpret: bool = False,
    device: str | None = None,
) -> jax.Array:
    """Split-KV decode: one query token per sequence, q [B, H, D] -> [B, H, D] float32. Its query tile is one
    token (no smaller tile exists): tiles that do not fit `device` raise NotImplementedError (see unified_attention)."""
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
        partitions=partitions,
        tile=1,
        interpret=interpret,
        device=device,
    )
