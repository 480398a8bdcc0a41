"""The OpenAI API's logic over an `EngineRunner`: what each endpoint answers, apart from the HTTP routes that call it
(experiments.server.routes) and the app that assembles them (experiments.server.app).

    serving = OpenAIServing(runner, tokenizer, model_name="quickstart", chat=ChatTemplate(...) or None)
    response = await serving.completions(CompletionRequest(...), raw_request)     # JSON, or an SSE stream

A refusal is an `ApiError` (status, OpenAI's error body, headers), raised before anything is queued, or with every
request it queued aborted: 400 a request the server cannot honour (a prompt longer than max_model_len or the KV pool,
a token outside the vocabulary, a chat request for a model without a chat template), with the field at fault in
`param`; 404 an unknown model; 429 the queue is full (with Retry-After); 500 an engine failure during the request;
503 the engine has stopped, or the server is shutting down (a stream then ends with an error event and `[DONE]`).

Prompts given as text are tokenized as transformers' `tokenizer(text).input_ids` and vLLM tokenize them
(`OpenAIServing.prompt_ids`: special tokens' names are those tokens; the tokenizer's framing around the text, e.g.
Llama 3's BOS and none for Qwen, unless `add_special_tokens` is false); chat messages as the chat template renders
them, with no framing of the tokenizer's unless `add_special_tokens` (experiments.server.chat); token-id prompts are
taken as they are. Sampling fields a request leaves out take `defaults` (the model's generation config:
experiments.hf.generation; its max_tokens caps every request's). A response is streamed as server-sent events in
the OpenAI API's chunk format ending with `data: [DONE]` when the request asks for `stream`; else it is one JSON
object once every choice has finished. A client that disconnects, streaming or not, has its requests aborted and
their KV blocks freed before the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from core.tokenizer import Tokenizer
from experiments.server.chat import ChatTemplate, TemplateError
from experiments.server.metrics import CONTENT_TYPE_LATEST
from experiments.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from experiments.server.render import ChatRender, CompletionRender, Render
from experiments.server.runner import EngineRunner, Event, QueueFull, Stream

__all__ = ["ApiError", "OpenAIServing", "too_many_sequences"]

OWNER = "lowbit-moe-lab"
"""The `owned_by` of the served model's card."""


