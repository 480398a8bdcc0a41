"""The paged KV cache: a pool of fixed-size blocks sized in bytes, block tables, quantise-on-write, free.

pool fields: `fields[name]` [L, NB, K, bs, *trailing] per stored array of the format (layers x blocks x KV heads
             x block tokens); one token of one layer costs `fmt.bytes_per_token(K, D)` bytes, so a byte budget
             holds 512 / 136 = 3.76x more fp4 tokens than bf16 tokens at D = 128. Heads of D = 80 or 96 are
             stored padded to the format's Dp (`Format.padded_head_dim`) and cost (and are planned at) Dp's bytes.
Whole blocks only: a byte budget holds `kvcache.capacity.num_blocks` blocks. Which blocks a sequence owns is its
block table; `kvcache.serving.blocks.BlockManager` hands blocks out (with a prefix cache) on the host.
PagedKVCache: the `core.attention.KVCache` protocol over a pool, so the model's cached generation runs on any
             format: each forward call writes its tokens' K/V (quantised) and runs unified attention.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvcache import attention, capacity
from kvcache.formats import Format

__all__ = ["IMPLEMENTATIONS", "PagedKVCache", "PagedPool", "paged_cache_factory"]

IMPLEMENTATIONS = attention.IMPLEMENTATIONS  # (re-exported: the attention implementations' names)


@struct.dataclass
class PagedPool:
    """Storage of a paged KV cache: the format's fields for every layer, [L, NB, K, bs, ...]."""

    fields: dict[str, jax.Array]
    fmt: Format = struct.field(pytree_node=False)

    @classmethod
    def create(
        cls,
        fmt: Format,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        memory_bytes: int | None = None,
        num_blocks: int | None = None,
    ) -> PagedPool:
        """A zeroed pool of `num_blocks` blocks, or as many whole blocks as `memory_bytes` holds."""
        if (memory_bytes is None) == (num_blocks is None):
            raise ValueError("PagedPool.create needs exactly one of memory_bytes and num_blocks")
        if block_size < 1:
            raise ValueError(f"block_size = {block_size}; must be >= 1")
        if num_blocks is None:
            assert memory_bytes is not None  # exactly one of the two is None (checked above)
            shape = capacity.ModelShape(num_layers, num_kv_heads, head_dim)
            per_block = capacity.block_bytes(shape, fmt, block_size=block_size)
            num_blocks = capacity.num_blocks(int(memory_bytes), shape, fmt, block_size=block_size)
            if num_blocks < 1:
                raise ValueError(
                    f"memory_bytes = {memory_bytes} holds no block: one block of {block_size} tokens "
                    f"x {num_layers} layers in {fmt.label} takes {per_block} bytes"
                )
        fields = {
            name: jnp.zeros((num_layers, num_blocks, num_kv_heads, block_size, *shape[1:]), dtype)
            for name, (shape, dtype) in fmt.fields(num_kv_heads, head_dim).items()
        }
        return cls(fields, fmt)

    @property
    def num_blocks(self) -> int:
        return next(iter(self.fields.values())).shape[1]

    @property
    def block_size(self) -> int:
        return next(iter(self.fields.values())).shape[3]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.fields.values())

    def layer(self, i: int) -> dict[str, jax.Array]:
        return {name: x[i] for name, x in self.fields.items()}

    def as_one_layer(self, layer: int) -> tuple[dict[str, jax.Array], int]:
        """(the fields with their layer and block axes merged, [L * NB, K, bs, ...]: a free reshape; the first block
        of layer `layer` there). Writing and attending layer `layer` in them (its block ids + that offset, its slots
        + offset x bs) and `from_one_layer` update the pool in place, where writing a layer's slice and setting it
        back copies the layer on every call."""
        return {n: x.reshape(-1, *x.shape[2:]) for n, x in self.fields.items()}, layer * self.num_blocks

    def from_one_layer(self, merged: dict[str, jax.Array]) -> PagedPool:
        """The pool holding `merged` (`as_one_layer`'s fields, updated)."""
        return dataclasses.replace(self, fields={n: x.reshape(self.fields[n].shape) for n, x in merged.items()})


@struct.dataclass
class PagedKVCache:
    """`core.attention.KVCache` over a paged pool: sequence b owns blocks `block_tables[b]` and holds
    `lengths[b]` tokens; a forward call of T tokens per sequence writes them at positions lengths .. lengths+T-1
    (quantise-on-write), then attends with unified attention (causal inside the T new tokens)."""

    pool: PagedPool
    block_tables: jax.Array  # [B, MB] int32
    lengths: jax.Array  # [B] int32
    implementation: str = struct.field(pytree_node=False, default="xla")
    interpret: bool | None = struct.field(pytree_node=False, default=None)

    @property
    def capacity(self) -> int:
        return self.block_tables.shape[1] * self.pool.block_size

    def update_and_attend(self, layer: int, q, k, v):
        b, t, h, d = q.shape
        bs = self.pool.block_size
        pos = self.lengths[:, None] + jnp.arange(t)[None]  # [B, T]
        blocks = jnp.take_along_axis(self.block_tables, jnp.minimum(pos // bs, self.block_tables.shape[1] - 1), 1)
        merged, first = self.pool.as_one_layer(layer)
        slots = jnp.where(pos < self.capacity, (first + blocks) * bs + pos % bs, -1).reshape(-1)
        tables = self.block_tables + first
        kw: dict[str, Any] = dict(fmt=self.pool.fmt, implementation=self.implementation, interpret=self.interpret)
        fields = attention.write(merged, k.reshape(b * t, *k.shape[2:]), v.reshape(b * t, *v.shape[2:]), slots, **kw)
        if t == 1:
            out = attention.decode_attention(q[:, 0], fields, tables, self.lengths + 1, **kw)
        else:
            qsl = jnp.arange(b + 1, dtype=jnp.int32) * t
            impl = "xla" if self.implementation == "xla_split" else self.implementation  # prefill: the reference
            out = attention.unified_attention(
                q.reshape(b * t, h, d),
                fields,
                tables,
                self.lengths + t,
                qsl,
                max_query_len=t,
                **{**kw, "implementation": impl},
            )
        pool = self.pool.from_one_layer(fields)
        return out.reshape(b, t, h, d).astype(q.dtype), dataclasses.replace(self, pool=pool)

    def advance(self, num_tokens):
        return dataclasses.replace(self, lengths=self.lengths + jnp.asarray(num_tokens, jnp.int32))


def paged_cache_factory(
    fmt: Format,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    implementation: str = "xla",
    interpret: bool | None = None,
    shuffle_blocks: int | None = None,
):
    """(batch, capacity) -> an empty PagedKVCache for `core.generate.generate`: ceil(capacity / bs) blocks per
    sequence. `shuffle_blocks=seed` hands the blocks out in a random order (tests: tables need not be contiguous)."""
    attention.check_implementation(implementation)

    def factory(batch: int, capacity: int) -> PagedKVCache:
        per_seq = -(-capacity // block_size)
        pool = PagedPool.create(
            fmt,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            num_blocks=batch * per_seq,
        )
        ids = np.arange(batch * per_seq, dtype=np.int32)
        if shuffle_blocks is not None:
            ids = np.random.default_rng(shuffle_blocks).permutation(ids)
        return PagedKVCache(
            pool, jnp.asarray(ids.reshape(batch, per_seq)), jnp.zeros((batch,), jnp.int32), implementation, interpret
        )

    return factory
