"""The HTTP layer: a FastAPI app speaking the OpenAI API over an `EngineRunner`.

    app = create_app(runner, tokenizer, model_name="quickstart", chat=ChatTemplate(...) or None)
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints (experiments.server.routes): POST /v1/completions, POST /v1/chat/completions (both also streaming, as
server-sent events in the OpenAI API's chunk format ending with `data: [DONE]`), GET /v1/models, GET /health,
GET /metrics (Prometheus). What each answers is experiments.server.serving's.

Every error is OpenAI's error object (experiments.server.protocol.error_body). Status codes: 200; 400 a request the
server cannot honour (malformed JSON, a bad or unimplemented parameter, a prompt longer than max_model_len or the KV
pool, a chat request for a model without a chat template), with the field in the error's `param`; 404 an unknown model
or path; 413 a body over the size limit (16 MiB unless told); 415 a body that is not JSON; 429 the queue is full (with
Retry-After); 500 an engine failure (or any unexpected exception); 503 the engine has stopped (GET /health too).
"""

from __future__ import annotations

import json

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

__all__ = ["ApiError", "create_app"]

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
) -> FastAPI:
    """The app serving `runner`'s engine as `model_name` (module docstring): an `OpenAIServing` over them as
    `app.state.serving`, the routers of experiments.server.routes, and the handlers that answer every error in
    OpenAI's format. `chat`: the chat template, or None (chat completions are then refused with a 400 saying so).
    A body longer than `max_body_bytes` (declared in Content-Length, or counted as it arrives) is answered 413
    before it is parsed. The runner is started and stopped by the caller."""
    app = FastAPI(title="lowbit-moe-lab", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    app.state.serving = OpenAIServing(runner, tokenizer, model_name=model_name, chat=chat)
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
            return await JSONResponse(error_body(self.message()), status_code=413)(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:  # answered by _http (FastAPI re-raises an HTTPException met reading a body)
                raise HTTPException(413, self.message())
            return message

        await self.app(scope, counted, send)


async def _api_error(request: HTTPRequest, e: ApiError) -> JSONResponse:
    """An ApiError as its status, body and headers."""
    return JSONResponse(e.body, status_code=e.status, headers=e.headers)


async def _invalid(request: HTTPRequest, e: RequestValidationError) -> JSONResponse:
    """A body that is no JSON, or that fails the request's model: 400 naming the first field at fault in `param`
    (None for the body as a whole) and its value."""
    first = e.errors()[0]
    if first.get("type") == "json_invalid":
        return JSONResponse(error_body(f"malformed JSON body: {first.get('msg')}"), status_code=400)
    if isinstance(first.get("input"), bytes | str) and first.get("loc") == ("body",):  # not parsed as JSON at all
        kind = request.headers.get("content-type") or "none"
        return JSONResponse(
            error_body(f"the body must be JSON (Content-Type: application/json); got Content-Type: {kind}"),
            status_code=415,
        )
    if first.get("type") == "not_implemented":  # an unknown field that changes the answer (protocol.ANSWER_CHANGING)
        return JSONResponse(error_body(first["msg"], param=first["ctx"]["field"]), status_code=400)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # pydantic names the union branch it tried ('str', 'list[int]', 'function-after[...]'): name the field
    param = ".".join(p for p in loc if (p.isidentifier() and p not in _TYPE_TAGS) or p.isdigit()) or None
    given = first.get("input")
    head = given[:20] if isinstance(given, list) else given  # a prompt of millions of ids is not dumped whole
    shown = json.dumps(head, default=repr)[:200] if not isinstance(given, dict) or loc else "the body"
    message = f"{param or 'body'} = {shown}: {first.get('msg')}" if loc else f"body: {first.get('msg')}"
    return JSONResponse(error_body(message, param=param), status_code=400)


async def _http(request: HTTPRequest, e: HTTPException) -> JSONResponse:
    """Starlette's own errors (404 an unknown path, 405 a wrong method) in OpenAI's format."""
    return JSONResponse(
        error_body(str(e.detail), type="not_found_error" if e.status_code == 404 else "invalid_request_error"),
        status_code=e.status_code,
    )


async def _crash(request: HTTPRequest, e: Exception) -> JSONResponse:
    """Any other exception: 500, naming it."""
    return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", type="server_error"), 500)