class ApiError(Exception):
    """An error answered in OpenAI's format: HTTP `status`, `body` = protocol.error_body(message, type, param, code),
    and extra `headers` (e.g. Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type=type, param=param, code=code), headers


class OpenAIServing:
    """The endpoints' logic for `runner`'s engine served as `model_name` (module docstring). `chat`: the chat
    template, or None (chat completions are then refused with a 400 saying so). The runner is started and stopped by
    the caller. `defaults`: the sampling fields' values for requests that leave them out (protocol's `sampling`), and
    `max_tokens`, a cap on every request's; `tokens_as_ids`: logprobs name tokens "token_id:N" unless a request says
    otherwise (vLLM's --return-tokens-as-token-ids)."""

    def __init__(
        self,
        runner: EngineRunner,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        chat: ChatTemplate | None = None,
        defaults: Mapping[str, Any] | None = None,
        tokens_as_ids: bool = False,
    ):
        self.runner, self.tokenizer, self.model_name, self.chat = runner, tokenizer, model_name, chat
        self.defaults, self.tokens_as_ids = dict(defaults or {}), tokens_as_ids
        engine = runner.engine
        self.limit = min(engine.config.max_model_len, engine.capacity_tokens)  # longest request (prompt + output)
        self.created = int(time.time())

    # ------------------------------------------------------------------------------------------- models, health

    def models(self) -> dict[str, Any]:
        """GET /v1/models: the one served model's card (`model`) in a list."""
        return {"object": "list", "data": [self.model(self.model_name)]}

    def model(self, model_id: str) -> dict[str, Any]:
        """GET /v1/models/{model_id}: the served model's card, with the longest request it takes (`max_model_len`);
        ApiError 404 for another id."""
        self.check_model(model_id)
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": OWNER,
            "max_model_len": self.limit,
        }

    def health(self) -> JSONResponse:
        """GET /health: 200 {"status": "ok"} while the engine runs, else 503 with the error that stopped it."""
        if self.runner.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "stopped", "error": self.runner.error or self.runner.closing}, status_code=503)

    def metrics(self) -> Response:
        """GET /metrics: the runner's metrics in Prometheus' text format (experiments.server.metrics); a 500 for a
        runner made without them."""
        if self.runner.metrics is None:
            raise ApiError(500, "this server keeps no metrics (EngineRunner(metrics=None))", type="server_error")
        return Response(self.runner.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------------------------------- completions

    async def completions(self, body: CompletionRequest, raw: HTTPRequest) -> Response:
        """POST /v1/completions: n completions of each prompt (text, with BOS, or ids), choices numbered prompt by
        prompt. Raises ApiError (module docstring)."""
        self.check_model(body.model)

        def tokenize() -> list[list[int]]:  # on a worker thread: the event loop serves others meanwhile
            framed = body.add_special_tokens
            return [self.prompt_ids(p, framed) if isinstance(p, str) else list(p) for p in body.prompts()]

        prompts = await asyncio.to_thread(tokenize)
        streams = self.submit(prompts, body, body.max_tokens, param="prompt", logprobs=body.logprobs)
        render = CompletionRender(self.tokenizer, self.model_name, body, tokens_as_ids=self.tokens_as_ids)
        return await self.respond(raw, streams, render, body)

    async def chat_completions(self, body: ChatCompletionRequest, raw: HTTPRequest) -> Response:
        """POST /v1/chat/completions: n completions of the messages rendered by the chat template (as its token
        ids). Raises ApiError: 400 naming `messages` without a template, or when the template refuses them."""
        self.check_model(body.model)
        if self.chat is None:
            raise ApiError(
                400,
                f"the model `{self.model_name}` has no chat template (its tokenizer defines none); use "
                "/v1/completions, or start the server with --chat-template FILE",
                param="messages",
            )
        try:
            messages, framed = [m.as_dict() for m in body.messages], body.add_special_tokens
            prompt = await asyncio.to_thread(self.chat.encode, messages, add_special_tokens=framed)  # off the loop
        except TemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        streams = self.submit([prompt], body, body.max_new_tokens, param="messages", logprobs=logprobs)
        render = ChatRender(self.tokenizer, self.model_name, body, tokens_as_ids=self.tokens_as_ids)
        return await self.respond(raw, streams, render, body)

    # ------------------------------------------------------------------------------------------- shared

    def prompt_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids (module docstring): `Tokenizer.encode_prompt`, the one rule every text prompt is read
        by (thread-safe: the tokenization may run on a worker thread)."""
        return self.tokenizer.encode_prompt(text, add_special_tokens=add_special_tokens).tolist()

    def allowed(self) -> str:
        """What a prompt may hold and where the limit comes from: the tail of every refusal of a prompt's length
        (here, and experiments.server.body's checks before tokenisation)."""
        engine = self.runner.engine
        return (
            f"this server's limit is {self.limit} tokens for a prompt and its output together (max_model_len = "
            f"{engine.config.max_model_len}, KV pool = {engine.capacity_tokens} tokens), so a prompt may have at most "
            f"{self.limit - 1}"
        )

    def check_model(self, name: str | None) -> None:
        """Raises ApiError 404 (param `model`) unless `name` is None or the served model's."""
        if name is not None and name != self.model_name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )

    def submit(
        self,
        prompts: list[list[int]],
        body: CompletionRequest | ChatCompletionRequest,
        max_new_tokens: int | None,
        *,
        param: str,
        logprobs: int | None,
    ) -> list[Stream]:
        """One stream per (prompt, completion), in the order the choices are numbered; `max_new_tokens` None: up to
        the server's limit. Refuses all or none (ApiError 400 / 429 / 503, aborting what it queued). A 400 names
        `param` (the prompt's field) when the prompt alone is at fault, else max_tokens; more sequences (prompts x
        n) than the queue ever holds are a 400 naming n (or the prompt field), before anything is queued."""
        streams: list[Stream] = []
        field = param
        if len(prompts) * body.n > self.runner.max_waiting:  # never queued at once: a 429 would be retried forever
            raise too_many_sequences(len(prompts), body.n, self.runner.max_waiting, param)
        try:
            for prompt in prompts:
                field = param
                if len(prompt) >= self.limit:
                    raise ValueError(f"the prompt has {len(prompt):,} tokens; {self.allowed()}")
                want = max_new_tokens if max_new_tokens is not None else self.limit - len(prompt)
                want = min(want, self.defaults.get("max_tokens", want))  # the generation config's cap (vLLM's)
                field = "max_tokens" if max_new_tokens is not None else param
                for j in range(body.n):
                    sampling = body.sampling(seed_offset=j, logprobs=logprobs, defaults=self.defaults)
                    stream = self.runner.submit(
                        prompt,
                        want,
                        sampling,
                        stop=body.stop or (),
                        ignore_eos=body.ignore_eos,
                        skip_special_tokens=body.skip_special_tokens,
                        include_stop_str_in_output=body.include_stop_str_in_output,
                    )
                    streams.append(stream)
        except (ValueError, QueueFull, RuntimeError) as e:
            for stream in streams:
                self.runner.abort(stream)
            if isinstance(e, QueueFull):
                raise ApiError(
                    429,
                    str(e),
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(e.retry_after)},
                ) from None
            if isinstance(e, RuntimeError):
                raise ApiError(503, str(e), type="server_error") from None
            message = str(e)
            named = next((f for f in ("stop_token_ids", "min_tokens") if message.startswith(f)), None)
            raise ApiError(
                400, message, param=named or (param if message.startswith("prompt token") else field)
            ) from None
        return streams

    async def respond(
        self,
        raw: HTTPRequest,
        streams: list[Stream],
        render: Render,
        body: CompletionRequest | ChatCompletionRequest,
    ) -> Response:
        """The response to `streams`: an SSE stream if `body.stream`, else one JSON object once all have ended (499,
        read by nobody, if the client left first: its requests are aborted). Raises ApiError 500 if the engine
        failed."""
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_sse(self.runner, streams, render, usage), media_type="text/event-stream")
        collect = asyncio.ensure_future(_collect(streams))
        gone = asyncio.ensure_future(_disconnected(raw))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                for stream in streams:
                    self.runner.abort(stream)
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # the client is gone: nobody reads this
        events = collect.result()
        error = next((e.error for group in events for e in group if e.error), None)
        if error is not None and self.runner.closing:
            raise ApiError(503, error, type="server_error", code="service_unavailable")
        if error is not None:
            raise ApiError(500, f"the engine failed: {error}", type="server_error")
        return JSONResponse(render.response([_merge(group) for group in events], streams))


