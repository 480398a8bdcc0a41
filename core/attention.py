"""Attention: rotary embeddings, training attention, and the KV-cache protocol with a dense bf16 cache.

Shapes: B batch, T new tokens, S cache capacity, H query heads, K key/value heads (H % K == 0), D head dim.

The model's attention slot has two entries:
  * training: `causal_attention(q, k, v, implementation=...)` over a whole sequence;
  * cached decode: a `KVCache` object whose `update_and_attend` writes the new tokens' keys/values and attends
    the new queries over everything cached so far. `DenseKVCache` stores bf16 (or any float) keys/values; other
    cache formats (fp8, fp4, paged) implement the same two methods and plug in without touching the model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
from flax import struct

__all__ = [
    "DenseKVCache",
    "KVCache",
    "RopeScaling",
    "Rotary",
    "apply_rotary",
    "causal_attention",
    "rope",
    "rope_frequencies",
    "rotary",
]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling: with wavelength w_i = 2 pi / f_i of pair i and L = original_max_len,
    f_i is kept where w_i < L / high_freq_factor, divided by `factor` where w_i > L / low_freq_factor, and in
    between interpolated: (1 - s) f_i / factor + s f_i with s = (L / w_i - low_freq_factor) / (high_freq_factor -
    low_freq_factor)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def __call__(self, inv_freq: jax.Array) -> jax.Array:
        wavelength = 2 * math.pi / inv_freq
        smooth = (self.original_max_len / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        between = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        long = wavelength > self.original_max_len / self.low_freq_factor
        short = wavelength < self.original_max_len / self.high_freq_factor
        return jnp.where(short, inv_freq, jnp.where(long, inv_freq / self.factor, between))


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """[head_dim / 2] float32: pair i's angular frequency theta^(-2i / head_dim), scaled by `scaling` if given."""
    inv_freq = theta ** (-jnp.arange(0, head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim)
    return inv_freq if scaling is None else scaling(inv_freq)


class Rotary(NamedTuple):
    """The rotation of every position: cos and sin [B, T, 1, D / 2] float32 of the angles pos * f_i (B may be 1: one
    row of positions for the whole batch). Computed once per forward (`rotary`) and applied to every layer's queries
    and keys (`apply_rotary`)."""

    cos: jax.Array
    sin: jax.Array


def rotary(positions: jax.Array, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Rotary:
    """The `Rotary` of integer positions [B, T]: pair i of a head rotates by pos * theta^(-2i / head_dim)
    (`rope_frequencies`, scaled by `scaling` if given)."""
    angle = positions.astype(jnp.float32)[..., None, None] * rope_frequencies(head_dim, theta, scaling)
    return Rotary(_materialised(jnp.cos(angle)), _materialised(jnp.sin(angle)))


def _materialised(x: jax.Array) -> jax.Array:
    """x, exactly (a product with the identity at full precision), as a value XLA computes once: it copies an
    elementwise producer into every fusion that reads it, and the table's readers (every layer's queries and keys,
    forward and backward: 24 of them in a 4-layer train step) would each evaluate sin and cos again, one libm call
    per element on the CPU (5% of the step). A dot is a fusion boundary; the optimization barrier is not (XLA:CPU
    removes it before fusing)."""
    eye = jnp.eye(x.shape[-1], dtype=x.dtype)
    return jax.lax.dot_general(x, eye, (((x.ndim - 1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST)


def apply_rotary(x: jax.Array, rot: Rotary) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), rotate-half form, of x [B, T, N, D] (D even) by `rot`:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with x1, x2 the two halves; in x's dtype."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = rot
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """`apply_rotary(x, rotary(positions, D, theta, scaling))`: x [B, T, N, D] rotated by its positions [B, T]."""
    return apply_rotary(x, rotary(positions, x.shape[-1], theta, scaling))


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str | None = "xla", blocks: int = 4
) -> jax.Array:
    """softmax(q k^T / sqrt(D) + causal mask) v with grouped-query heads.

    Args:
      q: [B, T, H, D]; k, v: [B, T, K, D] with H % K == 0.
      implementation: "xla": the queries in `blocks` row blocks of ceil(T / blocks), block i attending only to the
        keys up to its last position (the products a causal mask would discard are not computed: 3/8 of them with
        4 blocks), each KV head's G = H / K query heads stacked in one product; scores, softmax and mask in float32,
        probabilities cast to v's dtype for the product with v (as `jax.nn.dot_product_attention` does).
        "cudnn" or None: `jax.nn.dot_product_attention` with that backend (None: its automatic choice).
      blocks: the "xla" row blocks (>= 1; more blocks skip more products but make more, smaller ones).
    Returns:
      [B, T, H, D] in q's dtype.
    """
    if implementation not in ("xla", "cudnn", None):
        raise ValueError(f"implementation = {implementation!r}; allowed: 'xla', 'cudnn' or None.")
    if implementation != "xla":
        impl = cast(Literal["cudnn"] | None, implementation)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    if blocks < 1:
        raise ValueError(f"blocks = {blocks}; allowed: >= 1.")
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
    keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, D]
    size = -(-t // blocks)
    outs = []
    for start in range(0, t, size):
        end = min(t, start + size)
        rows = qg[:, :, :, start:end]
        s = jnp.einsum("bkgtd,bksd->bkgts", rows, keys[:, :, :end], preferred_element_type=jnp.float32)
        causal = start + jnp.arange(end - start)[:, None] >= jnp.arange(end)[None, :]
        p = jax.nn.softmax(jnp.where(causal, s * (1.0 / math.sqrt(d)), -jnp.inf), axis=-1)
        outs.append(jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), values[:, :, :end]))
    out = jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


class KVCache(Protocol):
    """What the model needs from a KV cache. Implementations are pytrees, updated functionally.

    `lengths[b]` tokens of sequence b are cached; new tokens of a forward call occupy positions
    lengths[b] .. lengths[b] + T - 1.
    """

    lengths: jax.Array  # [B] int32

    def update_and_attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, KVCache]:
        """Writes k, v [B, T, K, D] of layer `layer` at the new positions and returns (attention of q [B, T, H, D]
        over cached positions <= each query's position, the updated cache). Does not advance `lengths`."""
        ...

    def advance(self, num_tokens: jax.Array | int) -> KVCache:
        """Returns the cache with `lengths` increased by `num_tokens` (a scalar or [B]), after all layers ran."""
        ...


