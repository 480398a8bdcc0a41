"""The serving engine's compiled programs (`kvcache.serving.engine.Engine` runs them): one step over a ragged
batch (`forward`), several decode steps of a batch in one call (`decode_steps`), and the sampler on given logits
(`draw_jit`).

`forward` sees the whole batch as one row of tokens with explicit positions: their keys and values are quantised
into the pool on write (`FlatBatchCache`) and each token attends its own sequence's cache with
`kvcache.unified_attention` (causal inside a chunk); it ends with `core.sampling` on each sequence's last token
(`draw`), so only small arrays come back to the host. `decode_steps` runs K such steps of a batch in which every
sequence decodes, as a scan on the device: each step's drawn tokens are the next step's inputs, each token's slot
is found in its sequence's block table there, and the K steps' draws come back together, so the host's per-step
work (scheduling, building the batch, the call, reading the result) is paid once per K tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from core import sampling
from kvcache import attention
from kvcache.paged import PagedPool

__all__ = ["FlatBatchCache", "Static", "bucket", "decode_steps", "draw", "draw_jit", "forward"]


@struct.dataclass
class FlatBatchCache:
    """`core.attention.KVCache` for one engine step: the model sees the whole ragged batch as one row of tokens
    (explicit positions); this cache writes their K/V to their slots and runs unified attention."""

    pool: PagedPool
    slots: jax.Array  # [N]
    block_tables: jax.Array  # [S, MB]
    seq_lens: jax.Array  # [S]
    query_start_loc: jax.Array  # [S + 1]
    max_query_len: int = struct.field(pytree_node=False)
    implementation: str = struct.field(pytree_node=False)
    interpret: bool | None = struct.field(pytree_node=False, default=None)

    @property
    def lengths(self):
        return self.seq_lens

    def update_and_attend(self, layer, q, k, v):
        """Writes and attends layer `layer` (a Python int) in place (`PagedPool.as_one_layer`)."""
        kw: dict[str, Any] = dict(fmt=self.pool.fmt, implementation=self.implementation, interpret=self.interpret)
        merged, first = self.pool.as_one_layer(layer)
        slots = jnp.where(self.slots >= 0, self.slots + first * self.pool.block_size, -1)
        fields = attention.write(merged, k[0], v[0], slots, **kw)
        out = attention.unified_attention(
            q[0],
            fields,
            self.block_tables + first,
            self.seq_lens,
            self.query_start_loc,
            max_query_len=self.max_query_len,
            **kw,
        )
        return out[None].astype(q.dtype), dataclasses.replace(self, pool=self.pool.from_one_layer(fields))

    def advance(self, num_tokens):
        return self


class Static:
    """A static argument hashed once: jit hashes and compares its static arguments on every call, and hashing an
    `nnx.GraphDef` walks the whole module graph (about a millisecond per step for a 4-layer model)."""

    def __init__(self, value):
        self.value, self._hash = value, hash(value)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (isinstance(other, Static) and self.value == other.value)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "max_query_len", "implementation", "interpret"), donate_argnums=(2,)
)
def forward(
    graphdef,
    state,
    pool,
    tokens,
    positions,
    slots,
    block_tables,
    seq_lens,
    query_start_loc,
    last,
    params,
    words,
    allowed,
    masks,
    *,
    max_query_len,
    implementation,
    interpret=None,
):
    """One step: the model over the batch's N tokens, then `draw` of each sequence row's logits at `last` [S].
    Returns (`draw`'s arrays, the pool). `graphdef`: a `Static` of the model's graphdef and its state's treedef;
    `state`: the state's leaves (a flat list crosses the call faster than the nnx.State pytree). `interpret`: the
    Pallas kernels' (`kvcache.attention`; None: by backend; False lowers them compiled from any host)."""
    model_graph, treedef = graphdef.value
    model = nnx.merge(model_graph, jax.tree.unflatten(treedef, state))
    cache = FlatBatchCache(
        pool, slots, block_tables, seq_lens, query_start_loc, max_query_len, implementation, interpret
    )
    logits, _, cache = model(tokens[None], positions=positions[None], cache=cache)
    return draw(logits[0, last], params, words, allowed, masks), cache.pool


def draw(logits, params, words, allowed, masks=None, *, plain=False):
    """Row s of logits [S, V]: its token drawn by `core.sampling.sample` with temperature params[s, 0], top_p
    params[s, 1], min_p params[s, 2], top_k words[s, 0] and the key of `core.sampling.key_words` words[s, 1:] over
    the `allowed` ids (bool [V]); with `masks` (uint32 [S, W] twice, `core.sampling.pack_ids`: the ids each row's
    repetition penalty params[s, 3] applies to, the ids it may not sample now), those too. And
    `core.sampling.logprobs` of it: (tokens [S], logprob [S], top ids [S, 20], top logprobs [S, 20]). `plain`
    (static; every row greedy, none recording log-probabilities, no masks): the same tokens by `core.sampling`'s
    greedy path alone, the log-probabilities zeros."""
    logits = logits.astype(jnp.float32)
    if plain:
        drawn = sampling.sample(logits, sampling.keys_from_words(words[:, 1:]), temperature=0, allowed=allowed)
        rows, top = logits.shape[0], min(sampling.MAX_TOP_LOGPROBS, logits.shape[-1])
        return drawn, jnp.zeros(rows), jnp.zeros((rows, top), jnp.int32), jnp.zeros((rows, top))
    seen = banned = None
    if masks is not None:
        seen, banned = (sampling.unpack_ids(m, logits.shape[-1]) for m in masks)
    drawn = sampling.sample(
        logits,
        sampling.keys_from_words(words[:, 1:]),
        temperature=params[:, 0],
        top_k=words[:, 0].astype(jnp.int32),
        top_p=params[:, 1],
        min_p=params[:, 2],
        allowed=allowed,
        banned=banned,
        repetition_penalty=params[:, 3],
        seen=seen,
    )
    return (drawn, *sampling.logprobs(logits, drawn, allowed=allowed))


draw_jit = jax.jit(draw)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "block_size", "implementation", "interpret", "plain"), donate_argnums=(2,)
)
def decode_steps(
    graphdef,
    state,
    pool,
    tokens,
    positions,
    live,
    block_tables,
    seq_lens,
    query_start_loc,
    last,
    params,
    words,
    allowed,
    *,
    block_size,
    implementation,
    interpret=None,
    plain=False,
):
    """K = words.shape[0] decode steps of a batch whose sequence i computes token i (`forward`'s arguments for
    such a batch at its first step: `tokens`, `positions` [N]; `live` bool [N]: token i is sequence i's, the others
    padding; `block_tables` [S, MB] holding every block the K steps write; `seq_lens`, `query_start_loc`, `last`;
    `params` the rows' sampling parameters, `words` [K, S, 5] each step's). Step t computes the tokens at positions
    + t (the live ones written to their slots, `block_tables[i, p // block_size] * block_size + p % block_size`,
    the padding ones to none) and draws each sequence's next token, which step t + 1 computes. Returns
    (`draw`'s arrays stacked over the K steps, [K, S, ...]; the pool). Every step is the program `forward` runs for
    a decode batch (one query per sequence): a sequence's tokens equal those of K single steps. `plain`: `draw`'s."""
    model_graph, treedef = graphdef.value
    model = nnx.merge(model_graph, jax.tree.unflatten(treedef, state))
    rows = block_tables.shape[0]
    row = jnp.minimum(jnp.arange(tokens.shape[0]), rows - 1)  # token i's sequence (live tokens: i < rows - 1)
    grows = jnp.zeros(rows, jnp.int32).at[row].max(live.astype(jnp.int32))  # sequences whose length grows

    def one(carry, step_words):
        pool, tokens, t = carry
        pos = positions + t * live
        slots = jnp.where(live, block_tables[row, pos // block_size] * block_size + pos % block_size, -1)
        cache = FlatBatchCache(
            pool, slots, block_tables, seq_lens + t * grows, query_start_loc, 1, implementation, interpret
        )
        logits, _, cache = model(tokens[None], positions=pos[None], cache=cache)
        drawn = draw(logits[0, last], params, step_words, allowed, None, plain=plain)
        tokens = jnp.where(live, drawn[0][row], tokens)
        return (cache.pool, tokens, t + 1), drawn

    (pool, _, _), drawn = jax.lax.scan(one, (pool, tokens, jnp.int32(0)), words)
    return drawn, pool


def bucket(num_tokens: int, minimum: int = 16) -> int:
    """Padded batch size: the next power of two, at least `minimum` (few distinct compiled shapes; the K-step
    decode programs pad to 1, 2, 4, ...: a batch of one sequence computes one token per step, not 16)."""
    return max(minimum, 1 << (num_tokens - 1).bit_length())
