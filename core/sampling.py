"""The one on-device sampler: `core.generate` and the serving engine (`kvcache.serving`) draw their tokens with it.

Per row b of logits [B, V] (float32), with the ids a tokenizer never samples masked out (`allowed_ids`) and the
row's own banned ids too (`banned`: a request's end ids before its min_tokens), then vLLM's and transformers'
repetition penalty (`penalize`: each id in the row's prompt or output, `seen`, has a positive logit divided by
repetition_penalty_b, a negative one multiplied by it):

    greedy (temperature_b == 0):  argmax_i logits_bi (the lowest id among equal maxima)
    else:  z = logits_b / temperature_b;
           min_p (p_min_b > 0):   ids whose probability softmax(z) is below p_min_b x the largest are cut;
           top_k (0 < k_b < V):   ids below the k-th largest z are cut (ties with it are kept);
           top_p (p_b < 1):       in descending order of the top-k-renormalised probabilities, the ids whose
                                  preceding mass is below p_b are kept (so the smallest set reaching p_b), the
                                  rest cut (ties with the last kept value are kept);
           token ~ softmax(z over the kept ids)  (Gumbel-max: argmax_i z_i + g_i, g = Gumbel noise of key_b)

as Hugging Face's and vLLM's samplers apply temperature, min-p, top-k and top-p (vLLM `v1/sample/sampler`):
the cut is found on a descending sort of z on the device (`jax.lax.sort`, skipped by `lax.cond` when no row
cuts), never on the host. The noise is drawn per row in id order, so a row's token depends only on its logits,
its parameters and its key, not on the other rows or on whether the batch needed the sort.

Keys: generation splits one key per step; the engine gives a seeded request the key of (its seed, its token
index): `key_words(seed, index)` -> `keys_from_words`, a reproducible stream whatever else runs.

`logprobs` reports what vLLM and OpenAI report: log_softmax of the logits over the allowed ids, before the
penalty, temperature and the cuts, for the chosen token and the `MAX_TOP_LOGPROBS` most likely ids.

Per-row id sets cross to the device as bits (`pack_ids` on the host: uint32 [W] words, id i is bit i % 32 of word
i // 32; `unpack_ids` on the device), 1/32 of a bool mask's bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MAX_TOP_LOGPROBS",
    "allowed_ids",
    "cut",
    "cut_min_p",
    "key_words",
    "keys_from_words",
    "logprobs",
    "pack_ids",
    "penalize",
    "sample",
    "unpack_ids",
]

MAX_TOP_LOGPROBS = 20  # alternatives a request may ask for per token (OpenAI's chat limit)
_WORD = 2**32


def allowed_ids(vocab_size: int, never: Sequence[int] = (), num_ids: int | None = None) -> np.ndarray:
    """bool [vocab_size]: the ids a sampler may produce: not in `never` and below `num_ids` (None: no limit); ids
    of `never` at or past vocab_size are ignored."""
    keep = np.ones(vocab_size, bool)
    keep[[t for t in never if t < vocab_size]] = False
    if num_ids is not None:
        keep[num_ids:] = False
    return keep


def pack_ids(ids: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """uint32 [ceil(vocab_size / 32)]: bit i % 32 of word i // 32 set for each id i in `ids` (in [0, vocab_size))."""
    ids = np.asarray(ids, np.int64)
    words = np.zeros(-(-vocab_size // 32), np.uint32)  # O(len(ids)) besides these words: no [vocab_size] buffer
    np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return words


def unpack_ids(words: jax.Array, vocab_size: int) -> jax.Array:
    """bool [..., vocab_size] of `pack_ids`' uint32 words [..., W] (on the device)."""
    ids = jnp.arange(vocab_size, dtype=jnp.uint32)
    return ((words[..., ids // 32] >> (ids % 32)) & 1).astype(bool)


def penalize(logits: jax.Array, seen: jax.Array, penalty) -> jax.Array:
    """Repetition penalty as vLLM and transformers apply it: logits [B, V] with each `seen` id's (bool [B, V]) logit
    divided by penalty_b if positive, multiplied by it otherwise. penalty: a number or [B], > 0 (1: none)."""
    p = _rows(penalty, logits.shape[0], jnp.float32)[:, None]
    return jnp.where(seen, jnp.where(logits > 0, logits / p, logits * p), logits)


def key_words(seed: int, index: int, stream: int = 0) -> tuple[int, int, int, int]:
    """The four uint32 words (seed low, seed high, stream, index) of the key `keys_from_words` makes for draw
    `index` of stream `stream` of `seed`. seed in [0, 2^64); stream and index in [0, 2^32). ValueError otherwise."""
    for name, value, bound in (("seed", seed, _WORD * _WORD), ("stream", stream, _WORD), ("index", index, _WORD)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < bound:
            raise ValueError(f"{name} = {value!r}; must be an integer in [0, {bound})")
    seed = int(seed)
    return seed % _WORD, seed // _WORD, int(stream), int(index)


def keys_from_words(words: jax.Array | np.ndarray) -> jax.Array:
    """uint32 [B, 4] `key_words` rows -> B typed PRNG keys: fold_in(fold_in(fold_in(key(lo), hi), stream), index)."""
    words = jnp.asarray(words, jnp.uint32)

    def one(w):
        key = jax.random.key(w[0])
        for word in (w[1], w[2], w[3]):
            key = jax.random.fold_in(key, word)
        return key

    return jax.vmap(one)(words)


def _rows(value, batch: int, dtype) -> jax.Array:
    return jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))


def cut_min_p(z: jax.Array, min_p) -> jax.Array:
    """z [B, V] (temperature-scaled logits) with the ids whose probability is below min_p_b x the row's largest set
    to -inf: z_i < max z + log(min_p_b). min_p: a number or [B] in [0, 1] (0: no cut)."""
    p = _rows(min_p, z.shape[0], jnp.float32)[:, None]
    floor = jnp.max(z, axis=-1, keepdims=True) + jnp.log(jnp.maximum(p, 1e-38))
    return jnp.where((p > 0) & (z < floor), -jnp.inf, z)


def cut(z: jax.Array, top_k, top_p) -> jax.Array:
    """z [B, V] float32 (temperature-scaled logits, -inf for masked ids) with the ids top-k and top-p remove set
    to -inf (the module docstring). top_k: int or int [B] (0 or >= V: no cut); top_p: float or float [B] in (0, 1]
    (1: no cut)."""
    batch, vocab = z.shape
    k, p = _rows(top_k, batch, jnp.int32), _rows(top_p, batch, jnp.float32)
    ordered = -jax.lax.sort(-z, dimension=-1)  # descending
    kth = jnp.take_along_axis(ordered, jnp.clip(k - 1, 0, vocab - 1)[:, None], axis=-1)
    kth = jnp.where(((k > 0) & (k < vocab))[:, None], kth, -jnp.inf)
    ordered = jnp.where(ordered >= kth, ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely ids
    kept = (before < p[:, None]) & (probs > 0)
    last = jnp.maximum(jnp.sum(kept, axis=-1) - 1, 0)  # kept ranks are a prefix: the last one's value is the cut
    pth = jnp.take_along_axis(ordered, last[:, None], axis=-1)
    pth = jnp.where((p < 1)[:, None], pth, -jnp.inf)
    return jnp.where(z >= jnp.maximum(kth, pth), z, -jnp.inf)


def sample(
    logits: jax.Array,
    keys: jax.Array,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    allowed: jax.Array | np.ndarray | None = None,
    banned: jax.Array | None = None,
    repetition_penalty=1.0,
    seen: jax.Array | None = None,
) -> jax.Array:
    """logits [B, V] -> tokens int32 [B] (the module docstring's rule).

    Args:
      logits: [B, V] float logits.
      keys: B typed PRNG keys, one per row (unused by greedy rows; may be None when `temperature` is the Python
        number 0).
      temperature, top_k, top_p, min_p, repetition_penalty: Python numbers (the same for every row) or arrays [B];
        temperature >= 0 (0: greedy), top_k >= 0 (0: all), top_p in (0, 1], min_p in [0, 1] (0: none),
        repetition_penalty > 0 (1: none).
      allowed: bool [V] ids that may be sampled (None: all).
      banned: bool [B, V] ids each row may not sample now (None: none).
      seen: bool [B, V] the ids each row's repetition penalty applies to (None: no penalty).
    """
    logits = logits.astype(jnp.float32)
    if allowed is not None:
        logits = jnp.where(jnp.asarray(allowed), logits, -jnp.inf)
    if banned is not None:
        logits = jnp.where(banned, -jnp.inf, logits)
    if seen is not None:
        logits = penalize(logits, seen, repetition_penalty)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if isinstance(temperature, (int, float)) and temperature == 0:
        return greedy
    batch, vocab = logits.shape
    t = _rows(temperature, batch, jnp.float32)
    z = logits / jnp.where(t > 0, t, 1.0)[:, None]
    if not isinstance(min_p, (int, float)):
        z = jax.lax.cond(jnp.any(jnp.asarray(min_p) > 0), lambda z: cut_min_p(z, min_p), lambda z: z, z)
    elif min_p > 0:
        z = cut_min_p(z, min_p)
    static = all(isinstance(x, (int, float)) for x in (top_k, top_p))
    if not static:  # some rows may cut: sort only if one does
        k, p = _rows(top_k, batch, jnp.int32), _rows(top_p, batch, jnp.float32)
        cuts = jnp.any(((k > 0) & (k < vocab)) | (p < 1))
        z = jax.lax.cond(cuts, lambda z: cut(z, k, p), lambda z: z, z)
    elif 0 < top_k < vocab or top_p < 1:
        z = cut(z, top_k, top_p)
    drawn = jax.vmap(jax.random.categorical)(keys, z).astype(jnp.int32)
    return jnp.where(t > 0, drawn, greedy)


def logprobs(
    logits: jax.Array,
    tokens: jax.Array,
    *,
    allowed: jax.Array | np.ndarray | None = None,
    num_top: int = MAX_TOP_LOGPROBS,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logprob of each row's token [B], the `num_top` most likely ids int32 [B, n] best first (lower id first among
    equals), their logprobs [B, n]) under log_softmax(logits) over the allowed ids (-inf elsewhere); n = min(num_top,
    V). Temperature and cuts do not enter (as vLLM reports them)."""
    logits = logits.astype(jnp.float32)
    if allowed is not None:
        logits = jnp.where(jnp.asarray(allowed), logits, -jnp.inf)
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top, ids = jax.lax.top_k(logp, min(num_top, logp.shape[-1]))
    return chosen, ids.astype(jnp.int32), top
