"""The OpenAI-compatible server, through the real `openai` client (sync and async) and raw HTTP on 127.0.0.1:
greedy outputs equal the in-process engine's in the bf16, fp8 and fp4 KV formats (the engine's own tests cover every
format; the server's path does not depend on it), streamed deltas concatenate to the non-streamed
text, stop strings, seeds, 64 concurrent clients, disconnects free their blocks, a full queue answers 429, bad
requests get OpenAI errors naming the field without disturbing others, and a multi-round chat hits the prefix
cache exactly as far as its token ids share full blocks."""

import asyncio
import dataclasses
import http.client
import json
import pathlib
import re
import socket
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import openai
import pydantic
import pytest
from flax import nnx

from core.byte_tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from core.model import Transformer, TransformerConfig
from experiments.server import cli
from experiments.server.app import create_app
from experiments.server.chat import ChatTemplate
from experiments.server.protocol import CompletionRequest
from experiments.server.render import CompletionRender
from experiments.server.runner import Event
from kvcache import formats
from kvcache.serving import Engine, EngineConfig, SamplingParams

CFG = TransformerConfig(
    vocab_size=264, d_model=128, num_layers=2, num_heads=2, num_kv_heads=1, d_ff=96, init_std=0.3
)  # large weights: varied greedy continuations
TOK = ByteTokenizer()
BS, BLOCKS = 16, 48
TEMPLATE = (  # ChatML-like, over the byte tokenizer's specials
    "{% for m in messages %}<|bos|>{{ m.role }}\n{{ m.content }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


SERVED = ("bf16", "fp8", "fp4")  # the formats the servers run (every one compiles the engine's programs)


def engine_config(fmt):
    per_block = CFG.num_layers * BS * fmt.bytes_per_token(CFG.num_kv_heads, CFG.head_dim)
    return EngineConfig(
        memory_bytes=BLOCKS * per_block,
        block_size=BS,
        max_num_seqs=8,
        max_num_batched_tokens=16,  # one compiled batch shape: the tests' prefills take several chunks
        max_model_len=256,
        eos_id=TOK.eos_id,
        never=TOK.never_sampled,
        num_ids=TOK.vocab_size,
    )


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def servers(model):
    """format name -> (base URL, runner), one server per KV format of SERVED, with the chat template."""
    out, contexts = {}, []
    try:
        for name in SERVED:
            fmt = formats.get(name)
            chat = ChatTemplate(TEMPLATE, TOK, source="test")
            app, runner = cli.build_server(model, fmt, engine_config(fmt), TOK, model_name="tiny", chat=chat)
            context = cli.serve_in_thread(app)
            contexts.append((context, runner))
            out[name] = (context.__enter__(), runner)
        yield out
    finally:
        for context, runner in contexts:
            context.__exit__(None, None, None)
            runner.stop()


def address(url: str) -> tuple[str, int]:
    """(host, port) of a base URL "http://host:port"."""
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def client(url, **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, **kw)


def in_process(model, name, prompt, n, **sampling):
    """The engine's own output for `prompt` (ids) alone, without HTTP."""
    fmt = formats.get(name)
    engine = Engine(model, fmt, engine_config(fmt))
    request = engine.submit(prompt, n, sampling=SamplingParams(**{"temperature": 0.0, **sampling}))
    engine.run()
    return request.output


def metrics(url) -> dict[str, float]:
    """/metrics' samples: name -> value, the name followed by {labels} where it has labels besides model_name."""
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    out = {}
    for name, labels, value in re.findall(r"^(lowbit_\w+)\{([^}]*)\} (\S+)$", text, re.M):
        extra = ",".join(x for x in labels.split(",") if not x.startswith("model_name="))
        out[f"{name}{{{extra}}}" if extra else name] = float(value)
    return out


def wait_idle(url, timeout=30.0) -> dict[str, float]:
    """/metrics once nothing runs or waits and no block is held (fails after `timeout` s)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["lowbit_num_requests_running"] == m["lowbit_num_requests_waiting"] == m["lowbit_kv_blocks_used"] == 0:
            return m
        assert time.monotonic() < deadline, f"the server did not become idle: {m}"
        time.sleep(0.05)


def post(url, path, body: bytes | dict):
    """(status, headers, JSON) of a POST with `body` (bytes are sent as they are)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def _post_typed(url, path, body: bytes, content_type: str | None) -> tuple[int, dict]:
    """(status, JSON) of a POST of `body` with that Content-Type header (None: none)."""
    headers = {} if content_type is None else {"content-type": content_type}
    request = urllib.request.Request(url + path, data=body, headers=headers)
    if content_type is None:
        request.remove_header("Content-type")  # urllib adds the form type to a body otherwise
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


PROMPTS = ["The quick brown fox", list(np.random.default_rng(0).integers(0, 256, 41))]  # text; ids over 2 blocks


@pytest.mark.parametrize("name", SERVED)
def test_greedy_completions_equal_in_process_generation(model, servers, name):
    url, _ = servers[name]
    c = client(url)
    for prompt in PROMPTS:
        ids = TOK.encode(prompt).tolist() if isinstance(prompt, str) else [int(t) for t in prompt]
        got = c.completions.create(
            model="tiny",
            prompt=prompt if isinstance(prompt, str) else ids,
            max_tokens=12,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        want = in_process(model, name, ids, 12)
        choice = choice_dict(got.choices[0])
        assert choice["prompt_token_ids"] == ids
        assert choice["token_ids"] == want, name
        assert got.choices[0].text == TOK.decode([t for t in want if t != EOS_ID])
        assert got.choices[0].finish_reason == ("stop" if want[-1] == EOS_ID else "length")
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(want))


def flat(lists) -> list:
    return [x for part in lists for x in part]


def choice_dict(choice) -> dict:
    return choice.model_dump() | (choice.model_extra or {})


def test_streamed_deltas_concatenate_to_the_response(servers):
    """Completions and chat, sampled with a seed and with logprobs: the streamed text, token ids and logprobs
    concatenate to the non-streamed response's; the usage chunk equals its usage, the chunks before it carry
    `"usage": null`."""
    url, _ = servers["fp4"]

    async def main():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        common: dict[str, Any] = dict(
            model="tiny", max_tokens=20, temperature=0.9, seed=7, extra_body={"return_token_ids": True}
        )
        whole = await c.completions.create(prompt="Once upon a time", logprobs=2, **common)
        parts = await c.completions.create(
            prompt="Once upon a time", logprobs=2, stream=True, stream_options={"include_usage": True}, **common
        )
        chunks = [chunk async for chunk in parts]
        msgs: list[Any] = [{"role": "user", "content": "hi there"}]
        chat_whole = await c.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=3, **common)
        chat_stream = await c.chat.completions.create(
            messages=msgs, logprobs=True, top_logprobs=3, stream=True, **common
        )
        chat_parts = [chunk async for chunk in chat_stream]
        await c.close()
        return whole, chunks, chat_whole, chat_parts

    whole, chunks, chat_whole, chat_parts = asyncio.run(main())
    w = whole.choices[0]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == w.text
    assert flat(choice_dict(ch.choices[0])["token_ids"] for ch in chunks if ch.choices) == choice_dict(w)["token_ids"]
    assert flat(ch.choices[0].logprobs.token_logprobs for ch in chunks if ch.choices) == w.logprobs.token_logprobs
    assert len(w.logprobs.token_logprobs) == whole.usage.completion_tokens and all(
        len(top) <= 2 for top in w.logprobs.top_logprobs
    )
    usage, again = whole.usage, chunks[-1].usage  # the second request finds the first's full block cached
    assert chunks[-1].choices == [] and again.prompt_tokens == usage.prompt_tokens == 17  # BOS + 16 bytes
    assert (again.completion_tokens, again.total_tokens) == (usage.completion_tokens, usage.total_tokens)
    assert (usage.prompt_tokens_details.cached_tokens, again.prompt_tokens_details.cached_tokens) == (0, BS)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == w.finish_reason
    assert all(ch.to_dict()["usage"] is None for ch in chunks[:-1])  # OpenAI's: "usage": null until the last
    assert not any("usage" in ch.to_dict() for ch in chat_parts)  # (not asked for: no such field)
    cw = chat_whole.choices[0]
    assert chat_parts[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chat_parts) == cw.message.content
    streamed = flat(ch.choices[0].logprobs.content for ch in chat_parts if ch.choices[0].logprobs)
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in cw.logprobs.content]
    # each token's bytes are its id's (the byte tokenizer) and its logprob is the best of its alternatives or below
    ids = choice_dict(cw)["token_ids"]
    assert [bytes(e.bytes) for e in cw.logprobs.content] == [TOK.decode_bytes([t]) for t in ids]
    assert all(e.logprob <= e.top_logprobs[0].logprob + 1e-6 and len(e.top_logprobs) == 3 for e in cw.logprobs.content)


