"""Serving Hugging Face checkpoints exactly as transformers and vLLM serve them, against the fixtures of
tests/fixtures/hf/make_serving_fixtures.py (never importing torch): for each of the eight architectures, with a real
byte-level BPE tokenizer, its chat template and a generation_config.json with several end ids (one of which
transformers' greedy chat answer stops at) and, for some, sampling defaults with a repetition penalty, the HTTP
server's greedy completion and chat answers equal transformers' `generate` to the last token, text and stop; and
what the answer is made of: prompt framing (Llama 3's post-processor BOS, none for a ChatML tokenizer that names a
BOS no post-processor adds; tokenizer_config's add_bos_token ignored, as transformers 5 does; a template writing
its BOS gets one), the generation config (`--generation-config auto|vllm|FOLDER`) and the request fields that
change it."""

import asyncio
import json
import os
import pathlib
import shutil
import urllib.request
from typing import Any

import ml_collections
import pytest

from core.byte_tokenizer import ByteTokenizer
from core.hf_tokenizer import HFTokenizer
from experiments import pretrained
from experiments.hf import generation
from experiments.server import chat as chat_lib
from experiments.server import cli
from experiments.server.protocol import ChatCompletionRequest, CompletionRequest
from experiments.server.render import ChatRender, CompletionRender
from experiments.server.runner import EngineRunner, Event
from kvcache import formats
from kvcache.serving import EngineConfig, EngineCore, SamplingParams, Scheduler

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
SERVING = FIXTURES / "serving"
REFERENCE = json.loads((SERVING / "reference.json").read_text(encoding="utf-8"))
ARCHS = list(REFERENCE["models"])


def checkpoint(root: pathlib.Path, arch: str, generation_config: dict[str, Any] | None = None) -> str:
    """A checkpoint directory under `root`: the fixture model's config.json and safetensors (linked), its style's
    tokenizer files and `generation_config` (default the reference's) as generation_config.json (written, never
    through a link: the fixture's own file stays as it is)."""
    directory = root / arch
    directory.mkdir(parents=True)
    for f in (FIXTURES / arch).iterdir():
        if f.name == "config.json" or f.name.startswith("model"):
            os.symlink(f, directory / f.name)
    ref = REFERENCE["models"][arch]
    for f in (SERVING / ref["style"]).iterdir():
        shutil.copy(f, directory / f.name)
    config = ref["generation_config"] if generation_config is None else generation_config
    (directory / generation.GENERATION_FILE).write_text(json.dumps(config))
    return str(directory)


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_answers_equal_transformers_to_the_last_token(tmp_path, arch):
    """The run as `serve --http` builds it (its tokenizer's framing, `--generation-config auto`: the end ids and the
    sampling defaults, a bf16 KV cache): a greedy completion (the prompt's text) and a chat answer (the messages)
    have transformers' prompt ids, answer ids, text (the end id's text left out, as vLLM leaves it) and finish
    reason; the chat answer stops at the generation config's extra end id, its `stop_reason`. The architectures
    whose generation config has a repetition penalty (qwen3 1.1, qwen3_moe 1.3, olmoe 0.8) apply it to greedy
    requests too, as transformers' generate does."""
    ref = REFERENCE["models"][arch]
    directory = checkpoint(tmp_path, arch)
    config = pretrained.config_from_hf(directory)
    config.moe.grouped_matmul = "ragged_dot"  # the CPU's default windowed loop computes the same, compiles slower
    config, model = pretrained.model_from_hf(directory, config=config)
    tok, gen = generation.run_tokenizer(config), generation.for_run(config, "auto")
    assert gen.eos_ids == tuple(ref["generation_config"]["eos_token_id"])
    chat = chat_lib.load_template(None, config.data.tokenizer, tok)
    engine_config = EngineConfig.for_tokenizer(
        tok, eos_ids=gen.eos_ids, memory_bytes=2**20, max_num_batched_tokens=16, max_model_len=128
    )
    fmt = formats.get("bf16")
    app, runner = cli.build_server(
        model, fmt, engine_config, tok, model_name=arch, chat=chat, defaults=gen.defaults, warmup=False
    )  # (the two requests compile what they run)
    try:
        with cli.serve_in_thread(app) as url:
            c = ref["completion"]
            body = {"prompt": c["prompt"], "max_tokens": c["max_tokens"], "temperature": 0, "return_token_ids": True}
            completion = post(url, "/v1/completions", body)["choices"][0]
            c = ref["chat"]
            body = {
                "messages": c["messages"],
                "max_tokens": c["max_tokens"],
                "temperature": 0,
                "return_token_ids": True,
            }
            answer = post(url, "/v1/chat/completions", body)["choices"][0]
            if arch == "llama":  # vLLM's switches, on one architecture
                framed = post(url, "/v1/chat/completions", {**body, "add_special_tokens": True})["choices"][0]
                kept = post(url, "/v1/chat/completions", {**body, "include_stop_str_in_output": True})["choices"][0]
                c = ref["completion"]
                bare = {"prompt": c["prompt"], "max_tokens": 1, "add_special_tokens": False, "return_token_ids": True}
                unframed = post(url, "/v1/completions", bare)["choices"][0]
    finally:
        runner.stop()
    if arch == "llama":  # BOS twice (the template's and the framing's), as vLLM; the end id's text; no BOS
        assert framed["prompt_token_ids"] == [tok.bos_id, *ref["chat"]["prompt_ids"]]
        assert kept["message"]["content"] == ref["chat"]["text"] + tok.decode(ref["chat"]["ids"][-1:])
        assert unframed["prompt_token_ids"] == ref["completion"]["prompt_ids"][1:]
    for got, want, text in ((completion, ref["completion"], "text"), (answer, ref["chat"], "message")):
        assert got["prompt_token_ids"] == want["prompt_ids"], (arch, got["prompt_token_ids"])
        assert got["token_ids"] == want["ids"], (arch, got["token_ids"], want["ids"])
        assert (got["finish_reason"], got[text] if text == "text" else got[text]["content"]) == (
            want["finish_reason"],
            want["text"],
        )
    assert answer["finish_reason"] == "stop" and answer["stop_reason"] == ref["chat"]["ids"][-1]
    assert answer["stop_reason"] == ref["generation_config"]["eos_token_id"][-1]  # not the tokenizer's EOS


