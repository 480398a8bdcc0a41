"""What one request may cost the OpenAI-compatible server, proven structurally on 127.0.0.1 (never by timing): a body
over a count or size limit is refused before any element of it is validated, rendered or tokenised; tokenisation
and chat-template rendering run off the event loop, so /health and a running stream answer while one is held; a
body that does not arrive within its deadline is answered 408 in OpenAI's format and its connection closed; a lone
surrogate anywhere in a body (keys too) is a 400 naming where, never a 500 or a 415; the JSON parse pauses the
garbage collector and leaves it as it found it."""

import asyncio
import gc
import http.client
import json
import socket
import threading
import time
import urllib.request
from typing import Any, NamedTuple

import pytest
from flax import nnx
from test_server import CFG, TOK, address, engine_config

from core.byte_tokenizer import ByteTokenizer
from core.model import Transformer
from experiments.server import body, cli
from experiments.server.app import ErrorResponse, create_app
from experiments.server.chat import ChatTemplate
from experiments.server.protocol import CompletionRequest
from experiments.server.runner import EngineRunner
from kvcache import formats
from kvcache.serving import EngineConfig

BODY_TIMEOUT = 0.5  # the test server's body deadline (the command's is cli.BODY_TIMEOUT)
LIMIT = 256  # engine_config's max_model_len, less than its KV pool: the server's limit L
NAMED = (  # the test template of test_server, rendering a message's name too
    "{% for m in messages %}<|bos|>{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}\n{{ m.content }}<|eos|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


def on_loop() -> bool:
    """Whether an asyncio event loop runs on the calling thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class SpyTokenizer(ByteTokenizer):
    """The byte tokenizer, recording for each text it encodes whether an event loop runs on the encoding thread, and
    holding each encoding until `release` is set (it is, unless a test clears it); `entered` is set on each."""

    def __init__(self):
        super().__init__()
        self.calls: list[bool] = []
        self.entered, self.release = threading.Event(), threading.Event()
        self.release.set()

    def _record(self) -> None:
        self.calls.append(on_loop())
        self.entered.set()
        assert self.release.wait(60), "the test never released the tokenizer"

    def encode(self, text, **kw):
        self._record()
        return super().encode(text, **kw)

    def encode_prompt(self, text, **kw):
        self._record()
        return super().encode_prompt(text, **kw)


class SpyTemplate(ChatTemplate):
    """A chat template recording, for each rendering, whether an event loop runs on the rendering thread."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.renders: list[bool] = []

    def render(self, messages):
        self.renders.append(on_loop())
        return super().render(messages)


class Served(NamedTuple):
    url: str
    tok: SpyTokenizer
    chat: SpyTemplate
    runner: EngineRunner


@pytest.fixture(scope="module")
def served():
    """A bf16 server whose OpenAI layer tokenises with a SpyTokenizer and renders with a SpyTemplate, with a body
    deadline of BODY_TIMEOUT."""
    fmt = formats.get("bf16")
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    _, runner = cli.build_server(model, fmt, engine_config(fmt), TOK, model_name="tiny")
    tok = SpyTokenizer()
    chat = SpyTemplate(NAMED, tok, source="test")
    app = create_app(runner, tok, model_name="tiny", chat=chat)
    try:
        with cli.serve_in_thread(app, body_timeout=BODY_TIMEOUT) as url:
            yield Served(url, tok, chat, runner)
    finally:
        runner.stop()


@pytest.fixture
def spies(served):
    """The spies, emptied."""
    served.tok.calls.clear()
    served.tok.entered.clear()
    served.chat.renders.clear()
    return served.tok, served.chat


def post_raw(url: str, path: str, body: bytes | dict[str, Any], timeout: float = 60) -> tuple[int, bytes]:
    """(status, raw body) of a JSON POST (bytes are sent as they are)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(*address(url), timeout=timeout)
    conn.request("POST", path, data, {"content-type": "application/json"})
    response = conn.getresponse()
    out = response.status, response.read()
    conn.close()
    return out


def error_of(raw: bytes) -> dict[str, Any]:
    """The error object of an error response, checked to be one line of ASCII JSON."""
    assert raw.isascii() and b"\n" not in raw, raw[:300]
    return json.loads(raw)["error"]


MESSAGE = {"role": "user", "content": "a"}
OVER: list[tuple[str, dict[str, Any], str, str]] = [  # (path, body over a limit, param, words) ; bad elements after
    ("/v1/completions", {"prompt": ["a"] * 300 + [5]}, "prompt", "301 prompt(s) x n = 1 is 301 sequences"),
    ("/v1/completions", {"prompt": [[1]] * 300 + [["x"]]}, "prompt", "--max-waiting = 256); send at most 256"),
    ("/v1/completions", {"prompt": ["a"] * 100, "n": 3}, "n", "100 prompt(s) x n = 3 is 300 sequences"),
    ("/v1/completions", {"prompt": [1] * LIMIT + ["x"]}, "prompt", "the prompt has 257 token ids; this server's"),
    ("/v1/completions", {"prompt": [[1]] * 4 + [[2] * LIMIT + [None]]}, "prompt", "prompt 4 has 257 token ids"),
    # the byte tokenizer's longest token reads 7 characters (<|bos|>): 2 x 255 x 7 at most
    ("/v1/completions", {"prompt": "a" * 3571}, "prompt", "no text of more than 3,570 characters"),
    ("/v1/completions", {"prompt": ["b", "a" * 3571, 7]}, "prompt", "prompt 1 has 3,571 characters"),
    ("/v1/chat/completions", {"messages": [MESSAGE] * LIMIT + [{"role": "robot"}]}, "messages", "at most 255 messages"),
]


@pytest.mark.parametrize("path, body, param, words", OVER, ids=[f"{i}" for i in range(len(OVER))])
def test_a_body_over_a_count_or_size_limit_is_refused_before_it_is_validated_or_tokenised(
    served, spies, path, body, param, words
):
    """Each body is over a limit and also holds a bad element after it: the answer is the limit's 400 (naming the
    field, the value and what is allowed), so the count was checked before any element was validated; and the spies
    saw no tokenisation and no rendering."""
    status, raw = post_raw(served.url, path, body)
    error = error_of(raw)
    assert (status, error["param"]) == (400, param) and words in error["message"], error
    assert spies[0].calls == [] and spies[1].renders == []


def test_a_prompt_within_the_limits_is_tokenised_then_refused_by_its_token_count(served, spies):
    """Text short enough in characters to pass the check before tokenisation, too long in tokens: tokenised (once,
    off the loop), then refused with the limit."""
    status, raw = post_raw(served.url, "/v1/completions", {"prompt": "a" * 300})
    assert status == 400 and "the prompt has 301 tokens" in error_of(raw)["message"]
    assert spies[0].calls == [False]


def test_tokenisation_and_rendering_run_off_the_event_loop_while_health_and_streams_answer(served, spies):
    """A stream runs; a text request's tokenisation is then held (the spy waits on an Event the test controls) for
    longer than the body deadline: meanwhile /health answers and the stream runs to its end (`[DONE]`); released,
    the request returns 200 (its body had arrived: the deadline does not cut it). No event loop ran on the threads
    that tokenised or rendered."""
    tok, chat = spies
    host, port = address(served.url)
    stream = http.client.HTTPConnection(host, port, timeout=30)
    body = {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}
    stream.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    events = stream.getresponse()
    assert events.readline().startswith(b"data: {")
    tok.release.clear()
    result: list[tuple[int, bytes]] = []
    held = threading.Thread(target=lambda: result.append(post_raw(served.url, "/v1/completions", {"prompt": "hi"})))
    held.start()
    try:
        assert tok.entered.wait(30)
        rest = events.read()  # the stream ends while the tokenisation is held
        chunks = rest.count(b"data: {")  # tokens arrive up to EngineConfig.decode_steps per chunk
        assert rest.rstrip().endswith(b"data: [DONE]") and chunks >= 199 // EngineConfig.decode_steps, rest[-300:]
        health = urllib.request.urlopen(served.url + "/health", timeout=30)
        assert json.loads(health.read()) == {"status": "ok"}
        time.sleep(3 * BODY_TIMEOUT)  # past the body deadline, still held
        assert held.is_alive()
    finally:
        tok.release.set()
        held.join(60)
        stream.close()
    assert result and result[0][0] == 200, result
    status, raw = post_raw(served.url, "/v1/chat/completions", {"messages": [MESSAGE], "max_tokens": 2})
    assert status == 200, raw
    assert tok.calls and not any(tok.calls) and chat.renders == [False]


def slow_body(where: tuple[str, int], body: bytes = b"{", length: int = 1000) -> socket.socket:
    """A connection that sent a whole POST head declaring `length` bytes of body, then `body` and nothing more."""
    sock = socket.create_connection(where, timeout=30)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}"
    sock.sendall(head.encode() + b"\r\n\r\n" + body)
    return sock


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's 30 s timeout raises otherwise)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_a_body_that_does_not_arrive_in_time_is_answered_408_and_closed(served):
    """With a body deadline of BODY_TIMEOUT: 20 connections that declare 1000 bytes of body and send 1 (or 500) are
    each answered 408 in OpenAI's format, naming the deadline and the declared length, and closed by the server
    (recv returns b"" before the socket's own 30 s timeout could fire); so is a kept-alive connection's second
    request, after its first was answered; the server still answers."""
    where = address(served.url)
    socks = [slow_body(where, b"{" if i % 2 else b"{" + b" " * 499) for i in range(20)]
    kept = socket.create_connection(where, timeout=30)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = b""
    while b'{"status":"ok"}' not in first:
        first += kept.recv(65536)
    kept.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
    for sock in [*socks, kept]:
        reply = read_to_close(sock)
        sock.close()
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), reply
        error = error_of(payload)
        assert error["type"] == "invalid_request_error" and error["code"] == "request_timeout", error
        assert f"within {BODY_TIMEOUT:g} s of its head (Content-Length: " in error["message"], error
    assert json.loads(urllib.request.urlopen(served.url + "/health", timeout=30).read()) == {"status": "ok"}
    assert served.runner.queued == 0


SURROGATES: list[tuple[str, bytes, str]] = [  # (path, body with a lone surrogate, param)
    ("/v1/completions", b'{"prompt": "a", "model": "\\ud800"}', "model"),
    ("/v1/completions", b'{"prompt": "a", "\\ud800": 1}', "\\ud800"),
    ("/v1/completions", b'{"prompt": "a", "user": "x\\udfff"}', "user"),
    ("/v1/completions", b'{"prompt": ["ok", "b\\ud800"]}', "prompt.1"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["\\\\ud800", "\\udc00"]}', "stop.1"),  # the first is text
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a", "name": "\\udc00"}]}', "messages.0.name"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a", "\\ud800": 1}]}', "messages.0.\\ud800"),
]


@pytest.mark.parametrize("path, body, param", SURROGATES)
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(served, spies, path, body, param):
    """A lone surrogate in a value the server answers with (model), renders (a message's name), ignores (user) or
    in a field name: one line of ASCII JSON, 400, `param` its path (a key JSON-escaped), saying what is allowed;
    nothing was tokenised. A valid pair (an astral character) and an escaped backslash pass."""
    status, raw = post_raw(served.url, path, body)
    error = error_of(raw)
    assert (status, error["param"]) == (400, param), error
    assert "lone surrogate (U+D" in error["message"] and "only text is allowed" in error["message"], error
    assert spies[0].calls == []
    status, raw = post_raw(served.url, "/v1/completions", b'{"prompt": "\\ud83d\\ude00 \\\\ud800", "max_tokens": 1}')
    assert status == 200, raw
    assert ErrorResponse({"message": "\ud800"}).body == b'{"message":"\\ud800"}'  # any str: ASCII JSON


def test_parsing_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    """body.parse runs json.loads with the collector off; overlapping pauses share one, the collector back on
    when the last ends, and left off if it was off before."""
    seen: list[bool] = []
    loads = json.loads

    def spy(data):
        seen.append(gc.isenabled())
        return loads(data)

    monkeypatch.setattr(body.json, "loads", spy)
    limits = body.Limits(sequences=4, tokens=LIMIT, text_chars=1000, allowed="test")
    assert gc.isenabled()
    assert body.parse(b'{"prompt": [1, 2]}', CompletionRequest, limits).prompt == [1, 2]
    assert seen == [False] and gc.isenabled()
    pause = body._GCPause()
    with pause:
        with pause:  # a second thread's parse, overlapping
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with pause:
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_limits_read_the_tokenizer_and_the_server(served):
    """Limits.of: --max-waiting as it is now, L, and the text bound 2 (L - 1) x the most characters one token reads
    (the byte tokenizer's: a special's name, 7)."""
    serving = create_app(served.runner, ByteTokenizer(), model_name="tiny").state.serving
    limits = body.Limits.of(serving)
    assert (limits.sequences, limits.tokens, limits.text_chars) == (served.runner.max_waiting, LIMIT, 2 * 255 * 7)