def test_seed_top_k_and_stop_strings(servers):
    url, _ = servers["bf16"]
    c = client(url)

    def text(**kw):
        return c.completions.create(model="tiny", prompt="abc", **{"max_tokens": 24, **kw}).choices[0]

    a, b, other = text(seed=3), text(seed=3), text(seed=4)
    assert a.text == b.text and a.text != other.text
    greedy = text(temperature=0)
    assert text(temperature=1.5, seed=5, extra_body={"top_k": 1}).text == greedy.text  # top_k 1 = argmax
    assert text(temperature=1.5, seed=5, top_p=1e-6).text == greedy.text  # the nucleus of one id
    # a stop string from the middle of the greedy text: the text ends before its first occurrence
    stop = greedy.text[5:8]
    assert len(greedy.text) > 8 and stop
    cut = text(temperature=0, stop=[stop, "\x00never"])
    assert cut.text == greedy.text[: greedy.text.index(stop)] and cut.finish_reason == "stop"
    streamed = c.completions.create(model="tiny", prompt="abc", max_tokens=24, temperature=0, stop=stop, stream=True)
    parts = [ch.choices[0] for ch in streamed]
    assert "".join(p.text for p in parts) == cut.text and parts[-1].finish_reason == "stop"
    wait_idle(url)  # the stopped request's blocks are free