@pytest.mark.parametrize("style", ["llama_style", "chatml_style"])
def test_prompts_are_framed_as_transformers_frames_them(tmp_path, style):
    """transformers' `tokenizer(text).input_ids` and `apply_chat_template(tokenize=True)` (the fixture), for the
    files as they are and with tokenizer_config.json's add_bos_token / add_eos_token set (transformers 5 reads only
    the post-processor beside a tokenizer.json): ours are the same. Llama's template writes its BOS, which the
    post-processor would add too: the chat prompt has one; a BOS name in a text prompt is a second BOS, as there."""
    config = json.loads((SERVING / style / "tokenizer_config.json").read_text())
    for variant, change in {
        "as_is": {},
        "add_bos_token": {"add_bos_token": True},
        "no_add_bos_token": {"add_bos_token": False},
        "add_eos_token": {"add_eos_token": True},
    }.items():
        directory = tmp_path / variant
        directory.mkdir()
        shutil.copy(SERVING / style / "tokenizer.json", directory)
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        tok = HFTokenizer.from_file(directory)
        ref = REFERENCE["tokenization"][style][variant]
        for case in ref["texts"]:
            assert tok.encode_prompt(case["text"]).tolist() == case["ids"], (variant, case)
        template = chat_lib.load_template(None, str(directory), tok)
        assert template is not None
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello <|eot_id|> there"}]
        assert template.encode(messages) == ref["chat"], variant
    bos = tok.bos_id
    assert (tok.framing[0] == (bos,)) == (style == "llama_style") and bos is not None  # named either way
    assert ref["chat"].count(bos) == (1 if style == "llama_style" else 0)


