"""Autoregressive generation with a KV cache: one prefill of the (ragged) prompts, then one token per step.

The whole loop is a single jitted program (prefill + `lax.scan` over decode steps). Any `core.attention.KVCache`
works; `DenseKVCache` (bf16) is the default. Tokens are drawn by `core.sampling.sample` (greedy at temperature 0,
else temperature, top-k and top-p; the repetition penalty over each row's prompt and output ids when it is not 1),
one key per row and step split from `key`.

The special ids come from the tokenizer (`tokenizer=`: its EOS ends a row, its `never_sampled` ids are never drawn,
nor ids past its vocabulary) or are all given explicitly (`eos_id`, `never`, `num_ids`): nothing defaults to a
particular tokenizer's ids.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import attention as attention_lib
from core import sampling

if TYPE_CHECKING:
    from core.tokenizer import Tokenizer

__all__ = ["dense_cache_factory", "generate"]

CacheFactory = Callable[[int, int], attention_lib.KVCache]
"""(batch, capacity) -> an empty cache."""

_MISSING: Any = object()  # a special id not given (and no tokenizer to read it from): refused


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
    tokenizer: Tokenizer | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    cache_factory: CacheFactory | None = None,
    eos_id: int | Sequence[int] | None = _MISSING,
    never: Sequence[int] = _MISSING,
    num_ids: int | None = _MISSING,
    pad_id: int | None = None,
) -> np.ndarray:
    """Continues each prompt by `max_new_tokens` tokens.

    Args:
      model: a Transformer (its `__call__` accepts `cache=`).
      prompts: B int arrays of token ids (lengths may differ, each >= 1).
      key: PRNG key for sampling (unused when temperature == 0).
      tokenizer: the model's tokenizer (core.tokenizer), giving the defaults of `eos_id` (its EOS), `never` (its
        `never_sampled`), `num_ids` (its `vocab_size`) and `pad_id` (its PAD, else its EOS). Without it those three
        must be given.
      temperature, top_k, top_p: `core.sampling.sample`'s (0 = greedy; top_k 0 and top_p 1: no cut).
      repetition_penalty: > 0; each row's prompt and output ids have their logits divided (positive) or multiplied
        (negative) by it before sampling, as transformers and vLLM do (1: none).
      cache_factory: builds the empty cache (default: bf16 DenseKVCache).
      eos_id: the id, or ids (a generation config's list), that end a row; None: none does.
      never, num_ids: ids never sampled: those in `never` (but the end ids) and those >= `num_ids` (None: no limit).
      pad_id: fills a row after its end id (and pads the prompts); default the tokenizer's PAD, else the first end
        id, else 0.
    Returns:
      [B, max_new_tokens] int32; after a row emits an end id, the rest of it is `pad_id`.
    Raises:
      ValueError: no prompt or an empty one, max_new_tokens < 1, a sampling parameter out of range, or special ids
        neither given nor read from a tokenizer (naming them).
    """
    if tokenizer is not None:
        eos_id = (tokenizer.eos_id,) if eos_id is _MISSING else eos_id
        never = tokenizer.never_sampled if never is _MISSING else never
        num_ids = tokenizer.vocab_size if num_ids is _MISSING else num_ids
    given = {"eos_id": eos_id, "never": never, "num_ids": num_ids}
    missing = [name for name, value in given.items() if value is _MISSING]
    if missing:
        raise ValueError(
            f"generate needs the tokenizer's special ids; missing {missing}: pass tokenizer=tok (its EOS, "
            "never_sampled and vocab_size), or eos_id=, never= and num_ids= (None for no end id / no limit)"
        )
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and every prompt must hold at least one token (e.g. BOS)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}; must be >= 1")
    if not (temperature >= 0 and top_k >= 0 and 0 < top_p <= 1 and repetition_penalty > 0):  # NaN fails too
        raise ValueError(
            f"temperature = {temperature}, top_k = {top_k}, top_p = {top_p}, repetition_penalty = "
            f"{repetition_penalty}; allowed: temperature >= 0, top_k >= 0, 0 < top_p <= 1, repetition_penalty > 0"
        )
    ends = () if eos_id is None else (int(eos_id),) if isinstance(eos_id, (int, np.integer)) else tuple(eos_id)
    if pad_id is None:
        pad_id = tokenizer.pad_id if tokenizer is not None and tokenizer.pad_id is not None else (ends or (0,))[0]
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
            penalty=float(repetition_penalty),
            ends=tuple(int(t) for t in ends),
            never=tuple(int(t) for t in never if int(t) not in ends),
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
        "penalty",
        "ends",
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
    penalty,
    ends,
    never,
    num_ids,
    pad_id,
):
    model = nnx.merge(graphdef, state)
    batch = padded.shape[0]
    rows = jnp.arange(batch)

    def sample(logits, step_key, seen):
        allowed = sampling.allowed_ids(logits.shape[-1], never, num_ids)  # static: built when traced
        keys = jax.random.split(step_key, logits.shape[0])
        return sampling.sample(
            logits,
            keys,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            allowed=allowed,
            repetition_penalty=penalty,
            seen=seen,
        )

    def ended(token):
        return functools.reduce(jnp.logical_or, [token == e for e in ends], jnp.zeros(token.shape, bool))

    logits, _, cache = model(padded, cache=cache)
    vocab = logits.shape[-1]
    seen = None
    if penalty != 1.0:  # the ids each row holds: its prompt's (padding left out), then each token drawn
        valid = jnp.arange(padded.shape[1])[None] < lengths[:, None]
        at = jnp.where(valid, padded, vocab)  # out of range: dropped
        seen = jnp.zeros((batch, vocab), bool).at[rows[:, None], at].set(True, mode="drop")
    # Prefill wrote every padded position; roll each sequence back to its true length (positions beyond are
    # overwritten by the decode steps and never attended before that, by causality).
    cache = cache.advance(lengths - padded.shape[1])
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    keys = jax.random.split(key, max_new_tokens)
    first = sample(last, keys[0], seen)

    def step(carry, step_key):
        cache, token, done, seen = carry
        emitted = jnp.where(done, pad_id, token)
        done = done | ended(token)
        if seen is not None:
            seen = seen.at[rows, token].set(True)
        logits, _, cache = model(token[:, None], cache=cache)
        return (cache, sample(logits[:, 0], step_key, seen), done, seen), emitted

    done0 = jnp.zeros(first.shape, bool)
    (_, last_token, done, _), out = jax.lax.scan(step, (cache, first, done0, seen), keys[1:])
    tail = jnp.where(done, pad_id, last_token)[None]
    return jnp.concatenate([out, tail], axis=0).T
