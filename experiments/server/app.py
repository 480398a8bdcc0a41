"""The HTTP layer: a FastAPI app speaking the OpenAI API over an `EngineRunner`.

    app = create_app(runner, tokenizer, model_name="quickstart", chat=ChatTemplate(...) or None)
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions, POST /v1/chat/completions (both also streaming, as server-sent events in the
OpenAI API's chunk format ending with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus).

Status codes: 200; 400 a request the server cannot honour (malformed JSON, a bad or unimplemented parameter, a
prompt longer than max_model_len or the KV pool, a chat request for a model without a chat template), with the
field in the error's `param`; 404 an unknown model or path; 429 the queue is full (with Retry-After); 500 an
engine failure; 503 the engine has stopped (GET /health). A client that disconnects, streaming or not, has its
requests aborted and their KV blocks freed before the engine's next step.

Prompts given as text are tokenized with BOS (as `experiments.serve` and training documents begin); token-id
prompts are taken as they are. The reported `usage.prompt_tokens_details.cached_tokens` is the prompt tokens the
prefix cache supplied.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from experiments.server.chat import TemplateError
from experiments.server.metrics import CONTENT_TYPE_LATEST
from experiments.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from experiments.server.runner import Event, QueueFull, Stream

if TYPE_CHECKING:
    from core.tokenizer import Tokenizer
    from experiments.server.chat import ChatTemplate
    from experiments.server.runner import EngineRunner

__all__ = ["ApiError", "create_app"]

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # union branches in pydantic's error locations


class ApiError(Exception):
    """An error answered in OpenAI's format."""

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


def create_app(
    runner: EngineRunner, tokenizer: Tokenizer, *, model_name: str, chat: ChatTemplate | None = None
) -> FastAPI:
    """The app serving `runner`'s engine as `model_name` (module docstring); `chat`: the chat template, or None
    (chat completions are then refused with a 400 saying so). The runner is started and stopped by the caller."""
    app = FastAPI(title="lowbit-moe-lab", docs_url=None, redoc_url=None, openapi_url=None)
    engine = runner.engine
    limit = min(engine.config.max_model_len, engine.capacity_tokens)  # longest request (prompt + output)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return JSONResponse(e.body, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"malformed JSON body: {first.get('msg')}"), status_code=400)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        # pydantic names the union branch it tried ('str', 'list[int]', 'function-after[...]'): name the field
        param = ".".join(p for p in loc if (p.isidentifier() and p not in _TYPE_TAGS) or p.isdigit()) or None
        given = first.get("input")
        shown = json.dumps(given)[:200] if not isinstance(given, dict) or loc else "the body"
        message = f"{param or 'body'} = {shown}: {first.get('msg')}" if loc else f"body: {first.get('msg')}"
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        return JSONResponse(
            error_body(str(e.detail), type="not_found_error" if e.status_code == 404 else "invalid_request_error"),
            status_code=e.status_code,
        )

    @app.exception_handler(Exception)
    async def _crash(request, e: Exception):
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"), 500)

    @app.get("/health")
    async def health():
        if runner.healthy:
            return {"status": "ok"}
        return JSONResponse({"status": "stopped", "error": runner.error}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        assert runner.metrics is not None, "create_app needs a runner with metrics"
        return Response(runner.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "lowbit-moe-lab",
            "max_model_len": limit,
        }
        return {"object": "list", "data": [card]}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist; this server serves `{model_name}`",
                param="model",
                code="model_not_found",
            )

    def submit(prompts: list[list[int]], body, max_new_tokens, *, param: str, logprobs: int | None) -> list[Stream]:
        """One stream per (prompt, completion), in the order the choices are numbered; refuses all or none. A
        refusal names `param` (the prompt) when the prompt alone is at fault, else max_tokens."""
        streams: list[Stream] = []
        field = param
        try:
            for prompt in prompts:
                field = param
                if len(prompt) >= limit:
                    raise ValueError(
                        f"the prompt has {len(prompt)} tokens; this server's limit is {limit} tokens for a prompt and "
                        f"its output together (max_model_len = {engine.config.max_model_len}, KV pool = "
                        f"{engine.capacity_tokens} tokens), so a prompt may have at most {limit - 1}"
                    )
                want = max_new_tokens if max_new_tokens is not None else limit - len(prompt)
                field = "max_tokens" if max_new_tokens is not None else param
                for j in range(body.n):
                    sampling = body.sampling(seed_offset=j, logprobs=logprobs)
                    streams.append(runner.submit(prompt, want, sampling, stop=body.stop, ignore_eos=body.ignore_eos))
        except (ValueError, QueueFull, RuntimeError) as e:
            for stream in streams:
                runner.abort(stream)
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
            raise ApiError(400, str(e), param=param if str(e).startswith("prompt token") else field) from None
        return streams

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: HTTPRequest):
        check_model(body.model)
        prompts = [tokenizer.encode(p).tolist() if isinstance(p, str) else list(p) for p in body.prompts()]
        streams = submit(prompts, body, body.max_tokens, param="prompt", logprobs=body.logprobs)
        return await respond(raw, streams, _Completion(tokenizer, model_name, body), body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: HTTPRequest):
        check_model(body.model)
        if chat is None:
            raise ApiError(
                400,
                f"the model `{model_name}` has no chat template (its tokenizer defines none); use "
                "/v1/completions, or start the server with --chat-template FILE",
                param="messages",
            )
        try:
            prompt = chat.encode([m.as_dict() for m in body.messages])
        except TemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        streams = submit([prompt], body, body.max_new_tokens, param="messages", logprobs=logprobs)
        return await respond(raw, streams, _Chat(tokenizer, model_name, body), body)

    async def respond(raw: HTTPRequest, streams: list[Stream], render: _Render, body) -> Response:
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_sse(runner, streams, render, usage), media_type="text/event-stream")
        collect = asyncio.ensure_future(_collect(streams))
        gone = asyncio.ensure_future(_disconnected(raw))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                for stream in streams:
                    runner.abort(stream)
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # the client is gone: nobody reads this
        events = collect.result()
        error = next((e.error for group in events for e in group if e.error), None)
        if error is not None:
            raise ApiError(500, f"the engine failed: {error}", type="server_error")
        return JSONResponse(render.response([_merge(group) for group in events], streams))

    return app


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
        out.finish_reason, out.error = e.finish_reason, e.error or out.error
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


