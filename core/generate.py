"""Autoregressive generation with a KV cache: one prefill of the (ragged) prompts, then one token per step.

The whole loop is a single jitted program (prefill + `lax.scan` over decode steps). Any `core.attention.KVCache`
works; `DenseKVCache` (bf16) is the default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import attention as attention_lib
from core.data import EOS_ID, NUM_BYTES, PAD_ID

__all__ = ["dense_cache_factory", "generate"]

CacheFactory = Callable[[int, int], attention_lib.KVCache]
"""(batch, capacity) -> an empty cache."""


def dense_cache_factory(model, dtype=jnp.bfloat16) -> CacheFactory:
    """Empty `DenseKVCache`s shaped for `model` (a core.model.Transformer)."""
    cfg = model.cfg
    return lambda batch, capacity: attention_lib.DenseKVCache.create(
        num_layers=cfg.num_layers,
        batch=batch,
        capacity=capacity,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=dtype,
    )


def _sample(logits: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
    """logits [B, V] -> tokens [B]; greedy when temperature == 0. Special ids other than EOS are never sampled."""
    vocab = jnp.arange(logits.shape[-1])
    logits = jnp.where((vocab < NUM_BYTES) | (vocab == EOS_ID), logits, -jnp.inf)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(
    model: nnx.Module,
    prompts: Sequence[np.ndarray],
    *,
    max_new_tokens: int,
    key: jax.Array,
    temperature: float = 0.0,
    top_k: int = 0,
    cache_factory: CacheFactory | None = None,
) -> np.ndarray:
    """Continues each prompt by `max_new_tokens` tokens.

    Args:
      model: a Transformer (its `__call__` accepts `cache=`).
      prompts: B int arrays of token ids (lengths may differ, each >= 1).
      key: PRNG key for sampling (unused when temperature == 0).
      cache_factory: builds the empty cache (default: bf16 DenseKVCache).
    Returns:
      [B, max_new_tokens] int32; after a sequence emits EOS the rest of its row is PAD.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and every prompt must hold at least one token (e.g. BOS)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}; must be >= 1")
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = int(lengths.max())
    padded = np.full((len(prompts), width), PAD_ID, np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    capacity = -(-(width + max_new_tokens) // 64) * 64  # round up: fewer distinct compiled shapes
    cache = (cache_factory or dense_cache_factory(model))(len(prompts), capacity)
    graphdef, state = nnx.split(model)
    return np.asarray(
        _generate(
            graphdef,
            state,
            jnp.asarray(padded),
            jnp.asarray(lengths),
            cache,
            key,
            max_new_tokens=max_new_tokens,
            temperature=float(temperature),
            top_k=int(top_k),
        )
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k"))
def _generate(graphdef, state, padded, lengths, cache, key, *, max_new_tokens, temperature, top_k):
    model = nnx.merge(graphdef, state)
    logits, _, cache = model(padded, cache=cache)
    # Prefill wrote every padded position; roll each sequence back to its true length (positions beyond are
    # overwritten by the decode steps and never attended before that, by causality).
    cache = cache.advance(lengths - padded.shape[1])
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    keys = jax.random.split(key, max_new_tokens)
    first = _sample(last, keys[0], temperature, top_k)

    def step(carry, step_key):
        cache, token, done = carry
        emitted = jnp.where(done, PAD_ID, token)
        done = done | (token == EOS_ID)
        logits, _, cache = model(token[:, None], cache=cache)
        return (cache, _sample(logits[:, 0], step_key, temperature, top_k), done), emitted

    done0 = jnp.zeros(first.shape, bool)
    (_, last_token, done), out = jax.lax.scan(step, (cache, first, done0), keys[1:])
    tail = jnp.where(done, PAD_ID, last_token)[None]
    return jnp.concatenate([out, tail], axis=0).T