def test_the_generation_config_modes_and_their_refusals(tmp_path):
    """`--generation-config`: auto reads the imported checkpoint's generation_config.json (end ids and vLLM's
    sampling keys; do_sample and other keys are not read), or its config.json's fields without one; vllm keeps the
    end ids and drops the defaults; FOLDER reads FOLDER's; a run trained here has none. Bad values are refused
    naming the file, the field, the value and what is allowed."""
    directory = checkpoint(tmp_path, "qwen3")
    run = ml_collections.ConfigDict({"checkpoint": {"init_from": "hf:" + directory}})
    auto = generation.for_run(run, "auto")
    assert auto.eos_ids == (299, 297, 257) and auto.source == os.path.join(directory, generation.GENERATION_FILE)
    assert auto.defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}
    assert generation.for_run(run, "vllm").defaults == {} and generation.for_run(run, "vllm").eos_ids == auto.eos_ids
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / generation.GENERATION_FILE).write_text(json.dumps({"eos_token_id": 5, "max_new_tokens": 7}))
    assert generation.for_run(run, str(folder)) == generation.GenerationConfig(
        (5,), {"max_tokens": 7}, str(folder / generation.GENERATION_FILE)
    )
    os.remove(os.path.join(directory, generation.GENERATION_FILE))  # transformers: the config.json's fields then
    assert generation.for_run(run, "auto").source.endswith("config.json")
    ours = ml_collections.ConfigDict({"checkpoint": {"init_from": ""}})
    assert generation.for_run(ours, "auto").eos_ids == () and generation.for_run(ours, "auto").defaults == {}
    with pytest.raises(generation.GenerationConfigError, match="--generation-config='nowhere' does not exist"):
        generation.for_run(ours, "nowhere")
    with pytest.raises(generation.GenerationConfigError, match="holds no generation_config.json"):
        generation.for_run(ours, str(tmp_path))
    for fields, needle in [
        ({"eos_token_id": [1, "x"]}, 'eos_token_id = [1, "x"]; allowed: a token id'),
        ({"temperature": -1}, "temperature = -1; allowed: a number >= 0"),
        ({"repetition_penalty": 0}, "repetition_penalty = 0; allowed: a number > 0"),
        ({"top_k": 1.5}, "top_k = 1.5; allowed: an integer >= -1"),
    ]:
        (folder / generation.GENERATION_FILE).write_text(json.dumps(fields))
        with pytest.raises(generation.GenerationConfigError, match=needle.replace("[", r"\[").replace("+", r"\+")):
            generation.for_run(ours, str(folder))


