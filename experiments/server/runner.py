"""The engine in a thread of its own, stepping while there is work, and its requests' outputs as asyncio streams.

    runner = EngineRunner(engine, tokenizer, max_waiting=256, metrics=ServerMetrics(...))
    runner.start()
    stream = runner.submit(prompt_ids, max_new_tokens, SamplingParams(...), stop=("\\n\\n",))   # on the event loop
    async for event in stream: ...                                                            # Event, Event, ...
    runner.abort(stream)                                                                      # client gone
    runner.stop()

Only the engine thread touches the engine: `submit` and `abort` post commands that it carries out between two steps,
so an HTTP handler never waits for a step. What a submission can be refused for is decided at once, on the caller's
thread, from the engine's fixed limits (`Scheduler.check`: max_model_len, the pool; the vocabulary) and the queue's
length (`QueueFull` when `max_waiting` requests are already queued and not yet running).

After every step the thread publishes each request's new tokens as an `Event` to its stream's asyncio queue
(`loop.call_soon_threadsafe`): the text they complete (core.tokenizer.StreamDecoder: a character split over tokens
comes out whole; special tokens dropped, or written as their names without `skip_special_tokens`), their ids and
log-probabilities, and on the last event the finish reason, vLLM's `stop_reason` and the token counts. As vLLM:
a request that ends at one of its end ids (`kvcache.serving.Request.end_id`) has that token in its ids but not its
text in the text (unless `include_stop_str_in_output`); stop strings end a request at their first occurrence in
its text that ends after the text of its first `min_tokens` tokens: the text is cut before it (after it with
`include_stop_str_in_output`), the request is finished in the engine ("stop") and its blocks freed; while it runs,
the last `len(longest stop) - 1` characters are held back, so no event ever carries text that a stop string then
cuts away.

If a step raises (a bug, not a client's input: that is refused before it reaches the engine), every open stream
receives an Event with `error` set, the runner stops accepting requests and `healthy` turns False. `close(reason)`
ends it on purpose (a server shutting down): after the current step every open request is aborted and its stream
receives an Event with `error = reason`; `closing` holds the reason, and later submissions are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from core.tokenizer import StreamDecoder

if TYPE_CHECKING:
    from core.tokenizer import Tokenizer
    from experiments.server.metrics import ServerMetrics
    from kvcache.serving import Engine, Request, SamplingParams

__all__ = ["EngineRunner", "Event", "QueueFull", "Stream"]


class QueueFull(Exception):
    """The bounded queue holds `max_waiting` requests; `retry_after` (seconds) is a hint for the client."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"the server's queue is full ({waiting} requests waiting); retry after {retry_after} s")
        self.retry_after = retry_after


