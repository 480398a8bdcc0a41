"""Autoregressive generation with a KV cache: one prefill of the (ragged) prompts, then one token per step.

The whole loop is a single jitted program (prefill + `lax.scan` over decode steps). Any `core.attention.KVCache`
works; `DenseKVCache` (bf16) is the default. Tokens are drawn by `core.sampling.sample` (greedy at temperature 0,
else temperature, top-k and top-p), one key per row and step split from `key`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import attention as attention_lib
from core import sampling
from core.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

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


def generate(
    model: nnx.Module,
    prompts: Sequence[np.ndarray],
    *,
    max_new_tokens: int,
    key: jax.Array,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    cache_factory: CacheFactory | None = None,
    eos_id: int | None = EOS_ID,
    never: tuple[int, ...] = (PAD_ID, BOS_ID),
    num_ids: int | None = VOCAB_SIZE,
    pad_id: int = PAD_ID,
) -> np.ndarray:
    """Continues each prompt by `max_new_tokens` tokens.

    The token ids default to the byte tokenizer's. A model of another tokenizer (core.tokenizer, `data.tokenizer`)
    needs its ids passed: `eos_id=tok.eos_id, never=tok.never_sampled, num_ids=tok.vocab_size` and
    `pad_id=tok.pad_id` (or `tok.eos_id` when it has none).

    Args:
      model: a Transformer (its `__call__` accepts `cache=`).
      prompts: B int arrays of token ids (lengths may differ, each >= 1).
      key: PRNG key for sampling (unused when temperature == 0).
      temperature, top_k, top_p: `core.sampling.sample`'s (0 = greedy; top_k 0 and top_p 1: no cut).
      cache_factory: builds the empty cache (default: bf16 DenseKVCache).
      eos_id: the token that ends a sequence (default the byte tokenizer's EOS; None: none does).
      never, num_ids: ids never sampled: those in `never` and those >= `num_ids` (None: no limit). The defaults
        are the byte tokenizer's (PAD, BOS; the embedding's rows past its 259 ids).
      pad_id: fills a row after its `eos_id` (and pads the prompts; default the byte tokenizer's PAD).
    Returns:
      [B, max_new_tokens] int32; after a sequence emits `eos_id` the rest of its row is `pad_id`.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and every prompt must hold at least one token (e.g. BOS)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}; must be >= 1")
    if not (temperature >= 0 and top_k >= 0 and 0 < top_p <= 1):  # NaN fails too
        raise ValueError(
            f"temperature = {temperature}, top_k = {top_k}, top_p = {top_p}; allowed: temperature >= 0, top_k >= 0, "
            "0 < top_p <= 1"
        )
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = int(lengths.max())
    padded = np.full((len(prompts), width), pad_id, np.int32)
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
            top_p=float(top_p),
            eos_id=-1 if eos_id is None else int(eos_id),
            never=tuple(int(t) for t in never),
            num_ids=None if num_ids is None else int(num_ids),
            pad_id=int(pad_id),
        )
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "eos_id",
        "never",
        "num_ids",
        "pad_id",
    ),
)
def _generate(
    graphdef,
    state,
    padded,
    lengths,
    cache,
    key,
    *,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    eos_id,
    never,
    num_ids,
    pad_id,
):
    model = nnx.merge(graphdef, state)

    def sample(logits, step_key):
        allowed = sampling.allowed_ids(logits.shape[-1], never, num_ids)  # static: built when traced
        keys = jax.random.split(step_key, logits.shape[0])
        return sampling.sample(logits, keys, temperature=temperature, top_k=top_k, top_p=top_p, allowed=allowed)

    logits, _, cache = model(padded, cache=cache)
    # Prefill wrote every padded position; roll each sequence back to its true length (positions beyond are
    # overwritten by the decode steps and never attended before that, by causality).
    cache = cache.advance(lengths - padded.shape[1])
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    keys = jax.random.split(key, max_new_tokens)
    first = sample(last, keys[0])

    def step(carry, step_key):
        cache, token, done = carry
        emitted = jnp.where(done, pad_id, token)
        done = done | (token == eos_id)
        logits, _, cache = model(token[:, None], cache=cache)
        return (cache, sample(logits[:, 0], step_key), done), emitted

    done0 = jnp.zeros(first.shape, bool)
    (_, last_token, done), out = jax.lax.scan(step, (cache, first, done0), keys[1:])
    tail = jnp.where(done, pad_id, last_token)[None]
    return jnp.concatenate([out, tail], axis=0).T
