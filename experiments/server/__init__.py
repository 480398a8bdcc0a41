"""An OpenAI-compatible HTTP server over kvcache's engine (FastAPI + uvicorn: the [serve] extra).

    python -m experiments.serve --http --workdir runs/quickstart [--port 8000] [--kv-format fp4]

`runner` runs the engine in its own thread and hands each request's output to an asyncio stream; `serving` is the
OpenAI API's logic over a runner (completions, chat, models, health, metrics; errors in OpenAI's format); `routes`
the FastAPI routers that call it, one per endpoint group; `app` assembles them into the app with its exception
handlers; `render` the JSON of responses and streamed chunks; `protocol` the request bodies; `chat` the chat
templates; `metrics` the Prometheus metrics; `cli` the command line (`experiments.serve --http`), `build_server`
and `serve_in_thread`, which tests and benchmarks use.

A new endpoint: a route function in experiments.server.routes, its logic a method of serving.OpenAIServing, its
request body (if any) a model in protocol.
"""