@struct.dataclass
class DenseKVCache:
    """Keys and values stored as they are (bf16 by default): the reference cache.

    keys, values: [L, B, S, K, D]; lengths: [B] int32.
    """

    keys: jax.Array
    values: jax.Array
    lengths: jax.Array

    @classmethod
    def create(
        cls, *, num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype=jnp.bfloat16
    ) -> DenseKVCache:
        shape = (num_layers, batch, capacity, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def update_and_attend(self, layer: int, q, k, v):
        _b, t = q.shape[:2]
        write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice_in_dim(cache, new, start, axis=0))
        keys = write(self.keys[layer], k.astype(self.keys.dtype), self.lengths)
        values = write(self.values[layer], v.astype(self.values.dtype), self.lengths)
        q_pos = self.lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]
        k_pos = jnp.arange(self.capacity)  # [S]
        mask = (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, T, S]
        out = jax.nn.dot_product_attention(
            q, keys.astype(q.dtype), values.astype(q.dtype), mask=mask, implementation="xla"
        )
        cache = dataclasses.replace(self, keys=self.keys.at[layer].set(keys), values=self.values.at[layer].set(values))
        return out, cache

    def advance(self, num_tokens):
        return dataclasses.replace(self, lengths=self.lengths + jnp.asarray(num_tokens, jnp.int32))
