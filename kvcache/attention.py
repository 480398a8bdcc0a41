"""Paged attention over a quantised KV cache: the public entry points, dispatching through `IMPLEMENTATIONS`.

`IMPLEMENTATIONS` maps a name to its `Implementation` (the functions behind `unified_attention`,
`decode_attention` and `write`, None where it offers no such op), as tokamax's ops map backends:
  "xla":       `kvcache.reference` (gathers each sequence's blocks, dequantises, one softmax); also the fallback;
  "xla_split": decode only: `kvcache.split`, the split-KV algorithm as an XLA loop (the CPU fast path); its
               writes are the reference's;
  "pallas":    `kvcache.kernels` (split-KV with a log-sum-exp reduce, formats decoded in the kernel). Pallas on a
               CPU backend runs in Pallas' interpreter (`interpret=None` picks that automatically; pass False to
               insist on a compiled kernel).
Shapes and semantics: `kvcache.reference`. Adding an implementation is one entry of the dict.

All of them exclude the positions a query may not see by selection (`jnp.where` on scores, values and scales), not
by multiplying them with a zero probability: slots past a sequence's length (the tail of its last block, the blocks
behind padding columns of its block table) may hold NaN or Inf left by another request or never written, and
0 * NaN is NaN. Whatever those slots hold, the output is the same bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import chex
import jax

from kvcache import reference, split
from kvcache.formats import Format
from kvcache.kernels import attention as attention_kernel
from kvcache.kernels import write as write_kernel

__all__ = [
    "IMPLEMENTATIONS",
    "Implementation",
    "check_implementation",
    "decode_attention",
    "unified_attention",
    "write",
]


def _interpret(interpret: bool | None) -> bool:
    return jax.default_backend() == "cpu" if interpret is None else interpret


def _no_partitions(partitions: int | None, allowed: str) -> None:
    if partitions is not None:
        raise ValueError(f"partitions applies to implementation={allowed} only")


# Each op of an implementation takes the public function's arguments (`partitions` and `interpret` included).


def _xla_unified(
    q, fields, block_tables, seq_lens, query_start_loc, *, fmt, max_query_len, sm_scale, partitions, interpret
):
    _no_partitions(partitions, "'pallas'")
    return reference.unified_attention(
        q, fields, block_tables, seq_lens, query_start_loc, fmt=fmt, max_query_len=max_query_len, sm_scale=sm_scale
    )


def _pallas_unified(q, fields, block_tables, seq_lens, query_start_loc, *, interpret, **kw):
    return attention_kernel.unified_attention(
        q, fields, block_tables, seq_lens, query_start_loc, interpret=_interpret(interpret), **kw
    )


def _xla_decode(q, fields, block_tables, seq_lens, *, fmt, sm_scale, partitions, interpret):
    _no_partitions(partitions, "'pallas' or 'xla_split'")
    return reference.decode_attention(q, fields, block_tables, seq_lens, fmt=fmt, sm_scale=sm_scale)


def _split_decode(q, fields, block_tables, seq_lens, *, fmt, sm_scale, partitions, interpret):
    per = split.BLOCKS_PER_PARTITION if partitions is None else -(-block_tables.shape[1] // partitions)
    return split.decode_attention(
        q, fields, block_tables, seq_lens, fmt=fmt, sm_scale=sm_scale, blocks_per_partition=per
    )


def _pallas_decode(q, fields, block_tables, seq_lens, *, interpret, **kw):
    return attention_kernel.decode_attention(q, fields, block_tables, seq_lens, interpret=_interpret(interpret), **kw)


def _xla_write(fields, k, v, slot_mapping, *, fmt, interpret):
    return reference.write(fields, k, v, slot_mapping, fmt=fmt)


def _pallas_write(fields, k, v, slot_mapping, *, fmt, interpret):
    return write_kernel.write(fields, k, v, slot_mapping, fmt=fmt, interpret=_interpret(interpret))


class Implementation(NamedTuple):
    """The functions of one attention implementation (signatures of the public functions; None: not offered)."""

    unified: Callable[..., jax.Array] | None
    decode: Callable[..., jax.Array]
    write: Callable[..., dict[str, jax.Array]]


IMPLEMENTATIONS: dict[str, Implementation] = {
    "xla": Implementation(_xla_unified, _xla_decode, _xla_write),
    "xla_split": Implementation(None, _split_decode, _xla_write),
    "pallas": Implementation(_pallas_unified, _pallas_decode, _pallas_write),
}


def check_implementation(implementation: str) -> Implementation:
    """The implementation called `implementation`; ValueError naming it and the allowed names otherwise."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation = {implementation!r}; allowed: {list(IMPLEMENTATIONS)}")
    return IMPLEMENTATIONS[implementation]


def _check(q, fields, block_tables, seq_lens, fmt: Format, q_rank: int) -> None:
    chex.assert_rank(q, q_rank, custom_message="q: [tokens or sequences, heads, head_dim]")
    chex.assert_type(q, float, custom_message="q: a floating-point query")
    chex.assert_type([block_tables, seq_lens], int, custom_message="block_tables and seq_lens: integer arrays")
    names = set(fmt.fields(1, q.shape[-1]))  # (checks the head dim)
    if set(fields) != names:
        raise ValueError(f"cache fields {sorted(fields)} do not match format {fmt.label}: expected {sorted(names)}")
    num_kv = fields[fmt.key_field].shape[1]
    if q.shape[-2] % num_kv:
        raise ValueError(f"q has {q.shape[-2]} heads; must be a multiple of the cache's {num_kv} KV heads")
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
    impl = check_implementation(implementation)
    _check(q, fields, block_tables, seq_lens, fmt, 3)
    if impl.unified is None:
        raise ValueError(f"implementation = {implementation!r} runs decode_attention only; use 'xla' or 'pallas' here")
    return impl.unified(
        q,
        fields,
        block_tables,
        seq_lens,
        query_start_loc,
        fmt=fmt,
        max_query_len=max_query_len,
        sm_scale=sm_scale,
        partitions=partitions,
        interpret=interpret,
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
    impl = check_implementation(implementation)
    _check(q, fields, block_tables, seq_lens, fmt, 3)
    return impl.decode(
        q, fields, block_tables, seq_lens, fmt=fmt, sm_scale=sm_scale, partitions=partitions, interpret=interpret
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
    impl = check_implementation(implementation)
    chex.assert_rank([k, v, slot_mapping], [3, 3, 1], custom_message="k, v: [T, K, D]; slot_mapping: [T]")
    chex.assert_type(slot_mapping, int, custom_message="slot_mapping: integer slots")
    return impl.write(fields, k, v, slot_mapping, fmt=fmt, interpret=interpret)
