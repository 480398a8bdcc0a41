"""The serving engine: an engine core holding the scheduler (`kvcache.serving.scheduler`) that runs a
`core.model.Transformer` over a paged, quantised KV pool, sampling on the device.

Every step is schedule -> execute -> update_from_output (`Engine.step`); executing runs one jitted program
(`kvcache.serving.programs.forward`) over the scheduler's ragged batch, seen by the model as one row of tokens with
explicit positions: their keys and values are quantised into the pool on write and each token attends its own
sequence's cache with `kvcache.unified_attention` (causal inside a chunk). The program ends with `core.sampling` on
the last token of each sequence: per row its request's temperature, top_k, top_p, min_p and key (a seeded
request's token i: the key of (seed, i), `core.sampling.key_words`; others: the engine's stream of
`EngineConfig.seed`), and the log-probabilities (the chosen id's and the `MAX_TOP_LOGPROBS` best) over the ids the
config lets it sample. Only those small arrays come back to the host. A batch in which some request has a
repetition penalty, or may not end yet (min_tokens), also sends each row's ids as bits (`core.sampling.pack_ids`:
the prompt's and output's, its end ids): another compiled program, which `Engine.warmup(masked=True)` compiles too.

Decoding several steps per call: when every scheduled sequence decodes, no request waits, none has such masks and
each has room for `EngineConfig.decode_steps` = K more tokens in its block table, the engine reserves the blocks of
K tokens per sequence and runs K steps in one call (`programs.decode_steps`), drawing every token with the key a
step of its own would use: the tokens are the same as K single steps' (an unseeded request's key follows its row in
the batch, which a request ahead of it ending inside the call does not shift as the next single step's batch would:
its tokens then differ, as they do in any other batch). The scheduler then takes them step by step (a sequence that
ends at step t takes none after it; what the device computed past an end is discarded, so a request with fewer than
K tokens left to its max_new_tokens runs one such call, not single steps). A request that arrives during
such a call waits for its end, and its tokens reach the host K at a time.

Memory: the pool is `memory_bytes` of blocks in the chosen format (`kvcache.capacity.num_blocks`), so fp4 holds
about 3.76x the tokens of bf16 (docs/kvcache.md). Batches are padded to a power of two of at least 16 tokens (the
K-step decode batches: of at least 1), so the steps run a few compiled programs, all of which `Engine.warmup`
compiles before serving.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core import sampling
from kvcache.formats import Format
from kvcache.paged import PagedPool
from kvcache.serving.config import EngineConfig
from kvcache.serving.programs import Static, bucket, decode_steps, draw_jit, forward
from kvcache.serving.scheduler import EngineCore, Request, Scheduler

if TYPE_CHECKING:
    from core.model import Transformer

__all__ = ["Engine"]

_ENGINE_STREAM, _REQUEST_STREAM = 1, 0  # `core.sampling.key_words` streams: the engine's, a seeded request's


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
        self.graphdef = Static((graphdef, treedef))
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

    def step(self) -> list[Request]:
        """Schedules, runs and takes back one batch, or K decode steps of it (module docstring); returns the
        requests that finished ([] when idle)."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        steps = self._steps_ahead(batch)
        if steps == 1:
            return self.scheduler.update_from_output(batch, self._execute(batch))
        return self._execute_steps(batch, steps)

    def _steps_ahead(self, batch: list[tuple[Request, int]]) -> int:
        """K = `config.decode_steps` when the batch may run K decode steps in one call (module docstring; the
        blocks of K tokens per sequence then reserved), else 1."""
        k = self.config.decode_steps
        if k == 1 or self.scheduler.waiting:
            return 1
        for request, n in batch:
            p = request.sampling
            decoding = n == 1 and request.num_computed + 1 == len(request.tokens)
            if not decoding or request.num_computed + k > self.max_blocks * self.config.block_size:
                return 1
            if p.repetition_penalty != 1 or self._banned(request):  # (not banned now: never again)
                return 1
        return k if self.scheduler.reserve([r for r, _ in batch], k) else 1

    def _arrays(self, batch: list[tuple[Request, int]], minimum: int = 16) -> tuple[list[np.ndarray], int]:
        """(`programs.forward`'s batch arrays: tokens, positions, slots [N]; block tables [S, MB]; seq_lens,
        query_start_loc, last; and max_query_len) of `batch`, N its token count padded by `bucket(.., minimum)`,
        S = max_num_seqs + 1 rows."""
        bs, s_max = self.config.block_size, self.config.max_num_seqs + 1  # + 1 row for the padding tokens
        n_real = sum(n for _, n in batch)
        n_pad = bucket(n_real, minimum)
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
        return [tokens, positions, slots, tables, seq_lens, qsl, last], max_query_len

    def _execute(self, batch):
        arrays, max_query_len = self._arrays(batch)  # NumPy arrays: the call moves them to the device
        params, words, masks = self._sampling_rows(batch, self.config.max_num_seqs + 1)
        sampled, self.pool = forward(
            self.graphdef,
            self.state,
            self.pool,
            *arrays,
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

    def _execute_steps(self, batch: list[tuple[Request, int]], k: int) -> list[Request]:
        """`k` decode steps of `batch` in one call (`programs.decode_steps`), taken back by the scheduler step by
        step; returns the requests that finished."""
        arrays, _ = self._arrays(batch, minimum=1)
        arrays[2] = np.arange(len(arrays[0])) < len(batch)  # `decode_steps` takes which tokens are live, not slots
        per_step = [self._sampling_rows(batch, self.config.max_num_seqs + 1, ahead=t)[:2] for t in range(k)]
        params, words = per_step[0][0], np.stack([w for _, w in per_step])
        plain = not any(params[: len(batch), 0]) and not any(r.sampling.logprobs for r, _ in batch)
        sampled, self.pool = decode_steps(
            self.graphdef,
            self.state,
            self.pool,
            *arrays,
            params,
            words,
            self._allowed,
            block_size=self.config.block_size,
            implementation=self.config.implementation,
            plain=plain,
        )
        self._executed += k
        drawn, chosen, top_ids, top_logp = jax.device_get(sampled)
        finished: list[Request] = []
        for t in range(k):
            entries = [(i, request) for i, (request, _) in enumerate(batch) if not request.finished]
            for i, request in entries:
                self._record(request, chosen[t, i], top_ids[t, i], top_logp[t, i])
            tokens_t = [int(drawn[t, i]) for i, _ in entries]
            finished += self.scheduler.update_from_output([(r, 1) for _, r in entries], tokens_t)
        return finished

    def _sample(self, logits: np.ndarray, request: Request, count: int = 1) -> list[int]:
        """The next `count` tokens of `request`, each drawn from the same logits (float32 [vocab]) exactly as
        successive steps draw them (the same sampler, each token's key and log-probability records), in one device
        call; appended to `request.output` and returned. (A seeded request's key follows its token index; an
        unseeded one's follows the engine's step count, which this does not advance.)"""
        start = len(request.output)
        ahead = [dataclasses.replace(request, output=[0] * (start + t)) for t in range(count)]  # token start + t
        params, words, masks = self._sampling_rows([(r, 0) for r in ahead], count)
        args = (jnp.broadcast_to(jnp.asarray(logits), (count, len(logits))), params, words, self._allowed, masks)
        drawn, chosen, top_ids, top_logp = jax.device_get(draw_jit(*args))
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
        self, batch: list[tuple[Request, int]], rows: int, ahead: int = 0
    ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """(float32 [rows, 4]: temperature, top_p, min_p, repetition penalty; uint32 [rows, 5]: top_k and the key's
        `core.sampling.key_words`; None, or when some entry has a repetition penalty or may not end yet (fewer
        tokens than its min_tokens) uint32 [rows, W] twice: each row's prompt and output ids, its banned end ids,
        as `core.sampling.pack_ids` bits) of each batch entry's request; rows past the batch are greedy. The keys
        are those of the step `ahead` steps after the next one (each request `ahead` tokens further)."""
        params = np.zeros((rows, 4), np.float32)
        params[:, 1] = params[:, 3] = 1.0
        words = np.zeros((rows, 5), np.uint32)
        for i, (request, _) in enumerate(batch):
            p = request.sampling
            temperature = self.config.temperature if p.temperature is None else p.temperature
            params[i] = (temperature, p.top_p, p.min_p, p.repetition_penalty)
            if p.seed is not None:
                key = sampling.key_words(p.seed, len(request.output) + ahead, _REQUEST_STREAM)
            else:
                step = self._executed + ahead
                key = sampling.key_words(self.config.seed, (step * rows + i) % 2**32, _ENGINE_STREAM)
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
        such batch of each shape compiles its own). With `config.decode_steps` > 1, the decode buckets' K-step
        programs too, with the full sampler and the plain one (no token live: nothing written)."""
        s_max = self.config.max_num_seqs + 1
        sizes = sorted({bucket(n) for n in range(1, self.config.max_num_batched_tokens + 1)})
        decode = [n for n in sizes if n <= bucket(self.config.max_num_seqs)]
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
            sampled, self.pool = forward(
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
        k = self.config.decode_steps
        decode_batches = sorted({bucket(b, 1) for b in range(1, self.config.max_num_seqs + 1)}) if k > 1 else []
        for n, plain in itertools.product(decode_batches, (False, True)):
            qsl = np.zeros(s_max + 1, np.int32)
            qsl[-1] = n
            seq_lens = np.ones(s_max, np.int32)
            seq_lens[-1] = n
            params, words, _ = self._sampling_rows([], s_max)
            sampled, self.pool = decode_steps(
                self.graphdef,
                self.state,
                self.pool,
                np.zeros(n, np.int32),
                np.arange(n, dtype=np.int32),
                np.zeros(n, bool),
                np.zeros((s_max, self.max_blocks), np.int32),
                seq_lens,
                qsl,
                np.zeros(s_max, np.int32),
                params,
                np.stack([words] * k),
                self._allowed,
                block_size=self.config.block_size,
                implementation=self.config.implementation,
                plain=plain,
            )
            jax.block_until_ready(sampled)