async def _sse(runner: EngineRunner, streams: list[Stream], render: _Render, usage: bool) -> AsyncIterator[str]:
    """The server-sent events of a streamed response; aborts every stream if the client goes away."""
    finals: dict[int, Event] = {}
    try:
        for index in range(len(streams)):
            first = render.first_chunk(index)
            if first is not None:
                yield _data(first)
        async for index, event in _merged(streams):
            if event.error is not None:
                yield _data(error_body(f"the engine failed: {event.error}", type="server_error"))
                return
            yield _data(render.chunk(index, event))
            if event.finish_reason is not None:
                finals[index] = event
        if usage:
            yield _data(render.usage_chunk(list(finals.values()), streams))
        yield "data: [DONE]\n\n"
    finally:
        for stream in streams:
            runner.abort(stream)  # (a finished request is left as it is)


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Render:
    """The JSON of one endpoint's responses and chunks."""

    object = ""
    chunk_object = ""
    prefix = ""

    def __init__(self, tokenizer: Tokenizer, model: str, body):
        self.tokenizer, self.model, self.logprobs, self.ids = tokenizer, model, body.logprobs, body.return_token_ids
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())

    def choice(self, index: int, event: Event, stream: Stream | None = None, **fields) -> dict[str, Any]:
        """A choice of a chunk (stream None) or of a response, with the token ids when asked for."""
        out = {"index": index, **fields, "finish_reason": event.finish_reason}
        if self.ids:
            out["token_ids"] = event.token_ids
            if stream is not None:
                out["prompt_token_ids"] = stream.prompt
        return out

    def head(self, object: str) -> dict[str, Any]:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def usage(self, finals: list[Event], streams: list[Stream]) -> dict[str, Any]:
        """Prompt tokens once per prompt (n completions of one prompt share it), completion tokens of every choice."""
        seen, prompt, cached = set(), 0, 0
        for event, stream in zip(finals, streams):
            if id(stream.prompt) not in seen:
                seen.add(id(stream.prompt))
                prompt, cached = prompt + event.prompt_tokens, cached + event.cached_tokens
        completion = sum(e.completion_tokens for e in finals)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def usage_chunk(self, finals: list[Event], streams: list[Stream]) -> dict[str, Any]:
        return {**self.head(self.chunk_object), "choices": [], "usage": self.usage(finals, streams)}

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        return None

    def chunk(self, index: int, event: Event) -> dict[str, Any]:
        raise NotImplementedError

    def response(self, finals: list[Event], streams: list[Stream]) -> dict[str, Any]:
        raise NotImplementedError


class _Completion(_Render):
    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, tokenizer, model, body):
        super().__init__(tokenizer, model, body)
        self._offsets: dict[int, int] = {}

    def _logprobs(self, index: int, event: Event) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        tokens = [self.token(t) for t in event.token_ids]
        offsets, at = [], self._offsets.get(index, 0)
        for text in tokens:
            offsets.append(at)
            at += len(text)
        self._offsets[index] = at
        top = [{self.token(t): lp for t, lp in alts} for alts in event.top_logprobs] if self.logprobs else None
        return {"tokens": tokens, "token_logprobs": event.logprobs, "top_logprobs": top, "text_offset": offsets}

    def chunk(self, index, event):
        choice = self.choice(index, event, text=event.text, logprobs=self._logprobs(index, event))
        return {**self.head(self.chunk_object), "choices": [choice]}

    def response(self, finals, streams):
        choices = [
            self.choice(i, e, s, text=e.text, logprobs=self._logprobs(i, e))
            for i, (e, s) in enumerate(zip(finals, streams))
        ]
        return {**self.head(self.object), "choices": choices, "usage": self.usage(finals, streams)}


class _Chat(_Render):
    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.token(token_id),
            "logprob": logprob,
            "bytes": list(self.tokenizer.decode_bytes([token_id])),
        }

    def _logprobs(self, event: Event) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = [
            {**self._entry(t, lp), "top_logprobs": [self._entry(a, alp) for a, alp in alts]}
            for t, lp, alts in zip(event.token_ids, event.logprobs, event.top_logprobs)
        ]
        return {"content": content}

    def first_chunk(self, index):
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        return {**self.head(self.chunk_object), "choices": [{**choice, "finish_reason": None}]}

    def chunk(self, index, event):
        delta = {"content": event.text} if event.text or event.finish_reason is None else {}
        choice = self.choice(index, event, delta=delta, logprobs=self._logprobs(event))
        return {**self.head(self.chunk_object), "choices": [choice]}

    def response(self, finals, streams):
        choices = [
            self.choice(i, e, s, message={"role": "assistant", "content": e.text}, logprobs=self._logprobs(e))
            for i, (e, s) in enumerate(zip(finals, streams))
        ]
        return {**self.head(self.object), "choices": choices, "usage": self.usage(finals, streams)}
