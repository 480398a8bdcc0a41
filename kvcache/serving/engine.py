"""The serving engine: an engine core holding the scheduler (`kvcache.serving.scheduler`) that runs a
`core.model.Transformer` over a paged, quantised KV pool, sampling on the device.

Every step is schedule -> execute -> update_from_output (`EngineCore.step`); executing runs one jitted program
(`_forward`) over the scheduler's ragged batch, seen by the model as one row of tokens with explicit positions:
their keys and values are quantised into the pool on write and each token attends its own sequence's cache with
`kvcache.unified_attention` (causal inside a chunk). The program ends with `core.sampling` on the last token of
each sequence: per row its request's temperature, top_k, top_p, min_p and key
(a seeded request's token i: the key of (seed, i), `core.sampling.key_words`; others: the engine's stream of
`EngineConfig.seed`), and the log-probabilities (the chosen id's and the `MAX_TOP_LOGPROBS` best) over the ids the
config lets it sample. Only those small arrays come back to the host. A batch in which some request has a
repetition penalty, or may not end yet (min_tokens), also sends each row's ids as bits (`core.sampling.pack_ids`:
the prompt's and output's, its end ids): another compiled program, which `Engine.warmup(masked=True)` compiles too.

Memory: the pool is `memory_bytes` of blocks in the chosen format (`kvcache.capacity.num_blocks`), so fp4 holds
about 3.76x the tokens of bf16 (docs/kvcache.md). Batches are padded to a power of two of at least 16 tokens, so the
steps run a few compiled programs, all of which `Engine.warmup` compiles before serving.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from core import sampling
from kvcache import attention
from kvcache.formats import Format
from kvcache.paged import PagedPool
from kvcache.serving.config import EngineConfig
from kvcache.serving.scheduler import EngineCore, Request, Scheduler

if TYPE_CHECKING:
    from core.model import Transformer

__all__ = ["Engine"]

_ENGINE_STREAM, _REQUEST_STREAM = 1, 0  # `core.sampling.key_words` streams: the engine's, a seeded request's


@struct.dataclass
class _FlatBatchCache:
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
        kw: dict[str, Any] = dict(fmt=self.pool.fmt, implementation=self.implementation, interpret=self.interpret)
        fields = attention.write(self.pool.layer(layer), k[0], v[0], self.slots, **kw)
        out = attention.unified_attention(
            q[0], fields, self.block_tables, self.seq_lens, self.query_start_loc, max_query_len=self.max_query_len, **kw
        )
        pool = dataclasses.replace(
            self.pool, fields={n: x.at[layer].set(fields[n]) for n, x in self.pool.fields.items()}
        )
        return out[None].astype(q.dtype), dataclasses.replace(self, pool=pool)

    def advance(self, num_tokens):
        return self


class _Static:
    """A static argument hashed once: jit hashes and compares its static arguments on every call, and hashing an
    `nnx.GraphDef` walks the whole module graph (about a millisecond per step for a 4-layer model)."""

    def __init__(self, value):
        self.value, self._hash = value, hash(value)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (isinstance(other, _Static) and self.value == other.value)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "max_query_len", "implementation", "interpret"), donate_argnums=(2,)
)
def _forward(
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
    """One step: the model over the batch's N tokens, then `_draw` of each sequence row's logits at `last` [S].
    Returns (`_draw`'s arrays, the pool). `graphdef`: a `_Static` of the model's graphdef and its state's treedef;
    `state`: the state's leaves (a flat list crosses the call faster than the nnx.State pytree). `interpret`: the
    Pallas kernels' (`kvcache.attention`; None: by backend; False lowers them compiled from any host)."""
    model_graph, treedef = graphdef.value
    model = nnx.merge(model_graph, jax.tree.unflatten(treedef, state))
    cache = _FlatBatchCache(
        pool, slots, block_tables, seq_lens, query_start_loc, max_query_len, implementation, interpret
    )
    logits, _, cache = model(tokens[None], positions=positions[None], cache=cache)
    return _draw(logits[0, last], params, words, allowed, masks), cache.pool


def _draw(logits, params, words, allowed, masks=None):
    """Row s of logits [S, V]: its token drawn by `core.sampling.sample` with temperature params[s, 0], top_p
    params[s, 1], min_p params[s, 2], top_k words[s, 0] and the key of `core.sampling.key_words` words[s, 1:] over
    the `allowed` ids (bool [V]); with `masks` (uint32 [S, W] twice, `core.sampling.pack_ids`: the ids each row's
    repetition penalty params[s, 3] applies to, the ids it may not sample now), those too. And
    `core.sampling.logprobs` of it: (tokens [S], logprob [S], top ids [S, 20], top logprobs [S, 20])."""
    logits = logits.astype(jnp.float32)
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


_draw_jit = jax.jit(_draw)


class Engine(EngineCore):
    """Continuous-batching server of a `core.model.Transformer` over a paged KV pool in format `fmt` (the pool:
    `config.memory_bytes` of whole blocks of `config.block_size` tokens for every layer). It holds its `scheduler`
    (a `Scheduler` over the pool's blocks that takes the ids of the model's vocabulary: [0, vocab_size)) and runs its
    batches. `allowed` (bool [vocab_size]) holds the ids it may sample: not in `config.never` and below
    `config.num_ids`."""

    def __init__(self, model: Transformer, fmt: Format, config: EngineConfig):
        cfg = model.cfg
        graphdef, state = nnx.split(model)
        self.state, treedef = jax.tree.flatten(state)
        self.graphdef = _Static((graphdef, treedef))
        self.pool = PagedPool.create(
            fmt,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=config.block_size,
            memory_bytes=config.memory_bytes,
        )
        super().__init__(Scheduler(config, fmt, self.pool.num_blocks, vocab_size=cfg.vocab_size))
        self.vocab_size = cfg.vocab_size  # token ids a prompt may hold: [0, vocab_size)
        self.allowed = sampling.allowed_ids(cfg.vocab_size, config.never, config.num_ids)  # bool [vocab_size]
        self._allowed = jnp.asarray(self.allowed)
        self._executed = 0  # batches run: the engine stream's draw index is (batch, row)

    def _execute(self, batch):
        bs, s_max = self.config.block_size, self.config.max_num_seqs + 1  # + 1 row for the padding tokens
        n_real = sum(n for _, n in batch)
        n_pad = _bucket(n_real)
        tokens, positions = np.zeros(n_pad, np.int32), np.zeros(n_pad, np.int32)
        slots = np.full(n_pad, -1, np.int32)
        tables = np.zeros((s_max, self.max_blocks), np.int32)
        seq_lens, qsl, last = np.ones(s_max, np.int32), np.zeros(s_max + 1, np.int32), np.zeros(s_max, np.int32)
        at = 0
        for i, (request, n) in enumerate(batch):
            pos = np.arange(request.num_computed, request.num_computed + n)
            tokens[at : at + n] = request.tokens[request.num_computed : request.num_computed + n]
            positions[at : at + n] = pos
            table = np.asarray(request.blocks, np.int32)
            slots[at : at + n] = table[pos // bs] * bs + pos % bs
            tables[i, : len(table)] = table
            seq_lens[i] = request.num_computed + n
            at += n
            qsl[i + 1], last[i] = at, at - 1
        qsl[len(batch) + 1 :] = at
        # The padding tokens are the last row's chunk; it "holds" as many keys as it has queries (block 0 repeated:
        # finite garbage, never written, results discarded), so every padding query sees at least one key.
        qsl[s_max], seq_lens[s_max - 1] = n_pad, max(1, n_pad - at)
        # A batch of decode tokens only attends one query per sequence (the padding row's queries past the first
        # read that one's output back: discarded all the same), else queries up to the padded batch size.
        max_query_len = 1 if all(n == 1 for _, n in batch) else n_pad
        params, words, masks = self._sampling_rows(batch, s_max)
        sampled, self.pool = _forward(
            self.graphdef,
            self.state,
            self.pool,
            tokens,  # NumPy arrays: the call moves them to the device, no op of their own
            positions,
            slots,
            tables,
            seq_lens,
            qsl,
            last,
            params,
            words,
            self._allowed,
            masks,
            max_query_len=max_query_len,
            implementation=self.config.implementation,
        )
        self._executed += 1
        drawn, chosen, top_ids, top_logp = jax.device_get(sampled)
        out: list[int | None] = []
        for i, (request, n) in enumerate(batch):
            if request.num_computed + n < len(request.tokens):
                out.append(None)  # prefill not done: its sample is not a token
                continue
            self._record(request, chosen[i], top_ids[i], top_logp[i])
            out.append(int(drawn[i]))
        return out

    def _sample(self, logits: np.ndarray, request: Request, count: int = 1) -> list[int]:
        """The next `count` tokens of `request`, each drawn from the same logits (float32 [vocab]) exactly as
        successive steps draw them (the same sampler, each token's key and log-probability records), in one device
        call; appended to `request.output` and returned. (A seeded request's key follows its token index; an
        unseeded one's follows the engine's step count, which this does not advance.)"""
        start = len(request.output)
        ahead = [dataclasses.replace(request, output=[0] * (start + t)) for t in range(count)]  # token start + t
        params, words, masks = self._sampling_rows([(r, 0) for r in ahead], count)
        args = (jnp.broadcast_to(jnp.asarray(logits), (count, len(logits))), params, words, self._allowed, masks)
        drawn, chosen, top_ids, top_logp = jax.device_get(_draw_jit(*args))
        for i in range(count):
            self._record(request, chosen[i], top_ids[i], top_logp[i])
        request.output.extend(int(t) for t in drawn)
        return [int(t) for t in drawn]

    @staticmethod
    def _record(request: Request, logprob, top_ids, top_logp) -> None:
        """Appends the drawn token's log-probability and its `top_logprobs` best alternatives, if it asks for them."""
        if request.sampling.logprobs:
            request.logprobs.append(float(logprob))
            best = range(request.sampling.top_logprobs)
            request.top_logprobs.append([(int(top_ids[j]), float(top_logp[j])) for j in best])

    def _sampling_rows(
        self, batch: list[tuple[Request, int]], rows: int
    ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """(float32 [rows, 4]: temperature, top_p, min_p, repetition penalty; uint32 [rows, 5]: top_k and the key's
        `core.sampling.key_words`; None, or when some entry has a repetition penalty or may not end yet (fewer
        tokens than its min_tokens) uint32 [rows, W] twice: each row's prompt and output ids, its banned end ids,
        as `core.sampling.pack_ids` bits) of each batch entry's request; rows past the batch are greedy."""
        params = np.zeros((rows, 4), np.float32)
        params[:, 1] = params[:, 3] = 1.0
        words = np.zeros((rows, 5), np.uint32)
        for i, (request, _) in enumerate(batch):
            p = request.sampling
            temperature = self.config.temperature if p.temperature is None else p.temperature
            params[i] = (temperature, p.top_p, p.min_p, p.repetition_penalty)
            if p.seed is not None:
                key = sampling.key_words(p.seed, len(request.output), _REQUEST_STREAM)
            else:
                key = sampling.key_words(self.config.seed, (self._executed * rows + i) % 2**32, _ENGINE_STREAM)
            words[i] = (min(p.top_k, self.vocab_size), *key)
        if not any(r.sampling.repetition_penalty != 1 or self._banned(r) for r, _ in batch):
            return params, words, None
        width = -(-self.vocab_size // 32)
        seen, banned = np.zeros((rows, width), np.uint32), np.zeros((rows, width), np.uint32)
        for i, (request, _) in enumerate(batch):
            if request.sampling.repetition_penalty != 1:
                seen[i] = self._seen(request)
            if self._banned(request):
                banned[i] = sampling.pack_ids(sorted(self._ends(request)), self.vocab_size)
        return params, words, (seen, banned)

    def _ends(self, request: Request) -> set[int]:
        """The ids min_tokens keeps `request` from sampling: every end id, EOS included even when it ignores EOS
        (vLLM's rule)."""
        return {*self.config.end_ids, *request.sampling.stop_token_ids}

    def _banned(self, request: Request) -> bool:
        return len(request.output) < request.sampling.min_tokens and bool(self._ends(request))

    def _seen(self, request: Request) -> np.ndarray:
        """`request`'s prompt and output ids as `core.sampling.pack_ids` bits, kept on the request and extended by
        the tokens added since."""
        tokens = request.prompt + request.output
        if request.seen is None:
            request.seen, request.seen_count = np.zeros(-(-self.vocab_size // 32), np.uint32), 0
        if request.seen_count < len(tokens):
            request.seen = request.seen | sampling.pack_ids(tokens[request.seen_count :], self.vocab_size)
            request.seen_count = len(tokens)
        return request.seen

    def warmup(self, *, masked: bool = False) -> None:
        """Compiles the step for every batch-size bucket (slots all -1: the pool is not written), and for the
        buckets a batch of decode tokens fills its decode-only variant (one query per sequence), so that no
        request's time to first token pays for compilation. The first bucket runs twice: first given the pool as
        created, then the pool as a step returns it (placed as the step's output, which may differ from the new
        pool's placement and is then another program: the one every later step of that size runs). `masked`: the
        variants of batches with a repetition penalty or min_tokens too (twice the programs; without it, the first
        such batch of each shape compiles its own)."""
        s_max = self.config.max_num_seqs + 1
        sizes = sorted({_bucket(n) for n in range(1, self.config.max_num_batched_tokens + 1)})
        decode = [n for n in sizes if n <= _bucket(self.config.max_num_seqs)]
        shapes = [*((n, n) for n in sizes), (sizes[0], sizes[0]), *((n, 1) for n in decode)]
        width = -(-self.vocab_size // 32)
        empty = np.zeros((s_max, width), np.uint32)
        for (n, max_query_len), masks in [(shape, None) for shape in shapes] + (
            [(shape, (empty, empty)) for shape in shapes] if masked else []
        ):
            qsl = np.zeros(s_max + 1, np.int32)
            qsl[-1] = n
            seq_lens = np.ones(s_max, np.int32)
            seq_lens[-1] = n
            sampled, self.pool = _forward(
                self.graphdef,
                self.state,
                self.pool,
                np.zeros(n, np.int32),  # NumPy arrays, as `_execute` passes them: no other programs
                np.arange(n, dtype=np.int32),
                np.full(n, -1, np.int32),
                np.zeros((s_max, self.max_blocks), np.int32),
                seq_lens,
                qsl,
                np.zeros(s_max, np.int32),
                *self._sampling_rows([], s_max)[:2],
                self._allowed,
                masks,
                max_query_len=max_query_len,
                implementation=self.config.implementation,
            )
            jax.block_until_ready(sampled)


def _bucket(num_tokens: int) -> int:
    """Padded batch size: the next power of two, at least 16 (few distinct compiled shapes)."""
    return max(16, 1 << (num_tokens - 1).bit_length())