def test_64_concurrent_clients_complete(servers):
    """64 async clients at once against 8 sequences per step and a queue of 256: every request completes with its
    max_tokens tokens; a prompt sent twice gets the same greedy text; the server ends idle."""
    url, _ = servers["fp8"]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(3, 40, 32)] * 2

    async def main():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        calls = [
            c.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
            for p in prompts
        ]
        out = await asyncio.gather(*calls)
        await c.close()
        return out

    results = asyncio.run(main())
    assert all(r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length" for r in results)
    assert [r.choices[0].text for r in results[:32]] == [r.choices[0].text for r in results[32:]]
    m = wait_idle(url)
    assert sum(v for k, v in m.items() if k.startswith("lowbit_request_success_total")) >= 64


def test_disconnects_abort_and_free_blocks(servers):
    """A streaming client that closes after two chunks, and a non-streaming one that closes before its answer:
    both requests are aborted (finished_reason abort) and their blocks freed at once, long before their 200
    tokens would have been generated."""
    url, _ = servers["bf16"]
    host, port = url.removeprefix("http://").split(":")
    aborted = metrics(url).get('lowbit_request_success_total{finished_reason="abort"}', 0)
    body = {"model": "tiny", "prompt": "x" * 40, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    conn = http.client.HTTPConnection(host, int(port))
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(2):
        assert response.readline().startswith(b"data: ")
        response.readline()
    assert metrics(url)["lowbit_kv_blocks_used"] > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_idle(url, timeout=10)
    raw = socket.create_connection((host, int(port)))
    payload = json.dumps(body).encode()
    raw.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    deadline = time.monotonic() + 10
    while metrics(url)["lowbit_kv_blocks_used"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    raw.close()
    m = wait_idle(url, timeout=10)
    assert m['lowbit_request_success_total{finished_reason="abort"}'] == aborted + 2


def test_full_queue_answers_429(servers, monkeypatch):
    """10 long requests against 8 sequences per step: 2 wait. With the queue bounded at 2, the next request gets a
    429 with Retry-After, in OpenAI's error format, and the others go on; a request of more sequences than the
    queue ever holds (n x prompts > 2) gets 400 naming `n` or `prompt`, not a 429 a client would retry forever,
    and queues nothing."""
    url, runner = servers["fp8"]
    body = {"model": "tiny", "prompt": "y" * 20, "max_tokens": 200, "ignore_eos": True, "stream": True}
    conns = []
    for _ in range(10):
        conn = http.client.HTTPConnection(*url.removeprefix("http://").split(":"))
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        conns.append(conn)
    deadline = time.monotonic() + 10
    while runner.queued < 2 or metrics(url)["lowbit_num_requests_running"] < 8:
        assert time.monotonic() < deadline, (runner.queued, metrics(url))
        time.sleep(0.01)
    monkeypatch.setattr(runner, "max_waiting", 2)
    status, headers, error = post(url, "/v1/completions", {"prompt": "z", "max_tokens": 2})
    assert status == 429 and headers["Retry-After"] == "1"
    assert error["error"]["code"] == "rate_limit_exceeded" and "queue is full" in error["error"]["message"]
    assert metrics(url)["lowbit_num_requests_running"] == 8
    for conn in conns:
        conn.close()
    wait_idle(url)
    aborted = metrics(url)['lowbit_request_success_total{finished_reason="abort"}']
    too_many: list[tuple[dict[str, Any], str]] = [
        ({"prompt": "z", "n": 3}, "n"),
        ({"prompt": ["a", "b", "c"]}, "prompt"),
    ]
    for body, param in too_many:
        status, headers, error = post(url, "/v1/completions", {**body, "max_tokens": 2})
        assert status == 400 and "Retry-After" not in headers and error["error"]["param"] == param, error
        assert "--max-waiting = 2" in error["error"]["message"]
    assert metrics(url)['lowbit_request_success_total{finished_reason="abort"}'] == aborted  # nothing was queued


BAD: list[tuple[bytes | dict, int, str | None, str]] = [  # (body, status, param, words in the message)
    (b"{not json", 400, None, "malformed JSON"),
    (b"[1, 2]", 400, None, "body"),
    ({"prompt": "a", "temperature": "hot"}, 400, "temperature", "number"),
    ({"prompt": "a", "temperature": 3}, 400, "temperature", "less than or equal to 2"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p", "greater than 0"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ({"prompt": "a", "n": 0}, 400, "n", "greater than or equal to 1"),
    ({"prompt": "a", "logprobs": 6}, 400, "logprobs", "less than or equal to 5"),
    ({"prompt": "a", "stop": ["1", "2", "3", "4", "5"]}, 400, "stop", "at most 4"),
    ({"prompt": "a", "frequency_penalty": 0.5}, 400, "frequency_penalty", "not implemented"),
    ({"prompt": "a", "echo": True}, 400, "echo", "not implemented"),
    ({"prompt": "a", "functions": [{"name": "f"}]}, 400, "functions", "would change the answer"),
    ({"prompt": "a", "response_format": {"type": "json_object"}}, 400, "response_format", 'allowed: null or {"type"'),
    ({"prompt": "a", "bad_words": ["x"]}, 400, "bad_words", 'bad_words = ["x"] would change the answer'),
    ({"prompt": "a", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens", "min_tokens = 5 exceeds max_new_tokens = 2"),
    ({"prompt": "a", "stop_token_ids": [7, 300]}, 400, "stop_token_ids", "position 1 is 300, outside [0, 264)"),
    ({"prompt": "a", "stop_token_ids": [-1]}, 400, "stop_token_ids.0", "greater than or equal to 0"),
    ({"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty", "greater than 0"),
    ({"prompt": "a", "min_p": 1.5}, 400, "min_p", "less than or equal to 1"),
    ({"prompt": []}, 400, "prompt", "must not be empty"),
    ({"prompt": [5, 300]}, 400, "prompt", "position 1 is 300, outside [0, 264)"),
    ({"prompt": "a" * 300}, 400, "prompt", "limit is 256 tokens"),
    ({"prompt": "a", "max_tokens": 255}, 400, "max_tokens", "exceeds max_model_len = 256"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "model", "`gpt-4` does not exist"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed with stream"),
    # strict types, as OpenAI's: nothing is coerced
    ({"prompt": "a", "max_tokens": "10"}, 400, "max_tokens", "valid integer"),
    ({"prompt": "a", "max_tokens": 2.0}, 400, "max_tokens", "valid integer"),
    ({"prompt": "a", "max_tokens": True}, 400, "max_tokens", "valid integer"),
    ({"prompt": "a", "n": "2"}, 400, "n", "valid integer"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream", "valid boolean"),
    ({"prompt": "a", "stream": 1}, 400, "stream", "valid boolean"),
    ({"prompt": "a", "logprobs": True}, 400, "logprobs", "valid integer"),
    ({"prompt": [1, True]}, 400, "prompt", "token 1 = true is not a token id"),
    ({"prompt": [1, 2.0]}, 400, "prompt", "token 1 = 2.0 is not a token id"),
    # text that is no Unicode (valid JSON)
    (b'{"prompt": "a\\ud800b"}', 400, "prompt", "lone surrogate (U+D800)"),
    (b'{"prompt": "a", "stop": ["\\udfff"]}', 400, "stop.0", "lone surrogate"),
]


def test_bad_requests_get_openai_errors_and_disturb_nobody(model, servers):
    """Each bad request gets OpenAI's error object naming the field, while a streaming request runs beside them and
    still returns exactly its in-process greedy output; the server stays healthy."""
    url, _ = servers["fp4"]
    c = client(url)
    ids = TOK.encode("steady").tolist()
    stream = c.completions.create(
        model="tiny", prompt=ids, max_tokens=40, temperature=0, stream=True, extra_body={"return_token_ids": True}
    )
    got = choice_dict(next(iter(stream)).choices[0])["token_ids"]
    for body, status, param, words in BAD:
        code, _, error = post(url, "/v1/completions", body)
        assert (code, error["error"]["param"]) == (status, param), (body, error)
        assert words in error["error"]["message"], (body, error)
    code, _, error = post(url, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]})
    assert (code, error["error"]["param"]) == (400, "messages.0.role")
    for content in (None, "x\ud800"):
        code, _, error = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}]})
        assert code == 400 and error["error"]["param"].startswith("messages.0.content"), error
    for content_type in ("application/x-www-form-urlencoded", "text/plain", None):  # curl's default, others
        code, error = _post_typed(url, "/v1/completions", b"prompt=a", content_type)
        assert code in (400, 415) and error["error"]["type"] == "invalid_request_error", (content_type, error)
    got += flat(choice_dict(ch.choices[0])["token_ids"] for ch in stream)
    assert got == in_process(model, "fp4", ids, 40)
    assert json.loads(urllib.request.urlopen(url + "/health").read()) == {"status": "ok"}
    _, runner = servers["fp4"]
    no_chat = create_app(runner, TOK, model_name="tiny", max_body_bytes=4096)  # without a template, small bodies
    with cli.serve_in_thread(no_chat) as bare:
        big = json.dumps({"prompt": list(range(200)) * 5}).encode()  # 4,898 bytes
        code, _, error = post(bare, "/v1/completions", big)
        assert code == 413 and "limit of 4,096 bytes" in error["error"]["message"], error
        conn = http.client.HTTPConnection(*address(bare))
        conn.request("POST", "/v1/completions", iter([big[:3000], big[3000:]]), {"content-type": "application/json"})
        chunked = conn.getresponse()  # no Content-Length: counted as it arrives
        assert chunked.status == 413 and "4,096 bytes" in json.loads(chunked.read())["error"]["message"]
        conn.close()
        code, _, error = post(bare, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert code == 400 and "has no chat template" in error["error"]["message"]
        models = json.loads(urllib.request.urlopen(bare + "/v1/models").read())
        assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 256
        assert json.loads(urllib.request.urlopen(bare + "/v1/models/tiny").read()) == models["data"][0]
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(bare + "/v1/models/gpt-4")
        assert missing.value.code == 404 and json.loads(missing.value.read())["error"]["code"] == "model_not_found"
        head = urllib.request.urlopen(urllib.request.Request(bare + "/health", method="HEAD"))
        assert head.status == 200 and head.read() == b""


def test_chat_template_tokens_match_a_hand_built_prompt():
    """The template's specials become their ids and the rest is the text's bytes, no BOS added; as transformers'
    apply_chat_template does, a special's name inside a message is that special too (templates do not escape)."""
    chat = ChatTemplate(TEMPLATE, TOK, source="test")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ok <|eos|> then"}]
    want = [BOS_ID, *b"system\nbe brief", EOS_ID, *b"\n", BOS_ID, *b"user\nok ", EOS_ID, *b" then", EOS_ID, *b"\n"]
    assert chat.encode(msgs) == [*want, BOS_ID, *b"assistant\n"]


def test_multi_round_agent_hits_the_prefix_cache(servers):
    """Three rounds of one conversation: each round's prompt is the last one's plus its answer and a new message;
    the cached tokens reported equal the full blocks shared with an earlier request's computed tokens (from
    the token ids), more than a block from round 2 on, and /metrics counts the same hits."""
    url, _ = servers["fp4"]
    c = client(url)
    before = metrics(url)["lowbit_prefix_cache_hits_total"]
    messages = [{"role": "system", "content": "You are a terse agent. " * 3}]
    seen: list[list[int]] = []
    cached: list[int] = []
    for round_ in range(3):
        messages.append({"role": "user", "content": f"step {round_}: run the tool"})
        r = c.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
        )
        choice = choice_dict(r.choices[0])
        prompt, output = choice["prompt_token_ids"], choice["token_ids"]
        shared = max((_common(prompt, s) for s in seen), default=0)
        expect = min(shared, len(prompt) - 1) // BS * BS
        assert r.usage.prompt_tokens_details.cached_tokens == expect, round_
        cached.append(expect)
        seen.append(prompt + output[:-1])  # the last token's K/V is never computed
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert cached[0] == 0 and min(cached[1:]) > BS
    assert metrics(url)["lowbit_prefix_cache_hits_total"] - before == sum(cached)


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_serving_docs_client_example_streams_what_a_plain_request_returns(servers, capsys):
    """docs/serving.md's openai-client snippet, pointed at this server, prints the text a non-streamed request with
    the same seed returns."""
    page = (pathlib.Path(__file__).parent.parent / "docs" / "serving.md").read_text()
    section = page[page.index("## Serving over HTTP") :]
    end = section.find("\n## ", 3)  # the section ends at the next one, or with the page
    snippet = re.search(r"```python\n(.*?)```", section if end < 0 else section[:end], re.S)
    assert snippet is not None
    url, _ = servers["fp8"]
    code = snippet.group(1).replace("http://127.0.0.1:8000", url).replace('"quickstart"', '"tiny"')
    exec(compile(code, "docs/serving.md", "exec"), {"__name__": "docs_snippet"})
    whole = client(url).completions.create(model="tiny", prompt="def ", max_tokens=40, seed=0)
    assert capsys.readouterr().out == whole.choices[0].text and len(whole.choices[0].text) > 10


def test_an_engine_failure_answers_500_then_503_and_health_says_so(model, monkeypatch):
    """A step that raises (a bug, not a client's input) ends every open request with a server error in OpenAI's
    format; the runner stops accepting requests (503) and /health answers 503 with the error."""
    from experiments.server.metrics import ServerMetrics
    from experiments.server.runner import EngineRunner

    fmt = formats.get("bf16")
    engine = Engine(model, fmt, engine_config(fmt))

    def broken(batch):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine, "_execute", broken)
    runner = EngineRunner(engine, TOK, metrics=ServerMetrics("tiny"))
    runner.start()
    try:
        with cli.serve_in_thread(create_app(runner, TOK, model_name="tiny")) as url:
            code, _, error = post(url, "/v1/completions", {"prompt": "a", "max_tokens": 3})
            assert code == 500 and "injected failure" in error["error"]["message"]
            assert error["error"]["type"] == "server_error"
            code, _, error = post(url, "/v1/completions", {"prompt": "a", "max_tokens": 3})
            assert code == 503 and "the engine has stopped" in error["error"]["message"]
            with pytest.raises(urllib.error.HTTPError) as health:
                urllib.request.urlopen(url + "/health")
            assert health.value.code == 503 and "injected failure" in json.loads(health.value.read())["error"]
    finally:
        runner.stop()


@pytest.mark.parametrize(
    "prompt, words",
    [
        ([7] * 100_000 + ["x"] * 1000, 'token 100000 = "x" is not a token id'),
        ([[1, 2], [3, True], [4, 5.0]], "element 1, token 1 = true is not a token id"),
        (["a", "b", 3, 4], "element 2 = 3 is not a string"),
        ([[1], []], "element 1 = [] is not a non-empty list"),
        ({"a": 1}, "expected a string, a list of strings"),
    ],
)
def test_a_bad_prompt_is_one_error_naming_its_first_bad_element(prompt, words):
    """A prompt list with bad elements gets one validation error, naming the first of them (not one error per
    element and per union branch, which for a list of millions of ids cost minutes and gigabytes)."""
    with pytest.raises(pydantic.ValidationError) as e:
        CompletionRequest.model_validate({"prompt": prompt})
    assert e.value.error_count() == 1 and words in str(e.value), str(e.value)[:500]
    ok = [int(t) for t in np.random.default_rng(1).integers(0, 264, 50_001)]
    for good in (ok, [ok[:3], ok[3:9]], ["a", "b"], "text"):
        assert CompletionRequest.model_validate({"prompt": good}).prompt == good


def test_unknown_fields_are_ignored_with_a_warning_unless_they_change_the_answer(caplog):
    """vLLM's convention: `metadata`, `store`, ... are ignored with a logged warning naming them; a field of
    ANSWER_CHANGING is ignored only when null or neutral (its refusals are in BAD)."""
    body = {"prompt": "a", "metadata": {"k": "v"}, "store": False, "tools": [], "response_format": None}
    with caplog.at_level("WARNING", logger="experiments.server.protocol"):
        request = CompletionRequest.model_validate(body)
    assert request.prompts() == ["a"] and request.max_tokens == 16
    assert "unknown field(s) of the request: metadata, response_format, store, tools" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="experiments.server.protocol"):
        CompletionRequest.model_validate({"prompt": "a", "max_tokens": 3})
    assert caplog.text == ""


def test_text_offsets_count_characters_when_a_character_spans_several_tokens():
    """Byte tokens of 'aé€b😀c' (1, 2, 3, 1, 4, 1 bytes), streamed in two uneven chunks: each token's text_offset is
    the number of characters complete before it (a float-free reference: the prefix's bytes decoded, an incomplete
    tail dropped), running on across the chunks."""
    ids = TOK.encode("aé€b😀c", bos=False).tolist()
    body = CompletionRequest.model_validate({"prompt": "x", "logprobs": 0})
    render = CompletionRender(TOK, "tiny", body)
    got = []
    for part in (ids[:4], ids[4:]):
        event = Event(token_ids=part, logprobs=[-1.0] * len(part), top_logprobs=[[] for _ in part])
        got += render.chunk(0, event)["choices"][0]["logprobs"]["text_offset"]
    want = [len(TOK.decode_bytes(ids[:i]).decode("utf-8", errors="ignore")) for i in range(len(ids))]
    assert got == want == [0, 1, 1, 2, 2, 2, 3, 4, 4, 4, 4, 5]


def test_shutting_down_ends_every_open_request_in_openais_format(model):
    """The server told to stop (what SIGINT / SIGTERM do) with one stream running and two non-streamed requests
    waiting behind it (one sequence per step): the stream ends with an error event and `data: [DONE]`, the waiting
    requests get 503 in OpenAI's format, /health never answers 200 again, and nothing was left for uvicorn's
    graceful timeout to cut (the stream read to [DONE])."""
    fmt = formats.get("bf16")
    config = dataclasses.replace(engine_config(fmt), max_num_seqs=1)
    app, runner = cli.build_server(model, fmt, config, TOK, model_name="tiny")
    body = {"prompt": "x", "max_tokens": 250, "ignore_eos": True}
    try:
        with cli.serve_in_thread(app, runner=runner) as url:
            host, port = address(url)
            streaming = http.client.HTTPConnection(host, port, timeout=60)
            headers = {"content-type": "application/json"}
            streaming.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), headers)
            reply = streaming.getresponse()
            assert reply.readline().startswith(b"data: {")  # it runs
            waiting = []
            for _ in range(2):
                conn = http.client.HTTPConnection(host, port, timeout=60)
                conn.request("POST", "/v1/completions", json.dumps(body), headers)
                waiting.append(conn)
            deadline = time.monotonic() + 10
            while runner.queued < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        rest = reply.read().decode()
        answers = [conn.getresponse() for conn in waiting]
    finally:
        runner.stop()
    events = [line.removeprefix("data: ") for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", rest[-500:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "service_unavailable" and "shutting down" in error["message"], error
    for answer in answers:
        assert answer.status == 503 and json.loads(answer.read())["error"]["code"] == "service_unavailable"
    assert not runner.healthy and runner.closing == "the server is shutting down"


def test_idle_and_slow_clients_are_disconnected(servers):
    """With a 0.5 s head deadline: a connection that sends nothing, and one that trickles its request line and
    headers a byte every 0.1 s, are both closed by the server (recv returns b"" long before the 30 s socket
    timeout would fire); a client that sends its request at once is answered, twice on one kept-alive
    connection."""
    _, runner = servers["bf16"]
    app = create_app(runner, TOK, model_name="tiny")
    with cli.serve_in_thread(app, head_timeout=0.5) as url:
        where = address(url)
        idle = socket.create_connection(where, timeout=30)
        assert idle.recv(1) == b""  # closed by the server, not by our timeout (which would raise)
        slow = socket.create_connection(where, timeout=30)
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 100 + b"\r\n\r\n"
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            for byte in head:
                slow.sendall(bytes([byte]))
                time.sleep(0.1)
        assert slow.recv(1) == b""
        conn = http.client.HTTPConnection(*where, timeout=30)
        for _ in range(2):
            conn.request("GET", "/health")
            assert json.loads(conn.getresponse().read()) == {"status": "ok"}
        conn.close()
        idle.close()
        slow.close()