def test_requests_take_the_generation_configs_defaults_unless_they_set_them():
    """A field the request leaves out is the generation config's (vLLM's --generation-config auto), else vLLM's
    neutral value; one it sets is its own; stop_token_ids and min_tokens reach the engine."""
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 7}
    left = CompletionRequest(prompt="a").sampling(defaults=defaults)
    assert (left.temperature, left.top_p, left.top_k, left.min_p, left.repetition_penalty) == (0.6, 0.95, 20, 0.0, 1.1)
    body = {
        "prompt": "a",
        "temperature": 0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "stop_token_ids": [3],
        "min_tokens": 2,
    }
    given = CompletionRequest.model_validate(body).sampling(defaults=defaults)
    assert (given.temperature, given.top_p, given.top_k, given.repetition_penalty) == (0.0, 0.95, 0, 1.0)
    assert (given.stop_token_ids, given.min_tokens) == ((3,), 2)
    plain = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}).sampling()
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_logprobs_keep_every_alternative_when_two_decode_alike():
    """Five alternatives of which two are the lone bytes 0x80 and 0x81 (each alone decodes to U+FFFD): the
    completions endpoint's {token: logprob} keeps all five, the second as "token_id:129"; with
    return_tokens_as_token_ids every token is "token_id:N" (chat entries too, their bytes those of that name); a
    special token is its name."""
    alternatives = [(0x80, -0.5), (0x81, -1.0), (97, -1.5), (258, -2.0), (98, -3.0)]
    event = Event(token_ids=[0x80], logprobs=[-0.5], top_logprobs=[alternatives])
    render = CompletionRender(ByteTokenizer(), "m", CompletionRequest(prompt="a", logprobs=5))
    top = render.chunk(0, event)["choices"][0]["logprobs"]["top_logprobs"][0]
    assert top == {"\ufffd": -0.5, "token_id:129": -1.0, "a": -1.5, "<|eos|>": -2.0, "b": -3.0}
    as_ids = CompletionRender(ByteTokenizer(), "m", CompletionRequest(prompt="a", logprobs=5), tokens_as_ids=True)
    logprobs = as_ids.chunk(0, event)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:128"] and list(logprobs["top_logprobs"][0]) == [
        f"token_id:{t}" for t, _ in alternatives
    ]
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": True,
            "top_logprobs": 5,
            "return_tokens_as_token_ids": True,
        }
    )
    entry = ChatRender(ByteTokenizer(), "m", body).chunk(0, event)["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "token_id:128" and bytes(entry["bytes"]) == b"token_id:128"
    assert [a["token"] for a in entry["top_logprobs"]] == [f"token_id:{t}" for t, _ in alternatives]


class Scripted(EngineCore):
    """The engine's scheduler with a script for a model: a request's next token is script[len(output)]."""

    def __init__(self, script: list[int], *args):
        super().__init__(Scheduler(*args))
        self.script = script

    def _execute(self, batch):
        return [self.script[len(r.output)] if r.num_computed + n == len(r.tokens) else None for r, n in batch]


def run_scripted(script: list[int], requests: list[dict[str, Any]], eos_ids=()) -> list[Event]:
    """Each of `requests` (EngineRunner.submit's keywords and `sampling`) through an EngineRunner over `Scripted`
    (byte tokenizer, greedy) answering `script`: its events merged (text, ids, finish and stop reasons)."""
    tok = ByteTokenizer()
    config = EngineConfig.for_tokenizer(tok, memory_bytes=1, eos_ids=eos_ids)
    scheduler = Scripted(script, config, formats.get("bf16"), 64)
    runner = EngineRunner(scheduler, tok)  # type: ignore[arg-type]
    runner.start()

    async def collect(kw):
        stream = runner.submit([tok.bos_id], 20, kw.pop("sampling", SamplingParams(temperature=0.0)), **kw)
        out = Event()
        async for event in stream:
            out.text, out.token_ids = out.text + event.text, out.token_ids + event.token_ids
            out.finish_reason, out.stop_reason = event.finish_reason, event.stop_reason
        return out

    async def main():
        return [await collect(dict(kw)) for kw in requests]

    try:
        return asyncio.run(main())
    finally:
        runner.stop()


def test_the_runner_ends_answers_as_vllm():
    """What an answer's text is when it ends, by vLLM's rules, on scripted tokens: the tokenizer's EOS is in the ids
    but not the text (stop_reason null); `skip_special_tokens: false` with `include_stop_str_in_output` writes its
    name; a generation-config end id ('!') stops the answer with stop_reason its id and its text left out unless
    asked for; a stop string counts only if it ends after the first min_tokens tokens' text, is cut off (kept with
    include_stop_str_in_output) and is the stop_reason."""
    eos, text = 258, "ab ab!cd"
    script = [*text.encode(), eos]
    plain, named = run_scripted(
        script, [{"ignore_eos": False}, {"skip_special_tokens": False, "include_stop_str_in_output": True}]
    )
    assert (plain.text, plain.token_ids, plain.finish_reason, plain.stop_reason) == (text, script, "stop", None)
    assert named.text == text + "<|eos|>"
    bang, kept = run_scripted(script, [{}, {"include_stop_str_in_output": True}], eos_ids=(ord("!"),))
    assert (bang.text, bang.token_ids, bang.stop_reason) == ("ab ab", script[:6], ord("!"))
    assert kept.text == "ab ab!"
    early, held, included = run_scripted(
        script,
        [
            {"stop": ["ab"]},
            {"stop": ["ab"], "sampling": SamplingParams(temperature=0.0, min_tokens=3)},
            {
                "stop": ["ab"],
                "sampling": SamplingParams(temperature=0.0, min_tokens=3),
                "include_stop_str_in_output": True,
            },
        ],
    )
    assert (early.text, early.finish_reason, early.stop_reason) == ("", "stop", "ab")
    assert (held.text, held.stop_reason) == ("ab ", "ab") and included.text == "ab ab"
