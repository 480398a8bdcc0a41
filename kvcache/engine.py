"""A serving engine: continuous batching over a paged, quantised KV pool with prefix caching.

Every `step()` runs one forward pass of the model over a ragged batch: one token for each decoding sequence and a
chunk of prompt for sequences still in prefill, together at most `max_num_batched_tokens` tokens (vLLM's chunked
prefill with a token budget). Their keys and values are quantised into the pool on write and each token attends
its own sequence's cache with `kvcache.unified_attention` (causal inside a chunk).

Memory: the pool is `memory_bytes` of blocks in the chosen format, so fp4 holds about 3.76x the tokens of bf16.
Prefix caching: full blocks are registered under chained hashes (`kvcache.blocks`); a new request starts from the
longest cached full-block prefix of its tokens (less its last token, which must be computed for its logits) and
only computes the rest. Finished requests release their blocks to the cache; evictions take the least recently
released.

Scheduling (documented behaviour):
  * Running sequences go first, in admission order; then waiting requests first-come first-served, while the
    token budget and `max_num_seqs` allow and their blocks can be allocated (evicting cached blocks if needed).
  * Admission control: a request whose prompt + max_new_tokens exceeds `max_model_len` or the whole pool is
    rejected at `submit` with a ValueError; nothing else changes.
  * Preemption: when a running sequence needs a block and none can be freed, the most recently admitted running
    sequence is preempted: its blocks are released (full ones stay cached) and it returns to the front of the
    queue, to be recomputed (from its cached prefix) when it is admitted again. Its generated tokens are kept.

Metrics per request (engine clock = time.perf_counter()): arrival, first-token time, finish time and the time of
every token; TTFT = first token - arrival; TPOT = (finish - first token) / (tokens - 1). Per engine: steps,
preemptions, prompt tokens asked of and found in the prefix cache.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from core.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
from kvcache import attention
from kvcache.blocks import BlockManager, block_hashes
from kvcache.formats import Format
from kvcache.paged import PagedPool

if TYPE_CHECKING:
    from core.model import Transformer

__all__ = ["Engine", "EngineConfig", "Request", "SamplingParams", "Scheduler"]

MAX_TOP_LOGPROBS = 20  # alternatives a request may ask for per token (OpenAI's chat limit)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """memory_bytes: KV pool size; max_num_seqs / max_num_batched_tokens: per-step limits; max_model_len: the
    longest sequence (prompt + output) a request may reach; temperature 0 = greedy.

    The tokenizer's ids (core.tokenizer; defaults: the byte tokenizer's): `eos_id` ends a request (None: only
    max_new_tokens does); `never` (ids) and the ids >= `num_ids` (None: no limit) are never sampled, e.g.
    `EngineConfig(..., eos_id=tok.eos_id, never=tok.never_sampled, num_ids=tok.vocab_size)`.
    """

    memory_bytes: int
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 4096
    implementation: str = "xla"
    temperature: float = 0.0
    seed: int = 0
    eos_id: int | None = EOS_ID
    never: tuple[int, ...] = (PAD_ID, BOS_ID)
    num_ids: int | None = VOCAB_SIZE

    def __post_init__(self):
        for name in ("memory_bytes", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} = {getattr(self, name)}; must be >= 1")
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"EngineConfig.temperature = {self.temperature}; must be >= 0")
        attention.check_implementation(self.implementation)
        for name in ("eos_id", "num_ids"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0):
                raise ValueError(f"EngineConfig.{name} = {value!r}; must be an integer >= 0 or None")
        bad = [t for t in self.never if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0]
        if bad:
            raise ValueError(f"EngineConfig.never holds {bad[0]!r}; every id must be an integer >= 0")
        if self.eos_id is not None and (
            self.eos_id in self.never or (self.num_ids is not None and self.eos_id >= self.num_ids)
        ):
            raise ValueError(
                f"EngineConfig.eos_id = {self.eos_id} can never be sampled (it is in `never` or >= num_ids = "
                f"{self.num_ids}); the end id must be sampleable"
            )
        if self.max_model_len < 2 * self.max_num_batched_tokens:
            raise ValueError(
                f"EngineConfig.max_model_len = {self.max_model_len} must be >= 2 x "
                f"max_num_batched_tokens = {2 * self.max_num_batched_tokens} (a step's padded batch "
                "is addressed like one sequence)"
            )
        if self.implementation == "xla_split":
            raise ValueError(
                "EngineConfig.implementation = 'xla_split' runs decode only; the engine's batches mix "
                "prefill and decode: use 'xla' or 'pallas'"
            )


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples its tokens (the engine's `_sample`; OpenAI's parameters of the same names).

    temperature: None = the engine's `EngineConfig.temperature`; 0 = greedy (argmax), else softmax(logits / T).
    top_k: keep the k most likely ids (0 = all); top_p: then the smallest set of the most likely ids whose
    probability (after temperature and top_k) reaches top_p (1 = all). seed: the request's own random stream
    (`np.random.default_rng(seed)`: the same seed gives the same tokens whatever else the engine serves); None = the
    engine's stream. logprobs: record each chosen token's log-probability and the `top_logprobs` most likely ids
    with theirs, all under the model's distribution over the sampleable ids (log_softmax of the logits, before
    temperature, top_k and top_p, as vLLM reports them).
    """

    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        checks = {
            "temperature": self.temperature is None or self.temperature >= 0,  # (NaN fails)
            "top_p": 0 < self.top_p <= 1,
            "top_k": _is_int(self.top_k) and self.top_k >= 0,
            "seed": self.seed is None or (_is_int(self.seed) and self.seed >= 0),
            "top_logprobs": _is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
        }
        allowed = {
            "temperature": ">= 0 or None",
            "top_p": "in (0, 1]",
            "top_k": "an integer >= 0 (0 = all)",
            "seed": "an integer >= 0 or None",
            "top_logprobs": f"an integer in [0, {MAX_TOP_LOGPROBS}]",
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SamplingParams.{name} = {getattr(self, name)!r}; must be {allowed[name]}")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence's state. `finish_reason`: "stop" (it sampled EOS, or `Scheduler.finish` was told so: a stop
    string), "length" (max_new_tokens reached), "abort" (`Scheduler.abort`); None while it runs. With
    `sampling.logprobs`, `logprobs[i]` is output[i]'s log-probability and `top_logprobs[i]` the (id, logprob) pairs
    of the most likely ids, best first."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    arrival: float
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)
    sampling: SamplingParams = SamplingParams()
    finish_reason: str | None = None
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    rng: np.random.Generator | None = None  # its own stream when sampling.seed is set (made at the first draw)
    output: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + output (kept in step)
    hashes: list[int] = dataclasses.field(default_factory=list)  # chained hashes of the computed full blocks
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the pool
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at (the last) admission
    preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.tokens = self.prompt + self.output

    @property
    def finished(self) -> bool:
        return self.finish_time is not None

    @property
    def ttft(self) -> float:
        assert self.first_token_time is not None, "ttft is read once the request has its first token"
        return self.first_token_time - self.arrival

    @property
    def tpot(self) -> float:
        n = len(self.output)
        if n <= 1:
            return 0.0
        # read on a finished request: its first token and its finish both have their times
        assert self.first_token_time is not None and self.finish_time is not None, "tpot of an unfinished request"
        return (self.finish_time - self.first_token_time) / (n - 1)


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

    @property
    def lengths(self):
        return self.seq_lens

    def update_and_attend(self, layer, q, k, v):
        kw: dict[str, Any] = dict(fmt=self.pool.fmt, implementation=self.implementation)
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


