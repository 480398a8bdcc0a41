"""An OpenAI-compatible HTTP server over kvcache's engine (FastAPI + uvicorn).

    python -m experiments.serve --http --workdir runs/quickstart [--port 8000] [--kv-format fp4]

`runner` runs the engine in its own thread; `app` is the HTTP layer (the OpenAI API, SSE streaming, errors in
OpenAI's format); `protocol` the request bodies; `chat` the chat templates; `metrics` the Prometheus metrics;
`cli` the command line (`experiments.serve --http`) and `serve_in_thread`, which tests and benchmarks use.
"""
