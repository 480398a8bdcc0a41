"""Serve a run (trained, or imported with `python -m experiments.hf import`) through the OpenAI API over HTTP.

    python -m experiments.serve --http --workdir runs/quickstart [--host 127.0.0.1] [--port 8000]
        [--kv-format bf16|fp8|fp4] [--scale-rule mse|mx] [--kv-memory-mib 64] [--max-num-seqs 16]
        [--max-num-batched-tokens 256] [--max-model-len N] [--max-waiting 256] [--max-body-mib 16]
        [--served-model-name NAME] [--chat-template FILE] [--generation-config auto|vllm|FOLDER]
        [--return-tokens-as-token-ids] [--site 0] [--seed 0]

The model loads on one device as in `experiments.serve` (any mesh it trained on; `--site` picks a federated run's
site), its KV pool is `--kv-memory-mib` in the run's KV format unless `--kv-format` says otherwise, and the engine's
step is compiled for every batch shape before the server listens ("compiled in X s"). Then `experiments.server.app`
answers until Ctrl-C or SIGTERM, which end every open request first (streams with an error event and `[DONE]`, waiting
requests with a 503). A client must send each request's head within 10 s of connecting or of its last response, and
its body within 30 s of its head (else 408) (`Connection`); an idle kept-alive connection is closed after uvicorn's
5 s. What one request may cost is stated in experiments.server.body. The chat template is the tokenizer's
(`experiments.server.chat`) or `--chat-template FILE`. `--generation-config` (auto, vllm or a folder, as vLLM names
it: experiments.hf.generation) gives the model's end ids (generation_config.json's eos_token_id list, beside the
tokenizer's EOS) and the sampling defaults of requests that set none; prompts are framed as the model was trained
(experiments.hf.generation.run_tokenizer: an imported checkpoint's tokenizer post-processor, our runs' BOS).

Exit status: 0 after Ctrl-C or SIGTERM (once every open request was answered); 2 a bad flag (an `error:` line naming
the flag, the value and what is allowed, before the model is loaded), 1 a damaged checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from core.model import Transformer
from core.tokenizer import Tokenizer
from experiments import args as args_lib
from experiments import engine as engine_lib
from experiments.hf import generation
from experiments.hf import load as hf_load
from experiments.server import chat as chat_lib
from experiments.server.app import MAX_BODY_BYTES, create_app
from experiments.server.metrics import ServerMetrics
from experiments.server.protocol import error_body
from experiments.server.runner import EngineRunner
from kvcache import serving as kv_serving
from kvcache.formats import Format

__all__ = ["build_parser", "build_server", "main", "serve_in_thread"]


def build_parser() -> argparse.ArgumentParser:
    """`serve --http`'s command line; every flag's value is checked as it is parsed (nothing is loaded)."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.serve --http",
        description=(__doc__ or "").split("\n")[0],
        formatter_class=args_lib.HelpFormatter,
    )
    args_lib.add_run_flags(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=args_lib.integer(0, maximum=65535), default=8000, help="port (0: any free one)")
    args_lib.add_kv_flags(parser)
    parser.add_argument("--max-num-seqs", type=args_lib.integer(1), default=16, help="requests in one engine step")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=args_lib.integer(1),
        default=None,
        help=f"tokens in one engine step (default: {engine_lib.SERVED_STEP_TOKENS}, or half --max-model-len if less)",
    )
    parser.add_argument(
        "--max-model-len",
        type=args_lib.integer(2),
        default=None,
        help="longest request (prompt + output tokens), at least 2 x --max-num-batched-tokens (default: the model's "
        "context, an imported checkpoint's max_position_embeddings or the run's data.seq_len)",
    )
    parser.add_argument(
        "--max-waiting", type=args_lib.integer(1), default=256, help="queued requests before a 429 answers"
    )
    parser.add_argument(
        "--max-body-mib",
        type=args_lib.number(1 / 1024),
        default=MAX_BODY_BYTES / 2**20,
        help="largest request body read (a larger one answers 413 before it is parsed)",
    )
    parser.add_argument("--served-model-name", default=None, help="the model's name in the API (default: workdir's)")
    parser.add_argument("--chat-template", default=None, help="a Jinja2 chat template file (default: tokenizer's)")
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="the generation config (experiments.hf.generation): auto (the model's generation_config.json: its end "
        "ids and sampling defaults), vllm (its end ids, no sampling defaults) or a FOLDER holding one",
    )
    parser.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name tokens 'token_id:N' (a request's return_tokens_as_token_ids overrides)",
    )
    parser.add_argument(
        "--seed",
        type=args_lib.integer(0, maximum=args_lib.MAX_SEED),
        default=0,
        help="seed of requests that give none",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m experiments.serve --http` (module docstring); returns the exit status. SIGTERM or Ctrl-C while the
    model loads or compiles (before the server listens) stops it too, with exit status 0 once the step under way
    returns: nothing was being served."""
    previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        return _main(argv)
    except (KeyboardInterrupt, Stopped):
        print("stopped before serving (SIGTERM or Ctrl-C while the model loaded or compiled)", file=sys.stderr)
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run, tok = engine_lib.load_run(args.workdir)
        fmt, source = engine_lib.kv_format(args, run)
        gen = generation.for_run(run, args.generation_config)
        config = engine_lib.engine_config(args, run, fmt, tok, eos_ids=gen.eos_ids)
        chat = chat_lib.load_template(args.chat_template, run.data.tokenizer, tok)
    except (args_lib.FlagError, chat_lib.TemplateError, generation.GenerationConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"kv format: {source}", file=sys.stderr)
    print(
        f"generation config: {gen.source} (--generation-config {args.generation_config}): end ids "
        f"{list(config.end_ids)}, sampling defaults {gen.defaults or 'none'}",
        file=sys.stderr,
    )
    length = "--max-model-len" if args.max_model_len else hf_load.context_length(run)[1]
    print(f"max_model_len: {config.max_model_len} tokens ({length})", file=sys.stderr)
    print(f"chat template: {chat.source if chat else 'none (chat completions answer 400)'}", file=sys.stderr)
    print(engine_lib.precision_line(args, run), file=sys.stderr)
    model, status = engine_lib.load_model(args.workdir, args.site, args.precision)
    if model is None:
        return status
    name = args.served_model_name or os.path.basename(os.path.normpath(args.workdir))
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"error: --host={args.host} --port={args.port} cannot be listened on: {e.strerror}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    app, runner = build_server(
        model,
        fmt,
        config,
        tok,
        model_name=name,
        chat=chat,
        max_waiting=args.max_waiting,
        max_body_bytes=int(args.max_body_mib * 2**20),
        defaults=gen.defaults,
        tokens_as_ids=args.return_tokens_as_token_ids,
    )
    host, port = sock.getsockname()[:2]
    print(
        f"{fmt.label} KV pool: {runner.engine.capacity_tokens:,} tokens in {args.kv_memory_mib:g} MiB; compiled in "
        f"{time.perf_counter() - started:.1f} s; serving `{name}` on http://{host}:{port}/v1 (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    server = Server(uvicorn.Config(app, http=Connection, log_level="warning", timeout_graceful_shutdown=5), runner)
    terminate = signal.signal(signal.SIGTERM, _stopped)  # uvicorn re-raises the signal once it has shut down
    try:
        server.run(sockets=[sock])
    except (KeyboardInterrupt, Stopped):
        print("stopped: every open request was answered", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, terminate)
        runner.stop()
        sock.close()
    return 0


HEAD_TIMEOUT = 10.0
"""Seconds a connection may take to send a whole request head (request line and headers), counted from when it opens
or its last response ended: idle or slow clients cannot hold the server's sockets."""

BODY_TIMEOUT = 30.0
"""Seconds a request's body may take to arrive whole, counted from the end of its head (16 MiB, the default body limit,
needs 4.5 Mbit/s): a client that declares a body and withholds or trickles it is answered 408 and disconnected."""


class Connection(H11Protocol):
    """uvicorn's h11 connection with a deadline on each request head (`head_timeout`, HEAD_TIMEOUT by default) and on
    each request body (`body_timeout`, BODY_TIMEOUT by default, from the end of its head): a client that connects and
    sends nothing, or sends its headers slowly, is disconnected when the first passes; one whose body has not arrived
    whole when the second passes is answered 408 in OpenAI's error format (unless a response has begun) and
    disconnected, and the request's app sees the client gone. (uvicorn itself times out only a kept-alive connection
    idle after a response, and neither a head nor a body trickling bytes.)"""

    head_timeout = HEAD_TIMEOUT
    body_timeout = BODY_TIMEOUT
    _deadline: asyncio.TimerHandle | None = None
    _body_deadline: asyncio.TimerHandle | None = None

    @classmethod
    def with_timeout(cls, seconds: float, body: float = BODY_TIMEOUT) -> type[Connection]:
        """This connection class with a head deadline of `seconds` and a body deadline of `body` seconds."""
        return type(cls.__name__, (cls,), {"head_timeout": seconds, "body_timeout": body})

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.head_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _disarm_body(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _expired(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _body_expired(self, cycle) -> None:
        """The body of `cycle`'s request is late: 408 (if no response has begun), then the connection is closed; the
        app's `receive` answers `http.disconnect` and its sends are dropped."""
        self._body_deadline = None
        if cycle is not self.cycle or not cycle.more_body or cycle.response_complete or self.transport.is_closing():
            return
        if not cycle.response_started:
            limit = f"{self.body_timeout:g} s"
            declared = dict(self.headers).get(b"content-length", b"").decode("latin-1")
            body = json.dumps(
                error_body(
                    f"the request body did not arrive within {limit} of its head"
                    + (f" (Content-Length: {declared})" if declared else "")
                    + f"; a body must arrive whole within {limit}",
                    code="request_timeout",
                ),
                separators=(",", ":"),
            ).encode()
            length = str(len(body)).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", length), (b"connection", b"close")]
            with contextlib.suppress(h11.LocalProtocolError):
                for event in (h11.Response(status_code=408, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.close()

    def connection_made(self, transport):
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc):
        self._disarm()
        self._disarm_body()
        super().connection_lost(exc)

    def handle_events(self):
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # a whole head arrived: its request runs
            self._disarm()
            if not cycle.more_body:
                self._disarm_body()
            elif self._body_deadline is None:
                self._body_deadline = self.loop.call_later(self.body_timeout, self._body_expired, cycle)

    def on_response_complete(self):
        self._disarm_body()
        self._arm()  # (before: a pipelined request's head may already be here, handled within)
        super().on_response_complete()


class Stopped(Exception):
    """SIGTERM, once uvicorn has shut the server down (as KeyboardInterrupt is SIGINT)."""


def _stopped(signum, frame):
    raise Stopped


class Server(uvicorn.Server):
    """uvicorn's server that, told to stop (Ctrl-C, SIGTERM), first closes the runner (EngineRunner.close): every
    open stream ends with an error event and `data: [DONE]`, every waiting non-streamed request gets a 503 in
    OpenAI's format, new requests a 503; then uvicorn's graceful shutdown finds the connections done."""

    def __init__(self, config: uvicorn.Config, runner: EngineRunner):
        super().__init__(config)
        self.runner = runner

    async def shutdown(self, sockets=None):
        self.runner.close("the server is shutting down")
        await super().shutdown(sockets)


def _bind(host: str, port: int) -> socket.socket:
    """A socket listening on (host, port) (port 0: a free one): clients may connect at once, they wait in its backlog
    until uvicorn accepts them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def build_server(
    model: Transformer,
    fmt: Format,
    config: kv_serving.EngineConfig,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    chat: chat_lib.ChatTemplate | None = None,
    max_waiting: int = 256,
    max_body_bytes: int = MAX_BODY_BYTES,
    defaults: Mapping[str, Any] | None = None,
    tokens_as_ids: bool = False,
    warmup: bool = True,
) -> tuple[FastAPI, EngineRunner]:
    """(app, started runner) serving `model` with a KV pool in `fmt` (experiments.server.app.create_app's
    `max_body_bytes`, `defaults` and `tokens_as_ids`): the engine is warmed up (every batch shape compiled; with a
    default repetition penalty, the penalised variants too) before the runner starts, unless `warmup` is False (the
    first requests then compile). Stop the runner (`runner.stop()`) when done."""
    engine = kv_serving.Engine(model, fmt, config)
    if warmup:
        engine.warmup(masked=(defaults or {}).get("repetition_penalty", 1.0) != 1.0)
    runner = EngineRunner(engine, tokenizer, max_waiting=max_waiting, metrics=ServerMetrics(model_name))
    runner.start()
    app = create_app(
        runner,
        tokenizer,
        model_name=model_name,
        chat=chat,
        max_body_bytes=max_body_bytes,
        defaults=defaults,
        tokens_as_ids=tokens_as_ids,
    )
    return app, runner


@contextlib.contextmanager
def serve_in_thread(
    app: FastAPI,
    *,
    host: str = "127.0.0.1",
    timeout: float = 60.0,
    runner: EngineRunner | None = None,
    head_timeout: float = HEAD_TIMEOUT,
    body_timeout: float = BODY_TIMEOUT,
) -> Iterator[str]:
    """Runs `app` with uvicorn on a thread, on a free port of `host`, as the command does (`Connection` with
    `head_timeout` and `body_timeout`); yields its base URL ("http://host:port") once it accepts connections, and
    shuts it down on exit (open connections get 5 s); with `runner` (app's), shuts down as the command does on a
    signal (`Server`: the runner is closed first)."""
    sock = _bind(host, 0)
    config = uvicorn.Config(
        app,
        http=Connection.with_timeout(head_timeout, body_timeout),
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config) if runner is None else Server(config, runner)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP server did not start within {timeout} s")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