@functools.partial(jax.jit, static_argnames=("graphdef", "max_query_len", "implementation"), donate_argnums=(2,))
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
    *,
    max_query_len,
    implementation,
):
    model = nnx.merge(graphdef, state)
    cache = _FlatBatchCache(pool, slots, block_tables, seq_lens, query_start_loc, max_query_len, implementation)
    logits, _, cache = model(tokens[None], positions=positions[None], cache=cache)
    return logits[0, last].astype(jnp.float32), cache.pool


class Scheduler:
    """The host side of serving: requests, blocks and the prefix cache, scheduling, metrics. A subclass runs the
    batches (`_execute`) and keeps the time (`clock`): `Engine` runs the model; `kvcache.simulate` a cost model."""

    def __init__(self, config: EngineConfig, fmt: Format, num_blocks: int):
        self.config, self.fmt = config, fmt
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.max_blocks = -(-config.max_model_len // config.block_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.stats = {"steps": 0, "preemptions": 0, "prompt_tokens": 0, "cached_tokens": 0}
        self._next_id = 0

    def clock(self) -> float:
        return time.perf_counter()

    def _execute(self, batch: list[tuple[Request, int]]) -> list[int | None]:
        """Runs one batch; returns the next token of every entry whose tokens are now all computed (else None)."""
        raise NotImplementedError

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.config.block_size

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(
        self,
        prompt,
        max_new_tokens: int,
        *,
        arrival: float | None = None,
        ignore_eos: bool = False,
        sampling: SamplingParams | None = None,
    ) -> Request:
        """Queues a request (prompt: token ids, at least one); it ends at EOS or after max_new_tokens tokens
        (exactly that many with `ignore_eos`), sampled as `sampling` says (default: the engine's temperature).
        Raises ValueError, changing nothing, if it cannot ever fit: longer than max_model_len or than the whole
        pool (`check`)."""
        prompt = list(prompt)  # (a generator is read once)
        self.check(prompt, max_new_tokens)
        prompt = [int(t) for t in prompt]
        request = Request(
            self._next_id,
            prompt,
            max_new_tokens,
            self.clock() if arrival is None else arrival,
            ignore_eos,
            sampling or SamplingParams(),
        )
        self._next_id += 1
        self.waiting.append(request)
        return request

    def check(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        """Raises ValueError, naming the limit, if a request of `prompt` (token ids) and `max_new_tokens` can never
        be served: its ids must be valid (`_check_tokens`), it needs a prompt and a new token, and must fit
        max_model_len and the whole pool. It reads only the engine's fixed limits, so any thread may call it while
        another steps the engine."""
        self._check_tokens(prompt)
        prompt_len = len(prompt)
        need = prompt_len + max_new_tokens
        if prompt_len < 1 or max_new_tokens < 1:
            raise ValueError(
                f"a request needs >= 1 prompt token and max_new_tokens >= 1 (got {prompt_len} and {max_new_tokens})"
            )
        if need > self.config.max_model_len:
            raise ValueError(
                f"request of {prompt_len} prompt + {max_new_tokens} new tokens = {need} exceeds "
                f"max_model_len = {self.config.max_model_len}"
            )
        if -(-need // self.config.block_size) > self.blocks.num_blocks:
            raise ValueError(
                f"request of {need} tokens needs {-(-need // self.config.block_size)} blocks; the KV "
                f"pool has {self.blocks.num_blocks} ({self.capacity_tokens} tokens in {self.fmt.label})"
            )

    def _check_tokens(self, prompt: Sequence[int]) -> None:
        """Raises ValueError for a prompt holding an id this scheduler cannot take (none here; see Engine)."""

    def finish(self, request: Request, reason: str = "abort") -> None:
        """Ends `request` now, wherever it is (waiting or running; a finished one is left as it is): its blocks are
        released at once (full ones stay in the prefix cache) and its `finish_reason` is `reason` ("abort": the
        client went away; "stop": it met a stop string)."""
        if request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
            self.blocks.release(request.blocks)
            request.blocks = []
        request.finish_reason, request.finish_time = reason, self.clock()

    def abort(self, request: Request) -> None:
        """`finish(request, "abort")`."""
        self.finish(request, "abort")

    # ----------------------------------------------------------------------------------------------- schedule

    def _blocks_for(self, request: Request, num_tokens: int) -> int:
        """New blocks `request` needs to hold `num_tokens` more tokens."""
        return -(-(request.num_computed + num_tokens) // self.config.block_size) - len(request.blocks)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.blocks.release(victim.blocks)
        victim.blocks, victim.num_computed = [], 0
        victim.preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(victim)

    def _schedule(self) -> list[tuple[Request, int]]:
        budget, batch = self.config.max_num_batched_tokens, []
        for request in list(self.running):
            if request not in self.running or budget == 0:
                continue
            n = min(len(request.tokens) - request.num_computed, budget)
            while True:
                new = self.blocks.allocate(self._blocks_for(request, n))
                if new is not None:
                    break
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            if request not in self.running:
                continue
            assert new is not None  # the loop ends without blocks only when `request` itself was preempted
            request.blocks += new
            batch.append((request, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = self.blocks.match(request.tokens[:-1])
            request.blocks, request.num_computed = hit, len(hit) * self.config.block_size
            n = min(len(request.tokens) - request.num_computed, budget)
            new = self.blocks.allocate(self._blocks_for(request, n))
            if new is None:
                self.blocks.release(hit)
                request.blocks, request.num_computed = [], 0
                break
            self.waiting.popleft()
            request.blocks += new
            request.cached_tokens = request.num_computed
            self.stats["prompt_tokens"] += len(request.tokens)
            self.stats["cached_tokens"] += request.num_computed
            self.running.append(request)
            batch.append((request, n))
            budget -= n
        return batch

    # --------------------------------------------------------------------------------------------------- step

    def step(self) -> list[Request]:
        """Schedules and runs one batch; returns the requests that finished in it."""
        batch = self._schedule()
        if not batch:
            if self.waiting:  # nothing fits although the pool is free: cannot happen after submit's checks
                raise RuntimeError("the scheduler could not place any request; the pool is smaller than a block")
            return []
        tokens = self._execute(batch)
        now = self.clock()
        self.stats["steps"] += 1
        bs, finished = self.config.block_size, []
        for (request, n), token in zip(batch, tokens):
            request.num_computed += n
            done = len(request.hashes)
            request.hashes = block_hashes(request.tokens, bs, request.hashes, upto=request.num_computed)
            for j in range(done, len(request.hashes)):
                self.blocks.register(request.blocks[j], request.hashes[j])
            if token is None:
                continue  # prefill not done: no token yet
            request.output.append(token)
            request.tokens.append(token)
            request.token_times.append(now)
            if request.first_token_time is None:
                request.first_token_time = now
            ended = token == self.config.eos_id and not request.ignore_eos
            if ended or len(request.output) >= request.max_new_tokens:
                request.finish_time, request.finish_reason = now, "stop" if ended else "length"
                self.running.remove(request)
                self.blocks.release(request.blocks)
                request.blocks = []
                finished.append(request)
        return finished

    def run(self, on_step=None) -> list[Request]:
        """Steps until every submitted request finished; `on_step(engine, finished)` after each step."""
        done = []
        while self.has_work:
            finished = self.step()
            done += finished
            if on_step is not None:
                on_step(self, finished)
        return done


class Engine(Scheduler):
    """Continuous-batching server of a `core.model.Transformer` over a paged KV pool in format `fmt`."""

    def __init__(self, model: Transformer, fmt: Format, config: EngineConfig):
        cfg = model.cfg
        self.graphdef, self.state = nnx.split(model)
        self.pool = PagedPool.create(
            fmt,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=config.block_size,
            memory_bytes=config.memory_bytes,
        )
        super().__init__(config, fmt, self.pool.num_blocks)
        self.vocab_size = cfg.vocab_size  # token ids a prompt may hold: [0, vocab_size)
        self._rng = np.random.default_rng(config.seed)
        self._sampled = np.ones(cfg.vocab_size, bool)  # the ids `_sample` may produce
        self._sampled[[t for t in config.never if t < cfg.vocab_size]] = False
        if config.num_ids is not None:
            self._sampled[config.num_ids :] = False

    def _check_tokens(self, prompt: Sequence[int]) -> None:
        """The model's vocabulary: `prompt` (a 1-D sequence of ids: Python or NumPy integers) must hold only
        integers (not bool, not float, even a whole one) in [0, model vocab_size). Raises ValueError naming the
        first bad position, its value and the range (`submit` and `check` then change nothing)."""
        for i, token in enumerate(prompt):
            if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
                raise ValueError(
                    f"prompt token at position {i} is {token!r} ({type(token).__name__}); token ids must be "
                    f"integers (not bool or float) in [0, {self.vocab_size}) (the model's vocab_size)"
                )
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"prompt token at position {i} is {token!r}, outside [0, {self.vocab_size}) (the model's "
                    "vocab_size)"
                )

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
        logits, self.pool = _forward(
            self.graphdef,
            self.state,
            self.pool,
            jnp.asarray(tokens),
            jnp.asarray(positions),
            jnp.asarray(slots),
            jnp.asarray(tables),
            jnp.asarray(seq_lens),
            jnp.asarray(qsl),
            jnp.asarray(last),
            max_query_len=n_pad,
            implementation=self.config.implementation,
        )
        logits = np.asarray(logits)
        return [
            self._sample(logits[i], request) if request.num_computed + n == len(request.tokens) else None
            for i, (request, n) in enumerate(batch)
        ]

    def warmup(self) -> None:
        """Compiles the step for every batch-size bucket (slots all -1: the pool is not written), so that no
        request's time to first token pays for compilation. The first bucket runs twice: first given the pool as
        created, then the pool as a step returns it (placed as the step's output, which may differ from the new
        pool's placement and is then another program: the one every later step of that size runs)."""
        s_max = self.config.max_num_seqs + 1
        sizes = sorted({_bucket(n) for n in range(1, self.config.max_num_batched_tokens + 1)})
        for n in [*sizes, sizes[0]]:
            qsl = np.zeros(s_max + 1, np.int32)
            qsl[-1] = n
            seq_lens = np.ones(s_max, np.int32)
            seq_lens[-1] = n
            logits, self.pool = _forward(
                self.graphdef,
                self.state,
                self.pool,
                *map(  # built as `_execute` builds them (NumPy arrays moved to the device): no other programs
                    jnp.asarray,
                    (
                        np.zeros(n, np.int32),
                        np.arange(n, dtype=np.int32),
                        np.full(n, -1, np.int32),
                        np.zeros((s_max, self.max_blocks), np.int32),
                        seq_lens,
                        qsl,
                        np.zeros(s_max, np.int32),
                    ),
                ),
                max_query_len=n,
                implementation=self.config.implementation,
            )
            logits.block_until_ready()

    def _sample(self, logits: np.ndarray, request: Request) -> int:
        """The next token of `request` from its `logits` (float32[vocab]) over the ids not in `config.never` and
        below `config.num_ids` (the byte tokenizer's: the bytes and EOS), as its SamplingParams say (greedy as
        `core.generate` samples); records the log-probabilities it asks for."""
        params = request.sampling
        logits = np.where(self._sampled, logits, -np.inf)
        temperature = self.config.temperature if params.temperature is None else params.temperature
        if temperature == 0:
            token = int(np.argmax(logits))
        else:
            scaled = (logits - logits.max()) / temperature
            if 0 < params.top_k < len(scaled):
                scaled[scaled < np.partition(scaled, -params.top_k)[-params.top_k]] = -np.inf
            p = np.exp(scaled)
            p /= p.sum()
            if params.top_p < 1:
                order = np.argsort(-p, kind="stable")
                keep = np.cumsum(p[order]) - p[order] < params.top_p  # the ids before the sum reaches top_p, + 1
                p[order[~keep]] = 0
                p /= p.sum()
            if params.seed is not None and request.rng is None:
                request.rng = np.random.default_rng(params.seed)
            token = int((request.rng or self._rng).choice(len(p), p=p))
        if params.logprobs:
            logp = logits - logits.max()
            logp -= np.log(np.exp(logp).sum())
            request.logprobs.append(float(logp[token]))
            best = np.argsort(-logp, kind="stable")[: params.top_logprobs]
            request.top_logprobs.append([(int(t), float(logp[t])) for t in best])
        return token


def _bucket(num_tokens: int) -> int:
    """Padded batch size: the next power of two, at least 16 (few distinct compiled shapes)."""
    return max(16, 1 << (num_tokens - 1).bit_length())
