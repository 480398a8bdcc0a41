"""experiments.serve in-process: bad flags refused before anything is loaded, the loader's failures as `error:` lines
with their exit codes, a character split across engine steps streamed whole, a prompt of raw bytes served as those
bytes, and a KV pool or format that cannot serve the model refused by name.

Nothing here trains or compiles: the loader is replaced by one returning a run's config (its data.tokenizer) and a
model that is only its config, and the engine by the real scheduler (kvcache.engine.Scheduler) whose "model" emits a
scripted token per decode step (a byte; or a BPE id, for a run with a BPE tokenizer)."""

import pathlib
import re
import types
from typing import ClassVar

import pytest

from core.checkpoint import CheckpointError
from core.config import TransformerConfig
from core.tokenizer import HFTokenizer
from experiments import load, serve
from kvcache import engine as engine_lib

# head_dim 64 (fp4 needs a multiple of 64); a block of 16 tokens in bf16: 2 layers x 16 x (K + V: 2 x 64 x 2 bytes)
CFG = TransformerConfig(vocab_size=264, d_model=128, num_layers=2, num_heads=2, num_kv_heads=1, d_ff=64)
BF16_BLOCK_BYTES = 2 * 16 * 2 * 64 * 2
SCRIPT = "naïve € 😀 ok".encode()  # 1-, 2-, 3- and 4-byte characters
BYTES_RUN = types.SimpleNamespace(data=types.SimpleNamespace(tokenizer="bytes"))  # what serve reads of the config
BPE_DIR = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf" / "tokenizer"  # 320 ids: pad 0, bos 1, eos 2


