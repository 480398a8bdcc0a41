"""The HTTP layer: a FastAPI app speaking the OpenAI API over an `EngineRunner`.

    app = create_app(runner, tokenizer, model_name="quickstart", chat=ChatTemplate(...) or None)
    uvicorn.run(app, host="127.0.0.1", port=8000)   # experiments.server.cli.serve_in_thread adds the deadlines

Endpoints (experiments.server.routes): POST /v1/completions, POST /v1/chat/completions (both also streaming, as
server-sent events in the OpenAI API's chunk format ending with `data: [DONE]`), GET /v1/models, GET /health,
GET /metrics (Prometheus). What each answers is experiments.server.serving's.

Every error is OpenAI's error object (experiments.server.protocol.error_body), as ASCII JSON (text that is no Unicode
in an error's message cannot break it), on one line. Status codes: 200; 400 a request the server cannot honour
(malformed JSON, a bad or unimplemented parameter, text holding a lone surrogate, more prompts or messages or a
longer prompt than the server's limits, a chat request for a model without a chat template), with the field in the
error's `param`; 404 an unknown model or path; 408 a body that did not arrive within its deadline (the connection's:
experiments.server.cli.Connection); 413 a body over the size limit (16 MiB unless told); 415 a body that is not
JSON; 429 the queue is full (with Retry-After); 500 an engine failure (or any unexpected exception); 503 the engine
has stopped (GET /health too).

What one request may cost (bytes, time, and the work done before it is refused or queued) is stated in
experiments.server.body: the body's size and deadline bound its parse, and its counts and sizes are checked before
anything in it is validated, rendered or tokenised, all of which runs on worker threads, off the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from core.tokenizer import Tokenizer
from experiments.server.chat import ChatTemplate
from experiments.server.protocol import error_body
from experiments.server.routes import ROUTERS
from experiments.server.runner import EngineRunner
from experiments.server.serving import ApiError, OpenAIServing

__all__ = ["ApiError", "ErrorResponse", "create_app"]

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # union branches in pydantic's error locations


MAX_BODY_BYTES = 16 * 2**20
"""The largest request body read by default: 16 MiB holds about 2M token ids, far past any context this serves."""


def create_app(
    runner: EngineRunner,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    chat: ChatTemplate | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    defaults: Mapping[str, Any] | None = None,
    tokens_as_ids: bool = False,
) -> FastAPI:
    """The app serving `runner`'s engine as `model_name` (module docstring): an `OpenAIServing` over them as
    `app.state.serving`, the routers of experiments.server.routes, and the handlers that answer every error in
    OpenAI's format. `chat`: the chat template, or None (chat completions are then refused with a 400 saying so).
    `defaults`, `tokens_as_ids`: OpenAIServing's (the generation config's sampling defaults; logprobs tokens as
    "token_id:N"). A body longer than `max_body_bytes` (declared in Content-Length, or counted as it arrives) is
    answered 413 before it is parsed. The runner is started and stopped by the caller."""
    app = FastAPI(title="lowbit-moe-lab", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    app.state.serving = OpenAIServing(
        runner, tokenizer, model_name=model_name, chat=chat, defaults=defaults, tokens_as_ids=tokens_as_ids
    )
    for router in ROUTERS:
        app.include_router(router)
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _crash)
    return app


class _BodyLimit:
    """ASGI middleware: a request whose body exceeds `limit` bytes is answered 413 in OpenAI's format, from its
    Content-Length before the app runs, or as soon as the bytes received pass the limit (a chunked body)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def message(self) -> str:
        return f"the request body exceeds this server's limit of {self.limit:,} bytes"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await ErrorResponse(error_body(self.message()), status_code=413)(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:  # raised out of the route's body read (body.read_body): _http answers
                raise HTTPException(413, self.message())
            return message

        await self.app(scope, counted, send)


class ErrorResponse(JSONResponse):
    """A JSONResponse written as ASCII JSON: any str survives it, a lone surrogate included (as `\\ud800`), where
    JSONResponse's UTF-8 would raise."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


async def _api_error(request: HTTPRequest, e: ApiError) -> JSONResponse:
    """An ApiError as its status, body and headers."""
    return ErrorResponse(e.body, status_code=e.status, headers=e.headers)


async def _invalid(request: HTTPRequest, e: RequestValidationError) -> JSONResponse:
    """A body that fails the request's model (experiments.server.body.parse has read it as JSON): 400 naming the
    first field at fault in `param` (None for the body as a whole) and its value."""
    first = e.errors()[0]
    if first.get("type") == "not_implemented":  # an unknown field that changes the answer (protocol.ANSWER_CHANGING)
        return ErrorResponse(error_body(first["msg"], param=first["ctx"]["field"]), status_code=400)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # pydantic names the union branch it tried ('str', 'list[int]', 'function-after[...]'): name the field
    param = ".".join(p for p in loc if (p.isidentifier() and p not in _TYPE_TAGS) or p.isdigit()) or None
    given = first.get("input")
    head = given[:20] if isinstance(given, list) else given  # a prompt of millions of ids is not dumped whole
    shown = json.dumps(head, default=repr)[:200] if not isinstance(given, dict) or loc else "the body"
    message = f"{param or 'body'} = {shown}: {first.get('msg')}" if loc else f"body: {first.get('msg')}"
    return ErrorResponse(error_body(message, param=param), status_code=400)


async def _http(request: HTTPRequest, e: HTTPException) -> JSONResponse:
    """Starlette's own errors (404 an unknown path, 405 a wrong method) in OpenAI's format."""
    return ErrorResponse(
        error_body(str(e.detail), type="not_found_error" if e.status_code == 404 else "invalid_request_error"),
        status_code=e.status_code,
    )


async def _crash(request: HTTPRequest, e: Exception) -> JSONResponse:
    """Any other exception: 500, naming it."""
    return ErrorResponse(error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"), 500)