def too_many_sequences(prompts: int, n: int, room: int, param: str) -> ApiError:
    """The 400 for `prompts` x `n` sequences, more than the `room` (--max-waiting) the server ever queues at once,
    naming n when it is above 1, else the prompt's field `param`."""
    return ApiError(
        400,
        f"{prompts:,} prompt(s) x n = {n} is {prompts * n:,} sequences, more than this server ever queues at once "
        f"(--max-waiting = {room}); send at most {room}",
        param="n" if n > 1 else param,
    )


async def _disconnected(raw: HTTPRequest) -> None:
    """Returns when the client has closed the connection (the body was read: the next message is the disconnect)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _collect(streams: list[Stream]) -> list[list[Event]]:
    """Every stream's events, once all have ended."""

    async def drain(stream: Stream) -> list[Event]:
        return [event async for event in stream]

    return list(await asyncio.gather(*map(drain, streams)))


def _merge(events: list[Event]) -> Event:
    """A stream's events as one (its text and tokens concatenated, the last one's finish and counts)."""
    out = Event()
    for e in events:
        out.text += e.text
        out.token_ids += e.token_ids
        out.logprobs += e.logprobs
        out.top_logprobs += e.top_logprobs
        out.finish_reason, out.stop_reason, out.error = e.finish_reason, e.stop_reason, e.error or out.error
        out.prompt_tokens, out.completion_tokens, out.cached_tokens = (
            e.prompt_tokens,
            e.completion_tokens,
            e.cached_tokens,
        )
    return out


async def _merged(streams: list[Stream]) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) of all streams as they come; ends when every stream has ended."""
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    async def pump(index: int, stream: Stream) -> None:
        async for event in stream:
            await queue.put((index, event))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while True:
                index, event = await queue.get()
                yield index, event
                if event.finish_reason is not None or event.error is not None:
                    break
    finally:
        for task in tasks:
            task.cancel()


async def _sse(runner: EngineRunner, streams: list[Stream], render: Render, usage: bool) -> AsyncIterator[str]:
    """The server-sent events of a streamed response (an engine failure is a last `error` event); aborts every
    stream when it ends, so a client that goes away frees its requests."""
    finals: dict[int, Event] = {}

    def chunk(obj: dict[str, Any]) -> str:  # with include_usage, OpenAI's chunks carry "usage": null until the last
        return _data({**obj, "usage": None} if usage else obj)

    try:
        for index in range(len(streams)):
            first = render.first_chunk(index)
            if first is not None:
                yield chunk(first)
        async for index, event in _merged(streams):
            if event.error is not None:  # the last event; a client reading to [DONE] still ends
                closing = runner.closing
                message = event.error if closing else f"the engine failed: {event.error}"
                yield _data(error_body(message, type="server_error", code="service_unavailable" if closing else None))
                yield "data: [DONE]\n\n"
                return
            yield chunk(render.chunk(index, event))
            if event.finish_reason is not None:
                finals[index] = event
        if usage:
            yield _data(render.usage_chunk(list(finals.values()), streams))
        yield "data: [DONE]\n\n"
    finally:
        for stream in streams:
            runner.abort(stream)  # (a finished request is left as it is)


def _data(obj: dict[str, Any]) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