@dataclasses.dataclass
class Event:
    """New output of one request. `text` extends what came before (after stop-string cutting); `token_ids`,
    `logprobs` and `top_logprobs` are its new tokens' (the last two with SamplingParams.logprobs). The last event of
    a request has `finish_reason` ("stop", "length" or "abort"), `stop_reason` (vLLM's: the stop string or end id it
    stopped at; None for the tokenizer's EOS, a length or an abort) and the counts; `error` ends a stream
    abnormally."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


class Stream:
    """One request's events, in order, as an async iterator that ends after the last one (`finish_reason` or
    `error` set). Created by `EngineRunner.submit` on the running event loop."""

    def __init__(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop: Sequence[str],
        decoder: StreamDecoder,
        ignore_eos: bool = False,
        include_stop: bool = False,
    ):
        self.prompt, self.max_new_tokens, self.sampling, self.stop = prompt, max_new_tokens, sampling, tuple(stop)
        self.ignore_eos, self.include_stop = ignore_eos, include_stop
        self.stop_from = 0  # (engine thread) a stop string counts if it ends after this much text (min_tokens')
        self.stop_hit: str | None = None  # the stop string that ended it
        self.arrival = time.perf_counter()
        self.request: Request | None = None  # set by the engine thread when it submits it
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        # the engine thread's bookkeeping: the text decoded so far (cut at a stop string), how much of it and of the
        # request's tokens was published, whether the last event was
        self.decoder, self.text, self.sent_text, self.sent_tokens = decoder, "", 0, 0
        self.done = False
        self.queued = True  # (engine thread) counted in the runner's queue: not yet admitted by the engine

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._queue.get()
            yield event
            if event.finish_reason is not None or event.error is not None:
                return

    def put(self, event: Event) -> None:
        """Hands `event` to the reader (from any thread)."""
        with contextlib.suppress(RuntimeError):  # a closed event loop: the server is shutting down, nobody reads
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)


class EngineRunner:
    """Runs `engine` on a daemon thread (module docstring). `max_waiting`: requests submitted and not yet running
    at most, beyond which `submit` raises QueueFull."""

    def __init__(
        self, engine: Engine, tokenizer: Tokenizer, *, max_waiting: int = 256, metrics: ServerMetrics | None = None
    ):
        if max_waiting < 1:
            raise ValueError(f"max_waiting = {max_waiting}; must be >= 1")
        self.engine, self.tokenizer, self.max_waiting, self.metrics = engine, tokenizer, max_waiting, metrics
        self._inbox: queue.SimpleQueue[tuple[str, Stream | None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # submitted and not yet admitted (guarded by _lock)
        self._streams: list[Stream] = []  # (engine thread) submitted, not done
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.error: str | None = None  # the traceback that stopped the engine thread
        self.closing: str | None = None  # why close() ended the runner (guarded by _lock)

    # ------------------------------------------------------------------------------------------- any thread

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def queued(self) -> int:
        return self._queued

    def start(self) -> None:
        self._thread.start()

    def close(self, reason: str) -> None:
        """Ends every request, running or waiting, after the current step: each open stream's last event has
        `error = reason`; submissions from now on raise RuntimeError naming `reason`. Returns at once."""
        with self._lock:  # a submit either reaches the inbox before the close command or is refused
            if self.closing is None:
                self.closing = reason
                self._inbox.put(("close", None))

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the engine thread after its current step (open streams get no more events)."""
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    def submit(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        *,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> Stream:
        """Queues a request (call it on the event loop that reads the stream). Raises ValueError naming the limit
        if it can never be served (a token outside the vocabulary, longer than max_model_len or the pool), QueueFull
        if the queue is full, RuntimeError if the engine has stopped; nothing is queued then."""
        self.engine.check(prompt, max_new_tokens, sampling)
        if not self.healthy:
            raise RuntimeError(self.closing or f"the engine has stopped: {self.error or 'not running'}")
        with self._lock:
            if self.closing is not None:
                raise RuntimeError(self.closing)
            if self._queued >= self.max_waiting:
                raise QueueFull(self._queued, retry_after=1)
            self._queued += 1
            decoder = StreamDecoder(self.tokenizer, skip_special_tokens=skip_special_tokens)
            stream = Stream(prompt, max_new_tokens, sampling, stop, decoder, ignore_eos, include_stop_str_in_output)
            self._inbox.put(("submit", stream))
        return stream

    def abort(self, stream: Stream) -> None:
        """Ends `stream`'s request (if it still runs) and frees its blocks before the engine's next step."""
        self._inbox.put(("abort", stream))

    # ------------------------------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            while True:
                # idle: block until a command comes; busy: take what came and step
                commands = [] if self.engine.has_work else [self._inbox.get()]
                while not self._inbox.empty():
                    commands.append(self._inbox.get())
                for command, stream in commands:
                    if command == "stop":
                        return
                    if command == "close":
                        return self._close()
                    assert stream is not None
                    if command == "submit":
                        self._submit(stream)
                    else:
                        self._finish(stream, "abort")
                took = 0.0
                if self.engine.has_work:
                    started = time.perf_counter()
                    self.engine.step()
                    took = time.perf_counter() - started
                self._publish(took)
        except Exception:
            self.error = traceback.format_exc()
            for stream in self._streams:
                stream.put(Event(error=self.error.strip().splitlines()[-1]))
            self._streams.clear()

    def _close(self) -> None:
        for stream in self._streams:
            self._finish(stream, "abort")
            stream.put(Event(error=self.closing))
        self._streams.clear()

    def _submit(self, stream: Stream) -> None:
        stream.request = self.engine.submit(
            stream.prompt,
            stream.max_new_tokens,
            arrival=stream.arrival,
            sampling=stream.sampling,
            ignore_eos=stream.ignore_eos,
        )
        self._streams.append(stream)

    def _finish(self, stream: Stream, reason: str) -> None:
        if stream.request is not None and not stream.done:
            self.engine.finish(stream.request, reason)

    @staticmethod
    def _cut(stream: Stream) -> bool:
        """Cuts `stream.text` at the first stop string that counts (after it with include_stop_str_in_output) and
        records it; whether one did."""
        if stream.stop_hit is not None:
            return False
        found = _first_stop(stream.text, stream.stop, start=max(stream.sent_text, stream.stop_from))
        if found is None:
            return False
        at, stream.stop_hit = found
        stream.text = stream.text[: at + len(stream.stop_hit) if stream.include_stop else at]
        return True

    def _stop_reason(self, stream: Stream) -> int | None:
        """vLLM's stop_reason of a request that stopped at an end id: the id, but None for the tokenizer's EOS."""
        request = stream.request
        assert request is not None
        if request.end_id is None or (request.end_id == self.engine.config.eos_id and not stream.ignore_eos):
            return None
        return request.end_id

    def _publish(self, step_seconds: float) -> None:
        waiting = {id(r) for r in self.engine.waiting}
        admitted = 0
        for stream in self._streams:
            request = stream.request
            assert request is not None
            if stream.queued and id(request) not in waiting:
                stream.queued, admitted = False, admitted + 1
            new = request.output[stream.sent_tokens :]
            if not new and not request.finished:
                continue
            count, cut = stream.sent_tokens, False
            shown = new[:-1] if request.end_id is not None and new and not stream.include_stop else new
            for token in shown:  # one at a time: where the first min_tokens tokens' text ends, where a stop is met
                stream.text += stream.decoder.feed([token])
                count += 1
                if count <= request.sampling.min_tokens:
                    stream.stop_from = len(stream.text)
                cut = self._cut(stream)
                if cut:  # tokens the engine drew after it (several decode steps per call) are not the output
                    _keep_tokens(request, count)
                    break
            if self.metrics is not None:
                self.metrics.observe_tokens(request, stream.sent_tokens)
            event = Event(
                token_ids=request.output[stream.sent_tokens :],
                logprobs=request.logprobs[stream.sent_tokens :],
                top_logprobs=request.top_logprobs[stream.sent_tokens :],
            )
            stream.sent_tokens = len(request.output)
            if cut:
                self._finish(stream, "stop")
            if request.finished:
                if not cut and request.finish_reason != "abort":
                    stream.text += stream.decoder.flush()
                    self._cut(stream)  # in a held-back tail
                end = len(stream.text)
                event.finish_reason = "stop" if stream.stop_hit else request.finish_reason  # (a stop string: vLLM's)
                event.stop_reason = stream.stop_hit or self._stop_reason(stream)
                event.prompt_tokens, event.completion_tokens = len(request.prompt), len(request.output)
                event.cached_tokens = request.cached_tokens
            else:
                held = 0 if stream.include_stop else max((len(s) - 1 for s in stream.stop), default=0)
                end = len(stream.text) - held
            if end > stream.sent_text:
                event.text, stream.sent_text = stream.text[stream.sent_text : end], end
            if event.text or event.token_ids or event.finish_reason:
                stream.put(event)
            if request.finished:
                stream.done = True
                if self.metrics is not None:
                    self.metrics.observe_finished(request)
        self._streams = [s for s in self._streams if not s.done]
        with self._lock:
            self._queued -= admitted
        if self.metrics is not None:
            self.metrics.observe_engine(self.engine, queued=self._queued, step_seconds=step_seconds)


def _keep_tokens(request: Request, count: int) -> None:
    """Drops `request`'s output tokens after its first `count` (with their log-probabilities and times)."""
    del request.tokens[len(request.prompt) + count :]
    for drawn in (request.output, request.logprobs, request.top_logprobs, request.token_times):
        del drawn[count:]


def _first_stop(text: str, stops: Sequence[str], *, start: int) -> tuple[int, str] | None:
    """(where, which) of the first occurrence in `text` of any of `stops` that ends after `start`, or None.
    `text[:start]` holds no whole stop string that counts (published, or the first min_tokens tokens' text): an
    occurrence begins at most len(stop) - 1 characters before `start`."""
    found = [(i, s) for s in stops if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(found) if found else None
