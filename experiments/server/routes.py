"""The HTTP routes, as FastAPI routers over the app's `OpenAIServing` (experiments.server.serving): each route reads
and checks its request body (`experiments.server.body.read_body`) and hands it to the serving object, which holds
the logic. `ROUTERS` lists them, in the order `create_app` includes them.

  completions   POST /v1/completions
  chat          POST /v1/chat/completions
  info          GET /v1/models, GET /v1/models/{id}, GET or HEAD /health, GET /metrics

A new endpoint is one route function in the router of its group (or a new router added to ROUTERS) and one method
of OpenAIServing; its request body, if any, a model in experiments.server.protocol read with `read_body`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from experiments.server.body import read_body
from experiments.server.protocol import ChatCompletionRequest, CompletionRequest
from experiments.server.serving import OpenAIServing

__all__ = ["ROUTERS", "chat", "completions", "info", "serving"]


def serving(request: HTTPRequest) -> OpenAIServing:
    """The app's serving object (`app.state.serving`, set by create_app): the routes' dependency."""
    return request.app.state.serving


Serving = Annotated[OpenAIServing, Depends(serving)]

completions = APIRouter(tags=["completions"])
chat = APIRouter(tags=["chat"])
info = APIRouter(tags=["info"])


@completions.post("/v1/completions")
async def create_completion(raw: HTTPRequest, s: Serving) -> Response:
    """POST /v1/completions (OpenAIServing.completions), its body read by `read_body`."""
    return await s.completions(await read_body(raw, CompletionRequest, s), raw)


@chat.post("/v1/chat/completions")
async def create_chat_completion(raw: HTTPRequest, s: Serving) -> Response:
    """POST /v1/chat/completions (OpenAIServing.chat_completions), its body read by `read_body`."""
    return await s.chat_completions(await read_body(raw, ChatCompletionRequest, s), raw)


@info.get("/v1/models")
async def models(s: Serving) -> dict[str, Any]:
    """GET /v1/models (OpenAIServing.models)."""
    return s.models()


@info.get("/v1/models/{model_id}")
async def model(model_id: str, s: Serving) -> dict[str, Any]:
    """GET /v1/models/{model_id} (OpenAIServing.model)."""
    return s.model(model_id)


@info.api_route("/health", methods=["GET", "HEAD"])
async def health(s: Serving) -> Response:
    """GET or HEAD /health (OpenAIServing.health; HEAD: its status without the body)."""
    return s.health()


@info.get("/metrics")
async def metrics(s: Serving) -> Response:
    """GET /metrics (OpenAIServing.metrics)."""
    return s.metrics()


ROUTERS = (completions, chat, info)