class ScriptedEngine(engine_lib.Scheduler):
    """The engine's scheduler with a script for a model: a request's next token is token `len(output)` of the script
    (SCRIPT's bytes by default), then the EOS the engine was configured with; after the one-step prefill, one token
    per step (a multi-byte character arrives over several steps). The pool holds as many blocks as `memory_bytes`
    does for the model (kvcache.paged's rule)."""

    script: bytes | list[int] = SCRIPT
    prompts: ClassVar[list[list[int]]] = []  # what each instance was submitted, in order
    configs: ClassVar[list[engine_lib.EngineConfig]] = []  # each instance's config

    def __init__(self, model, fmt, config):
        cfg = model.cfg
        per_block = cfg.num_layers * config.block_size * fmt.bytes_per_token(cfg.num_kv_heads, cfg.head_dim)
        super().__init__(config, fmt, config.memory_bytes // per_block)
        ScriptedEngine.configs.append(config)

    def submit(self, prompt, max_new_tokens, **kw):
        ScriptedEngine.prompts.append(list(prompt))
        return super().submit(prompt, max_new_tokens, **kw)

    def _execute(self, batch):
        script = [*self.script, self.config.eos_id]
        return [script[len(r.output)] if r.num_computed + n == len(r.tokens) else None for r, n in batch]


@pytest.fixture
def nothing_loads(monkeypatch):
    """The loader and the engine fail the test if serve reaches them."""

    def never(*args, **kwargs):
        pytest.fail("serve loaded a model or built an engine although a flag was bad")

    monkeypatch.setattr(load, "trained_model", never)
    monkeypatch.setattr(engine_lib, "Engine", never)


@pytest.fixture
def scripted(monkeypatch):
    """The loader returns a model that is only its config (d_model 128, head_dim 64); the engine is ScriptedEngine."""
    model = types.SimpleNamespace(cfg=CFG)
    monkeypatch.setattr(load, "trained_model", lambda workdir, site=0: (BYTES_RUN, model))
    monkeypatch.setattr(engine_lib, "Engine", ScriptedEngine)
    monkeypatch.setattr(ScriptedEngine, "script", SCRIPT)
    monkeypatch.setattr(ScriptedEngine, "prompts", [])
    monkeypatch.setattr(ScriptedEngine, "configs", [])
    return model


def serve_main(capsys, *args, workdir="unused"):
    """(exit code, stdout, stderr) of `serve.main` with `args`; argparse's exits count as return codes."""
    code: int | str | None
    try:
        code = serve.main([f"--workdir={workdir}", *args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "flag, value, allowed",
    [
        ("--kv-memory-mib", "nan", "finite number > 0"),
        ("--kv-memory-mib", "inf", "finite number > 0"),
        ("--kv-memory-mib", "-inf", "finite number > 0"),
        ("--kv-memory-mib", "1e400", "finite number > 0"),  # float() makes it inf
        ("--kv-memory-mib", "0", "> 0"),
        ("--kv-memory-mib", "-2", "> 0"),
        ("--kv-memory-mib", "1e13", "<= 1099511627776"),  # 2**40 MiB: larger would overflow XLA shape sizes
        ("--kv-memory-mib", "lots", "finite number > 0"),
        ("--temperature", "nan", "finite number >= 0"),
        ("--temperature", "inf", "finite number >= 0"),
        ("--temperature", "-0.5", ">= 0"),
        ("--max-new-tokens", "0", "integer >= 1"),
        ("--max-new-tokens", "-3", "integer >= 1"),
        ("--max-new-tokens", "2.5", "integer >= 1"),
        ("--max-new-tokens", "nan", "integer >= 1"),
        ("--seed", "-1", "integer >= 0"),
        ("--seed", "0.5", "integer >= 0"),
        ("--site", "-1", "integer >= 0"),
        ("--kv-format", "fp16", "bf16"),
        ("--scale-rule", "max", "mse"),
    ],
)
def test_bad_flags_are_refused_before_anything_loads(capsys, tmp_path, nothing_loads, flag, value, allowed):
    """Exit 2 with an `error:` line naming the flag, the value and what is allowed; a workdir that does not exist
    shows that the check comes first (the loader would have complained about it)."""
    code, out, err = serve_main(capsys, "--prompt=x", f"{flag}={value}", workdir=tmp_path / "nope")
    assert code == 2 and not out
    assert "error:" in err and flag in err and value in err and allowed in err and "Traceback" not in err, err


def test_a_prompt_that_is_not_text_nor_bytes_is_refused(capsys, tmp_path, nothing_loads):
    """A lone surrogate that is no escaped byte (U+D800) cannot come from a command line; refused by name."""
    code, out, err = serve_main(capsys, "--prompt=ok", "--prompt=a\ud800", workdir=tmp_path)
    assert code == 2 and not out and "error:" in err and "--prompt" in err and "prompt 2" in err and "\\ud800" in err, (
        err
    )


def test_help_shows_every_flag_with_its_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as exit_info:
        serve.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    helps = {}  # flag -> its help text (on the invocation's line or on the lines below)
    for block in re.split(r"\n(?=  -)", out.split("options:\n")[1]):
        match = re.match(r"  (-[^\n]*?)(?: {2,}|\n +)(\S.*)", block, re.DOTALL)
        assert match, block
        helps[re.findall(r"--[a-z-]+", match[1])[0]] = " ".join(match[2].split())
    defaults = {
        "--max-new-tokens": "200",
        "--kv-format": "fp4",
        "--scale-rule": "mse",
        "--kv-memory-mib": "64.0",
        "--temperature": "0.7",
        "--seed": "0",
        "--site": "0",
    }
    assert set(helps) == {"--help", "--workdir", "--prompt", *defaults}, helps
    for flag, default in defaults.items():
        assert helps[flag].endswith(f"(default: {default})") and len(helps[flag]) > 20, (flag, helps[flag])
    assert "default" not in helps["--workdir"] + helps["--prompt"]  # required: no "(default: None)"


@pytest.mark.parametrize(
    "error, code",
    [
        (CheckpointError("checkpoint 8 in /w/checkpoints cannot be read: array 'params/x' is truncated"), 1),
        (FileNotFoundError("/w is not a finished run's workdir: missing ['/w/config.json']"), 2),
        (ValueError("site = 3: the run in /w has mesh.site = 2 site(s); allowed 0..1"), 2),
    ],
)
def test_the_loaders_failures_are_error_lines(capsys, monkeypatch, error, code):
    """A damaged checkpoint is a runtime failure (exit 1), a workdir that is no run or a site it lacks a usage
    error (exit 2): one `error:` line each, no traceback."""

    def trained_model(workdir, site=0):
        raise error

    monkeypatch.setattr(load, "trained_model", trained_model)
    assert serve_main(capsys, "--prompt=x") == (code, "", f"error: {error}\n")


def test_an_empty_workdir_is_an_error_line(capsys, tmp_path):
    """The real loader on an empty directory (FileNotFoundError): exit 2 naming what is missing."""
    code, out, err = serve_main(capsys, "--prompt=x", workdir=tmp_path)
    assert code == 2 and not out and err.startswith("error: ") and "missing" in err and "Traceback" not in err


def test_characters_split_across_steps_stream_whole(capsys, scripted):
    """Every byte of SCRIPT comes in its own engine step: the streamed line is the prompt and SCRIPT as text, without
    a single U+FFFD (each step's bytes decoded alone gave one per byte of every multi-byte character); a second
    request is printed whole; the engine got the prompts' UTF-8 bytes after BOS."""
    code, out, err = serve_main(capsys, "--prompt=déjà ", "--prompt=b", "--kv-format=bf16", "--max-new-tokens=64")
    assert code == 0, err
    expected = "déjà " + SCRIPT.decode()
    assert out.splitlines() == [expected, "--- request 1:", "b" + SCRIPT.decode()]
    assert ScriptedEngine.prompts == [[257, *"déjà ".encode()], [257, *b"b"]]
    assert "\ufffd" not in out


def test_a_prompt_of_raw_bytes_is_served_as_those_bytes(capsys, scripted, monkeypatch):
    """`--prompt $'\\xff\\xc3'` reaches Python as surrogate escapes: the engine gets the bytes FF C3; the output shows
    FF as U+FFFD and C3 completed by the first generated byte (A9) into "é", as the whole byte stream decodes."""
    monkeypatch.setattr(ScriptedEngine, "script", b"\xa9!")
    code, out, err = serve_main(capsys, "--prompt=\udcff\udcc3", "--kv-format=bf16")
    assert code == 0, err
    assert ScriptedEngine.prompts == [[257, 0xFF, 0xC3]]
    assert out.splitlines() == [b"\xff\xc3\xa9!".decode("utf-8", errors="replace")] == ["\ufffdé!"]


def test_a_pool_too_small_for_a_block_or_the_request_names_the_flags(capsys, scripted):
    code, out, err = serve_main(capsys, "--prompt=x", "--kv-memory-mib=0.001", "--kv-format=bf16")
    minimum = BF16_BLOCK_BYTES / 2**20  # 0.0078125 MiB
    assert code == 2 and not out and err.startswith("error: --kv-memory-mib=0.001 "), err
    assert f"minimum is {minimum!r} MiB" in err and str(BF16_BLOCK_BYTES) in err
    assert (
        serve_main(capsys, "--prompt=x", f"--kv-memory-mib={minimum!r}", "--kv-format=bf16", "--max-new-tokens=2")[0]
        == 0
    )
    # one block (16 tokens) for 1 + 1 + 20 tokens: the request cannot fit
    code, out, err = serve_main(
        capsys, "--prompt=x", f"--kv-memory-mib={minimum!r}", "--kv-format=bf16", "--max-new-tokens=20"
    )
    assert code == 2 and not out and "--max-new-tokens=20" in err and f"--kv-memory-mib={minimum!r}" in err, err


def test_a_format_the_model_cannot_use_is_refused_by_name(capsys, scripted, monkeypatch):
    narrow = types.SimpleNamespace(cfg=TransformerConfig(d_model=16, num_heads=2, num_kv_heads=2, num_layers=1))
    monkeypatch.setattr(load, "trained_model", lambda workdir, site=0: (BYTES_RUN, narrow))
    code, out, err = serve_main(capsys, "--prompt=x", "--kv-format=fp4")
    assert code == 2 and not out and err.startswith("error: --kv-format=fp4") and "head_dim = 8" in err, err


def test_a_bpe_run_is_served_with_its_tokenizer(capsys, scripted, monkeypatch):
    """A run whose data.tokenizer is a BPE: the engine gets the prompt's BPE ids after its BOS (1), never samples its
    PAD / BOS and stops at its EOS (2); the script's ids, one per step and cutting characters (b"r\\xc3"), stream as
    whole text."""
    tok = HFTokenizer.from_file(BPE_DIR)
    text = "crème brûlée, 日本語のテキストです 😀 ok"
    script = tok.encode(text, bos=False).tolist()
    assert any(tok.decode([i]) != tok.decode_bytes([i]).decode(errors="ignore") for i in script)  # a torn character
    run = types.SimpleNamespace(data=types.SimpleNamespace(tokenizer=str(BPE_DIR)))
    model = types.SimpleNamespace(cfg=TransformerConfig(**{**CFG.__dict__, "vocab_size": 320}))
    monkeypatch.setattr(load, "trained_model", lambda workdir, site=0: (run, model))
    monkeypatch.setattr(ScriptedEngine, "script", script)
    code, out, err = serve_main(capsys, "--prompt=déjà ", "--kv-format=bf16", "--max-new-tokens=64")
    assert code == 0, err
    assert out.splitlines() == ["déjà " + text] and "\ufffd" not in out
    assert ScriptedEngine.prompts == [tok.encode("déjà ").tolist()] and ScriptedEngine.prompts[0][0] == 1
    assert f"{len(script) + 1} tokens" in err  # the script and the EOS that ended it
    [config] = ScriptedEngine.configs
    assert (config.eos_id, config.never, config.num_ids) == (2, (0, 1), 320)
