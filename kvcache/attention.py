"""Paged attention over a quantised KV cache: the public entry points, dispatching to XLA or Pallas.

`implementation="xla"` runs `kvcache.reference` (gathers each sequence's blocks, dequantises, one softmax);
`"xla_split"` (decode only) runs `kvcache.split`, the split-KV algorithm as an XLA loop (the CPU fast path);
`"pallas"` runs `kvcache.kernels` (split-KV with a log-sum-exp reduce, formats decoded in the kernel). Pallas on a
CPU backend runs in Pallas' interpreter (`interpret=None` picks that automatically; pass False to insist on a
compiled kernel). Shapes and semantics: `kvcache.reference`.

All three exclude the positions a query may not see by selection (`jnp.where` on scores, values and scales), not by
multiplying them with a zero probability: slots past a sequence's length (the tail of its last block, the blocks
behind padding columns of its block table) may hold NaN or Inf left by another request or never written, and
0 * NaN is NaN. Whatever those slots hold, the output is the same bit for bit.
"""

from __future__ import annotations

import chex
import jax

from kvcache import reference, split
from kvcache.formats import Format
from kvcache.kernels import attention as attention_kernel
from kvcache.kernels import write as write_kernel

__all__ = ["IMPLEMENTATIONS", "check_implementation", "decode_attention", "unified_attention", "write"]

IMPLEMENTATIONS = ("xla", "xla_split", "pallas")


def check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation = {implementation!r}; allowed: {list(IMPLEMENTATIONS)}")


def _interpret(interpret: bool | None) -> bool:
    return jax.default_backend() == "cpu" if interpret is None else interpret


def _check(q, fields, block_tables, seq_lens, fmt: Format, q_rank: int) -> None:
    names = set(fmt.fields(1, 2 * 32))
    if set(fields) != names:
        raise ValueError(f"cache fields {sorted(fields)} do not match format {fmt.label}: expected {sorted(names)}")
    chex.assert_rank(q, q_rank, custom_message="q: [tokens or sequences, heads, head_dim]")
    chex.assert_type(q, float, custom_message="q: a floating-point query")
    chex.assert_type([block_tables, seq_lens], int, custom_message="block_tables and seq_lens: integer arrays")
    num_kv = fields["k_codes" if fmt.name == "fp4" else "k"].shape[1]
    if q.shape[-2] % num_kv:
        raise ValueError(f"q has {q.shape[-2]} heads; must be a multiple of the cache's {num_kv} KV heads")
    fmt.check_head_dim(q.shape[-1])
    if block_tables.ndim != 2 or seq_lens.shape != block_tables.shape[:1]:
        raise ValueError(f"block_tables {block_tables.shape} must be [B, max_blocks] and seq_lens {seq_lens.shape} [B]")


def unified_attention(
    q: jax.Array,
    fields: dict[str, jax.Array],
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    fmt: Format,
    implementation: str = "xla",
    max_query_len: int | None = None,
    sm_scale: float | None = None,
    partitions: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """A ragged batch of prefill chunks and decode tokens over the paged cache (q [T, H, D] -> [T, H, D] float32).

    See `kvcache.reference.unified_attention`; `partitions` (Pallas only) sets the split-KV partition count.
    """
    check_implementation(implementation)
    _check(q, fields, block_tables, seq_lens, fmt, 3)
    if implementation == "xla_split":
        raise ValueError("implementation = 'xla_split' runs decode_attention only; use 'xla' or 'pallas' here")
    if implementation == "xla":
        if partitions is not None:
            raise ValueError("partitions applies to implementation='pallas' only")
        return reference.unified_attention(
            q, fields, block_tables, seq_lens, query_start_loc, fmt=fmt, max_query_len=max_query_len, sm_scale=sm_scale
        )
    return attention_kernel.unified_attention(
        q,
        fields,
        block_tables,
        seq_lens,
        query_start_loc,
        fmt=fmt,
        max_query_len=max_query_len,
        sm_scale=sm_scale,
        partitions=partitions,
        interpret=_interpret(interpret),
    )


def decode_attention(
    q: jax.Array,
    fields: dict[str, jax.Array],
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    fmt: Format,
    implementation: str = "xla",
    sm_scale: float | None = None,
    partitions: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """One new token per sequence (q [B, H, D] -> [B, H, D] float32), split-KV in the Pallas kernel and in
    "xla_split" (`partitions` = blocks per partition there)."""
    check_implementation(implementation)
    _check(q, fields, block_tables, seq_lens, fmt, 3)
    if implementation == "xla":
        if partitions is not None:
            raise ValueError("partitions applies to implementation='pallas' or 'xla_split' only")
        return reference.decode_attention(q, fields, block_tables, seq_lens, fmt=fmt, sm_scale=sm_scale)
    if implementation == "xla_split":
        per = split.BLOCKS_PER_PARTITION if partitions is None else -(-block_tables.shape[1] // partitions)
        return split.decode_attention(
            q, fields, block_tables, seq_lens, fmt=fmt, sm_scale=sm_scale, blocks_per_partition=per
        )
    return attention_kernel.decode_attention(
        q,
        fields,
        block_tables,
        seq_lens,
        fmt=fmt,
        sm_scale=sm_scale,
        partitions=partitions,
        interpret=_interpret(interpret),
    )


def write(
    fields: dict[str, jax.Array],
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    fmt: Format,
    implementation: str = "xla",
    interpret: bool | None = None,
) -> dict[str, jax.Array]:
    """Quantise-on-write of k, v [T, K, D] into flat slots [T] (negative = skip); returns the updated fields."""
    check_implementation(implementation)
    chex.assert_rank([k, v, slot_mapping], [3, 3, 1], custom_message="k, v: [T, K, D]; slot_mapping: [T]")
    chex.assert_type(slot_mapping, int, custom_message="slot_mapping: integer slots")
    if implementation != "pallas":
        return reference.write(fields, k, v, slot_mapping, fmt=fmt)
    return write_kernel.write(fields, k, v, slot_mapping, fmt=fmt, interpret=_interpret(interpret))
