"""The host side of serving: requests, the scheduler (continuous batching over a paged pool with a prefix cache) and
the engine core that holds one.

`Scheduler.schedule()` picks one ragged batch: one token for each decoding sequence and a chunk of prompt for
sequences still in prefill, together at most `max_num_batched_tokens` tokens (vLLM's chunked prefill with a token
budget); `Scheduler.update_from_output(batch, tokens)` takes the next token of every sequence whose tokens are now all
computed and advances, finishes and releases them. Between the two an engine runs the batch: `EngineCore.step()` is
schedule -> `_execute` -> update_from_output, as vLLM's engine core steps, and `kvcache.serving.engine.Engine` (the
model), `kvcache.serving.simulate.SimulatedEngine` (a cost model) and the tests' scripted engines are engine cores
over the same scheduler.

Prefix caching: full blocks are registered under chained hashes (`kvcache.serving.blocks`); a new request starts
from the longest cached full-block prefix of its tokens (less its last token, which must be computed for its
logits) and only computes the rest. Finished requests release their blocks to the cache; evictions take the least
recently released.

Scheduling (documented behaviour):
  * Running sequences go first, in admission order; then waiting requests first-come first-served, while the
    token budget and `max_num_seqs` allow and their blocks can be allocated (evicting cached blocks if needed).
  * Admission control: a request whose prompt + max_new_tokens exceeds `max_model_len` or the whole pool is
    rejected at `submit` with a ValueError; nothing else changes.
  * Preemption: when a running sequence needs a block and none can be freed, the most recently admitted running
    sequence is preempted: its blocks are released (full ones stay cached) and it returns to the front of the
    queue, to be recomputed (from its cached prefix) when it is admitted again. Its generated tokens are kept.

Metrics per request (clock = the scheduler's `clock`, time.perf_counter unless its engine keeps its own time):
arrival, first-token time, finish time and the time of every token; TTFT = first token - arrival; TPOT = (finish - first
token) / (tokens - 1). Per scheduler: steps, preemptions, prompt tokens asked of and found in the prefix cache.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvcache.formats import Format
from kvcache.serving.blocks import BlockManager, block_hashes
from kvcache.serving.config import EngineConfig, SamplingParams

__all__ = ["EngineCore", "Request", "Scheduler"]


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence's state. `finish_reason`: "stop" (it sampled one of its end ids, or `Scheduler.finish` was told
    so: a stop string), "length" (max_new_tokens reached), "abort" (`Scheduler.abort`); None while it runs.
    `end_id`: the end id it sampled and stopped at (one of `stops`, the ids that end it: `Scheduler.submit`), else
    None. With `sampling.logprobs`, `logprobs[i]` is output[i]'s log-probability and `top_logprobs[i]` the (id,
    logprob) pairs of the most likely ids, best first."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    arrival: float
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    finish_reason: str | None = None
    end_id: int | None = None
    stops: frozenset[int] = frozenset()
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
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
    seen: Any = None  # the engine's packed ids of `tokens[:seen_count]` (its repetition penalty's), or None
    seen_count: int = 0

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


class Scheduler:
    """The host side of serving: requests, blocks and the prefix cache, scheduling, metrics; it runs nothing (an
    `EngineCore` holding it runs the batches it schedules).

    Args:
      config: the engine's limits (block size, token budget, max_num_seqs, max_model_len) and end ids.
      fmt: the KV format of the pool (named in errors).
      num_blocks: the pool's blocks of `config.block_size` tokens.
      vocab_size: with it, a request's ids must be integers in [0, vocab_size) (the model's vocabulary); None takes
        any ids (a cost model, a script).
      clock: the time of arrivals, tokens and finishes (seconds; time.perf_counter, or a simulation's clock).
    """

    def __init__(
        self,
        config: EngineConfig,
        fmt: Format,
        num_blocks: int,
        *,
        vocab_size: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.config, self.fmt, self.vocab_size, self.clock = config, fmt, vocab_size, clock
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.max_blocks = -(-config.max_model_len // config.block_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.stats = {"steps": 0, "preemptions": 0, "prompt_tokens": 0, "cached_tokens": 0}
        self._next_id = 0

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
        """Queues a request (prompt: token ids, at least one); it ends at one of the config's end ids
        (`EngineConfig.end_ids`; not with `ignore_eos`), at one of `sampling.stop_token_ids`, or after max_new_tokens
        tokens, sampled as `sampling` says (default: the engine's temperature). Raises ValueError, changing nothing,
        if it cannot ever be served (`check`)."""
        prompt = list(prompt)  # (a generator is read once)
        sampling = sampling or SamplingParams()
        self.check(prompt, max_new_tokens, sampling)
        prompt = [int(t) for t in prompt]
        request = Request(
            self._next_id,
            prompt,
            max_new_tokens,
            self.clock() if arrival is None else arrival,
            ignore_eos,
            sampling,
            stops=frozenset([*(() if ignore_eos else self.config.end_ids), *sampling.stop_token_ids]),
        )
        self._next_id += 1
        self.waiting.append(request)
        return request

    def check(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None) -> None:
        """Raises ValueError, naming the limit, if a request of `prompt` (token ids), `max_new_tokens` and `sampling`
        can never be served: its ids (and `sampling.stop_token_ids`) must be valid (`_check_tokens`), it needs a
        prompt and a new token, at most max_new_tokens min_tokens, and must fit max_model_len and the whole pool. It
        reads only the engine's fixed limits, so any thread may call it while another steps the engine."""
        self._check_tokens(prompt)
        prompt_len = len(prompt)
        need = prompt_len + max_new_tokens
        if prompt_len < 1 or max_new_tokens < 1:
            raise ValueError(
                f"a request needs >= 1 prompt token and max_new_tokens >= 1 (got {prompt_len} and {max_new_tokens})"
            )
        if sampling is not None:
            if sampling.min_tokens > max_new_tokens:
                raise ValueError(
                    f"min_tokens = {sampling.min_tokens} exceeds max_new_tokens = {max_new_tokens}; allowed: "
                    "min_tokens <= max_new_tokens"
                )
            self._check_tokens(sampling.stop_token_ids, what="stop_token_ids")
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

    def _check_tokens(self, prompt: Sequence[int], what: str = "prompt") -> None:
        """With a `vocab_size`: `prompt` (a 1-D sequence of ids: Python or NumPy integers; `what` names it) must hold
        only integers (not bool, not float, even a whole one) in [0, vocab_size). Raises ValueError naming the first
        bad position, its value and the range (`submit` and `check` then change nothing)."""
        if self.vocab_size is None:
            return
        for i, token in enumerate(prompt):
            if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
                raise ValueError(
                    f"{what} token at position {i} is {token!r} ({type(token).__name__}); token ids must be "
                    f"integers (not bool or float) in [0, {self.vocab_size}) (the model's vocab_size)"
                )
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"{what} token at position {i} is {token!r}, outside [0, {self.vocab_size}) (the model's "
                    "vocab_size)"
                )

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

    def reserve(self, requests: Sequence[Request], num_tokens: int) -> bool:
        """Allocates the blocks each of `requests` needs to hold `num_tokens` more tokens than it has computed, for
        all of them or (nothing allocated) none: whether it did. Never preempts."""
        taken: list[tuple[Request, list[int]]] = []
        for request in requests:
            new = self.blocks.allocate(self._blocks_for(request, num_tokens))
            if new is None:
                for r, blocks in taken:
                    del r.blocks[len(r.blocks) - len(blocks) :]
                    self.blocks.release(blocks)
                return False
            request.blocks += new
            taken.append((request, new))
        return True

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.blocks.release(victim.blocks)
        victim.blocks, victim.num_computed = [], 0
        victim.preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(victim)

    def schedule(self) -> list[tuple[Request, int]]:
        """The next batch: (request, number of its tokens to compute now) per scheduled sequence, running ones first
        (preempting as the module docstring says), then admitted waiting ones; [] when there is nothing to run.
        Allocates the blocks those tokens need. Raises RuntimeError if requests wait but none can be placed (cannot
        happen after `submit`'s checks)."""
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
        if not batch and self.waiting:  # nothing fits although the pool is free: cannot happen after submit's checks
            raise RuntimeError("the scheduler could not place any request; the pool is smaller than a block")
        return batch

    # ------------------------------------------------------------------------------------------------- update

    def update_from_output(self, batch: list[tuple[Request, int]], tokens: Sequence[int | None]) -> list[Request]:
        """Takes the result of running `batch` (`schedule`'s): `tokens[i]`, the next token of entry i if its tokens
        are now all computed, else None. Registers the newly full blocks in the prefix cache, appends the tokens (with
        their times), finishes the requests that end (an end id past min_tokens: "stop"; max_new_tokens: "length")
        and releases their blocks. Returns the requests that finished."""
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
            ended = token in request.stops and len(request.output) >= request.sampling.min_tokens
            if ended or len(request.output) >= request.max_new_tokens:
                request.finish_time, request.finish_reason = now, "stop" if ended else "length"
                request.end_id = token if ended else None
                self.running.remove(request)
                self.blocks.release(request.blocks)
                request.blocks = []
                finished.append(request)
        return finished


class EngineCore:
    """What serves requests: it holds a `Scheduler` and runs the batches it schedules. Every `step` is
    `scheduler.schedule()` -> `_execute(batch)` -> `scheduler.update_from_output(batch, tokens)`, vLLM's engine-core
    step. `_execute` (an engine's own: `Engine` runs the model, `SimulatedEngine` a cost model) returns the next token
    of every entry whose tokens are then all computed, else None. The scheduler's request-facing calls and state
    (submit, check, finish, abort, clock; config, fmt, blocks, waiting, running, stats, has_work, capacity_tokens) are
    reached through the engine."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def _execute(self, batch: list[tuple[Request, int]]) -> list[int | None]:
        """Runs one batch; returns the next token of every entry whose tokens are now all computed (else None)."""
        raise NotImplementedError

    def step(self) -> list[Request]:
        """Schedules, runs and takes back one batch; returns the requests that finished in it ([] when idle)."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        return self.scheduler.update_from_output(batch, self._execute(batch))

    def run(self, on_step=None) -> list[Request]:
        """Steps until every submitted request finished; `on_step(engine, finished)` after each step."""
        done = []
        while self.has_work:
            finished = self.step()
            done += finished
            if on_step is not None:
                on_step(self, finished)
        return done

    def submit(
        self,
        prompt,
        max_new_tokens: int,
        *,
        arrival: float | None = None,
        ignore_eos: bool = False,
        sampling: SamplingParams | None = None,
    ) -> Request:
        """`Scheduler.submit`: queues a request, or raises ValueError changing nothing."""
        return self.scheduler.submit(prompt, max_new_tokens, arrival=arrival, ignore_eos=ignore_eos, sampling=sampling)

    def check(self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None) -> None:
        """`Scheduler.check`: raises ValueError if such a request could never be served (any thread may call it)."""
        self.scheduler.check(prompt, max_new_tokens, sampling)

    def finish(self, request: Request, reason: str = "abort") -> None:
        """`Scheduler.finish`: ends `request` now, releasing its blocks."""
        self.scheduler.finish(request, reason)

    def abort(self, request: Request) -> None:
        """`finish(request, "abort")`."""
        self.scheduler.finish(request, "abort")

    def clock(self) -> float:
        """The scheduler's time (seconds)."""
        return self.scheduler.clock()

    @property
    def config(self) -> EngineConfig:
        return self.scheduler.config

    @property
    def fmt(self) -> Format:
        return self.scheduler.fmt

    @property
    def blocks(self) -> BlockManager:
        return self.scheduler.blocks

    @property
    def waiting(self) -> collections.deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def stats(self) -> dict[str, int]:
        return self.scheduler.stats

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def capacity_tokens(self) -> int:
        return self.scheduler.capacity_tokens

    @property
    def max_blocks(self) -> int:
        return self.scheduler.max_blocks
