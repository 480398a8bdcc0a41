"""Paged attention as one Mosaic TPU Pallas kernel: split-KV decode and unified (prefill chunks + decode) attention.

Same signatures, semantics and results as `kvcache.reference.decode_attention` / `unified_attention` (shapes are
documented there), plus `partitions` and `interpret`.

Grid: (B sequences, K KV heads, QT query tiles, P partitions), every dimension parallel (each program is
self-contained). Program (b, h, i, p) takes TQ query tokens of sequence b (tile i) with the G query heads of KV head
h, as R = TQ * Gp rows: the query heads are padded with zero queries to Gp >= G so that R is a multiple of 8 (a
float32 tile on a TPU is 8 sublanes x 128 lanes; decode, TQ = 1, pads G to a multiple of 8). The head dim D is not
padded: the query and output blocks span the whole D (a block equal to the array's dimension is legal at any size),
and K/V are decoded 32 columns at a time anyway. Padded rows are dropped after the kernel.

Memory: the block table (flattened to [B * MB]), `seq_lens` and `query_start_loc` are scalar-prefetched into SMEM
(`pltpu.PrefetchScalarGridSpec`); the pool fields stay in HBM (`memory_space=pl.ANY`). A program visits the KV blocks
of its partition that its queries can see (causal), copying each field's page [bs, ...] of (block, KV head) into
a double-buffered VMEM scratch by async DMAs (`pltpu.make_async_copy`): block j + 1 is fetched while block j is
computed. Blocks past the visible length, padding columns of the block table included, are never fetched.

Decoding in VMEM: the scratch buffers have the pool's layout [2 slots, 1 head, bs, ...], so the formats' own kernel
hooks (`Format.kernel_groups`, `Format.kernel_token_scale`) read them with block = slot and head = 0: bf16 and fp8
columns, fp8's per-token scale, fp4's split-half packed codes decoded arithmetically under UE8M0 group scales,
nvfp4's E4M3 per-16 scales, k8v4's mix. Online softmax in float32 (running max m, exp-sum l, accumulator);
each program writes its normalised partial output and log-sum-exp lse = m + log l, and a log-sum-exp reduce over
partitions (in XLA) merges them: out = sum_p exp(lse_p - LSE) out_p, LSE = logsumexp_p lse_p.

Masked positions are excluded by selection, never by a zero weight alone: the last fetched block may end in slots
past the sequence (its unused tail), whose bytes may decode to NaN or Inf (0 * NaN = NaN). Scores of positions a
query may not see become -inf by `jnp.where`; the tail's value rows become 0 by `jnp.where` (on the decoded [bs, 32]
columns, or on the UE8M0 group scale, since 4-bit codes are always finite); fp8's V scale is selected the same way
before it multiplies the probabilities.

The query is prepared by `Format.prepare_query` (zero-padded to the stored head dim Dp for D = 80 / 96,
Hadamard-rotated and FP8-rounded for fp4) and the output finished by `Format.finish_output` (cut back to D), as in the
reference. Matrix products ask for float32 contraction precision (HIGHEST).

`interpret`: None runs the kernel compiled on a TPU backend and, elsewhere, in TPU interpret mode with the race
detector on and uninitialised memory (scratch) filled with NaN (`interpret_params`); True always interprets so;
False always compiles (on a CPU this still lowers, e.g. for `jax.jit(...).lower(lowering_platforms=("tpu",))`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvcache.formats import GROUP, Format
from kvcache.kernels import budgets

__all__ = ["SUBLANES", "decode_attention", "fit_tile", "interpret_params", "unified_attention", "vmem_bytes"]

SUBLANES = 8  # rows of a float32 TPU tile: R = TQ * Gp is padded to a multiple of it
MAX_TILE = 16  # query tokens per program of the unified kernel


def interpret_params(interpret: bool | None):
    """What `pallas_call(interpret=...)` gets: False (compiled) for False, or None on a TPU backend; otherwise
    `pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")` (TPU interpret mode on the host, with
    the happens-before race detector and NaN-filled scratch)."""
    if interpret is False or (interpret is None and jax.default_backend() == "tpu"):
        return False
    return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


def vmem_bytes(fmt: Format, *, rows: int, head_dim: int, block_size: int) -> int:
    """VMEM one program of the kernel holds (a model, monotone in every size; compare with the chip's scoped VMEM,
    kvcache.kernels.budgets), with R = query rows (tile tokens x padded query heads), D (the format's stored head
    dim `fmt.padded_head_dim(head_dim)`: 128 for fp4 at head_dim 80 or 96), bs:
        query block     2 * R * D * 4          (float32, double-buffered by the Pallas pipeline)
        output blocks   2 * R * (D + 128) * 4  (partial output and lse, whose last dim pads to 128 lanes)
        KV pages        2 * bs * kv            (the DMA double buffer; kv = the format's bytes per token and head)
        live values     R * (D + bs + 2) * 4 + 2 * bs * GROUP * 4   (accumulators, m, l, scores; a decoded K and V
                                                                       group)
    e.g. fp4, R = 8, D = 128, bs = 16: 8,192 + 16,384 + 4,352 + 4,672 + 4,096 = 37,696 B.
    Raises ValueError naming a size below 1."""
    for name, value in (("rows", rows), ("head_dim", head_dim), ("block_size", block_size)):
        if value < 1:
            raise ValueError(f"{name} = {value}; must be >= 1")
    pages = 2 * block_size * fmt.bytes_per_token(1, head_dim)
    head_dim = fmt.padded_head_dim(head_dim)  # the tiles hold the stored head dim
    live = rows * (head_dim + block_size + 2) * 4 + 2 * block_size * GROUP * 4
    return 2 * rows * head_dim * 4 + 2 * rows * (head_dim + 128) * 4 + pages + live


def _rows(tile: int, groups: int) -> tuple[int, int]:
    """(Gp, R): the query heads per KV head padded so that R = tile * Gp is a multiple of 8 sublanes, and R."""
    multiple = SUBLANES // math.gcd(SUBLANES, tile)
    heads = -(-groups // multiple) * multiple
    return heads, tile * heads


def fit_tile(
    fmt: Format, *, tile: int, groups: int, head_dim: int, block_size: int, device: str, shrink: bool = True
) -> tuple[int, int | None]:
    """(query tile, VMEM limit or None) for a TPU of family `device` (a "tpu_*" of `budgets.BUDGETS`): the largest
    tile <= `tile` (halving; only `tile` when shrink=False) whose `vmem_bytes` fit the chip's scoped default;
    when even the smallest does not, the chip's physical VMEM as the limit to compile with if it fits there, else
    NotImplementedError with the numbers (also for a family that is not a TPU)."""
    if not device.startswith("tpu"):  # a refusal (kvcache.attention then runs the next implementation)
        tpus = [f for f in budgets.BUDGETS if f.startswith("tpu")]
        raise NotImplementedError(f"the TPU attention kernel runs on a TPU: device = {device!r}; allowed: {tpus}")

    def need(t):
        return vmem_bytes(fmt, rows=_rows(t, groups)[1], head_dim=head_dim, block_size=block_size)

    tile = budgets.fit_tile(
        need,
        tile=tile,
        device_family=device,
        shrink=shrink,
        what=lambda t: f"the TPU attention kernel (query tile {t}, D = {head_dim})",
        raisable=True,
    )
    budget = budgets.BUDGETS[device]
    return tile, (budget.physical if need(tile) > budget.bytes else None)


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
    max_blocks: int,
    tile: int,
    heads: int,
    blocks_per_partition: int,
    sm_scale: float,
):
    n = len(names)
    hbm = refs[:n]
    o_ref, lse_ref = refs[n : n + 2]
    bufs = dict(zip(names, refs[n + 2 : 2 * n + 2]))
    sems = refs[2 * n + 2]
    b, h, i, p = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    rows = tile * heads
    num_groups = head_dim // GROUP
    seq_len = seq_lens_ref[b]
    q_len = qsl_ref[b + 1] - qsl_ref[b]
    first_pos = seq_len - q_len + i * tile  # position of the tile's first query
    row_pos = first_pos + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), heads)  # [R, 1]
    visible_len = jnp.minimum(seq_len, first_pos + tile)  # keys the tile's last query sees
    num_blocks = jnp.where(i * tile < q_len, jax.lax.div(visible_len + block_size - 1, block_size), 0)  # idle tiles
    start = p * blocks_per_partition
    stop = jnp.maximum(start, jnp.minimum(start + blocks_per_partition, num_blocks))

    def copies(j, slot):
        blk = bt_ref[b * max_blocks + j]
        return [
            pltpu.make_async_copy(src.at[blk, h], bufs[name].at[slot, 0], sems.at[slot, f])
            for f, (name, src) in enumerate(zip(names, hbm))
        ]

    @pl.when(start < stop)
    def _():
        for c in copies(start, 0):
            c.start()

    q = q_ref[...]
    qg = [q[:, g * GROUP : (g + 1) * GROUP] for g in range(num_groups)]
    hi = jax.lax.Precision.HIGHEST

    def body(j, carry):
        m, l, acc = carry
        slot = jax.lax.rem(j - start, 2)
        for c in copies(j, slot):
            c.wait()

        @pl.when(j + 1 < stop)
        def _():
            for c in copies(j + 1, 1 - slot):
                c.start()

        scores = jnp.zeros((rows, block_size), jnp.float32)
        for g, k, scale in fmt.kernel_groups(bufs, "k", slot, 0, head_dim):
            part = jax.lax.dot_general(
                qg[g], k, (((1,), (1,)), ((), ())), precision=hi, preferred_element_type=jnp.float32
            )
            scores += part if scale is None else part * scale[None, :]
        k_scale = fmt.kernel_token_scale(bufs, "k", slot, 0)
        if k_scale is not None:
            scores *= k_scale[None, :]
        key_pos = j * block_size + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
        owned = key_pos < seq_len  # [1, bs]: the block's tail past the sequence may hold NaN / Inf
        owned_rows = (j * block_size + jax.lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)) < seq_len
        visible = (key_pos <= row_pos) & owned
        scores = jnp.where(visible, scores * sm_scale, -jnp.inf)  # selection: a NaN score becomes -inf
        m_new = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that sees nothing yet stays at l = 0
        probs = jnp.exp(scores - m_safe)
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(probs, axis=1, keepdims=True)
        v_scale = fmt.kernel_token_scale(bufs, "v", slot, 0)
        if v_scale is not None:
            probs = probs * jnp.where(owned, v_scale[None, :], 0.0)
        acc = list(acc)
        for g, values, scale in fmt.kernel_groups(bufs, "v", slot, 0, head_dim):
            # Selection, not 0 x value: the tail's rows become 0 (via a group scale: 4-bit codes are finite).
            if scale is None:
                v = jnp.where(owned_rows, values, 0.0)
            else:
                v = values * jnp.where(owned_rows, scale[:, None], 0.0)
            acc[g] = alpha * acc[g] + jnp.dot(probs, v, precision=hi, preferred_element_type=jnp.float32)
        return m_new, l, tuple(acc)

    init = (
        jnp.full((rows, 1), -jnp.inf, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        tuple(jnp.zeros((rows, GROUP), jnp.float32) for _ in range(num_groups)),
    )
    m, l, acc = jax.lax.fori_loop(start, stop, body, init)
    empty = l == 0.0
    inv = 1.0 / jnp.where(empty, 1.0, l)
    for g in range(num_groups):
        o_ref[:, g * GROUP : (g + 1) * GROUP] = acc[g] * inv
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


def _check(q, fields, block_tables, seq_lens, fmt: Format, partitions: int | None) -> None:
    """ValueErrors naming the argument, its value and what is allowed."""
    if q.ndim != 3:
        raise ValueError(f"q.shape = {q.shape}; allowed: [T, H, D]")
    if fmt.key_field not in fields:
        raise ValueError(f"fields = {sorted(fields)}; format {fmt.label} stores its keys in {fmt.key_field!r}")
    needed = fmt.fields(fields[fmt.key_field].shape[1], fmt.head_dim_of(fields))
    if set(fields) != set(needed):
        raise ValueError(f"fields = {sorted(fields)}; format {fmt.label} stores {sorted(needed)}")
    num_kv = fields[fmt.key_field].shape[1]
    if fmt.padded_head_dim(q.shape[2]) != fmt.head_dim_of(fields) or q.shape[1] % num_kv:
        raise ValueError(
            f"q.shape = {q.shape}; allowed: a head dim stored as the pool's {fmt.head_dim_of(fields)} columns and H a "
            f"multiple of its {num_kv} KV heads"
        )
    if block_tables.ndim != 2 or seq_lens.shape != block_tables.shape[:1]:
        raise ValueError(f"block_tables {block_tables.shape} / seq_lens {seq_lens.shape}; allowed: [B, MB] / [B]")
    if partitions is not None and not 1 <= partitions <= block_tables.shape[1]:
        raise ValueError(f"partitions = {partitions}; allowed: 1 .. block-table width {block_tables.shape[1]}")


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
    interpret: bool | None = None,
    tile: int | None = None,
    device: str | None = None,
) -> jax.Array:
    """The Mosaic TPU kernel of `kvcache.reference.unified_attention` (same arguments and result).

    Extra args:
      partitions: KV partitions per query tile (default 1: a TPU core runs the grid's programs in turn, so a split
        only pays for long contexts on few programs); 1 .. MB.
      interpret: see the module docstring (None: compiled on a TPU, TPU interpret mode with race detection
        elsewhere).
      tile: query tokens per program (default min(max_query_len, 16) rounded up to a power of two).
      device: the TPU family whose VMEM the program must fit (`budgets.BUDGETS`, "tpu_*"; None: detected, and a
        device that is not a known TPU is not checked). A default tile is halved until `vmem_bytes` fits the
        scoped default; past it (tile 1, or a given tile), the kernel compiles with the chip's physical VMEM as its
        limit if that holds it (`fit_tile`).
    Raises: NotImplementedError when the program does not fit the chip's VMEM (the numbers in the message).
    Returns: [T, H, D] float32. Positions a query may not see, and slots past a sequence's length, are excluded by
      selection, so NaN or Inf in them never reaches the output.
    """
    _check(q, fields, block_tables, seq_lens, fmt, partitions)
    t, num_heads, d = q.shape
    dp = fmt.padded_head_dim(d)  # the stored head dim: the query is padded to it, the output cut back to d
    _, num_kv, block_size = fields[fmt.key_field].shape[:3]
    batch, max_blocks = block_tables.shape
    groups = num_heads // num_kv
    max_q = t if max_query_len is None else int(max_query_len)
    family = budgets.resolve(device)
    shrink = tile is None
    tile = tile or min(MAX_TILE, pl.next_power_of_2(max_q))
    vmem_limit = None
    if family is not None and (device is not None or family.startswith("tpu")):
        fit = functools.partial(fit_tile, fmt, groups=groups, head_dim=d, block_size=block_size, device=family)
        tile, vmem_limit = fit(tile=tile, shrink=shrink)
    heads, rows = _rows(tile, groups)  # Gp: R = tile * Gp is a multiple of 8
    num_tiles = -(-max_q // tile)
    q_pad = num_tiles * tile
    parts = partitions or 1
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
        max_blocks=max_blocks,
        tile=tile,
        heads=heads,
        blocks_per_partition=blocks_per_partition,
        sm_scale=d**-0.5 if sm_scale is None else float(sm_scale),
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(batch, num_kv, num_tiles, parts),
        in_specs=[pl.BlockSpec((None, None, rows, dp), lambda b, h, i, p, *_: (h, b, i, 0))]
        + [pl.BlockSpec(memory_space=pl.ANY) for _ in names],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, dp), lambda b, h, i, p, *_: (p, h, b, i, 0)),
            pl.BlockSpec((None, None, None, rows, 1), lambda b, h, i, p, *_: (p, h, b, i, 0)),
        ],
        scratch_shapes=[pltpu.VMEM((2, 1, *fields[n].shape[2:]), fields[n].dtype) for n in names]
        + [pltpu.SemaphoreType.DMA((2, len(names)))],
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=(
            jax.ShapeDtypeStruct((parts, num_kv, batch, q_pad * heads, dp), jnp.float32),
            jax.ShapeDtypeStruct((parts, num_kv, batch, q_pad * heads, 1), jnp.float32),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 4, vmem_limit_bytes=vmem_limit),
        interpret=interpret_params(interpret),
        name=f"tpu_paged_attention_{fmt.name}",
    )(
        block_tables.astype(jnp.int32).reshape(-1),
        seq_lens.astype(jnp.int32),
        query_start_loc.astype(jnp.int32),
        qp,
        *(fields[n] for n in names),
    )

    # Log-sum-exp reduce over partitions; empty partitions (lse = -inf) weigh 0.
    lse = lse[..., 0]
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
    interpret: bool | None = None,
    device: str | None = None,
) -> jax.Array:
    """Split-KV decode, one query token per sequence: q [B, H, D] -> [B, H, D] float32 (tile 1, the G query heads
    of a KV head padded to a multiple of 8 rows); `kvcache.reference.decode_attention` with `partitions` and
    `interpret`, `device` as in `unified_attention`."""
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
        interpret=interpret,
        tile=1,
        device=device,
    )
