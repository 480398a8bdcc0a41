"""experiments.serve in-process: bad flags, alone or for the run (a --site it lacks, a KV format that cannot hold its
heads, a pool too small for a block or a request), refused by name before the model is loaded; the loader's failures
as `error:` lines with their exit codes; the run's own KV format by default; warm-up before any request; a header
over every request's text; a character split across engine steps streamed whole, a prompt of raw bytes served as
those bytes.

All but the last test neither train nor compile: a run is its config.json (the loader's check of a workdir and its
config are real), the loader is replaced by one returning that config and a model that is only its config, and the
engine by an engine core over the real scheduler (kvcache.serving.Scheduler) whose "model" emits a scripted token
per decode step (a byte; or a BPE id, for a run with a BPE tokenizer). The last one loads and serves a real
checkpoint whose parameters are sharded over mesh.model = 2 of the 8 virtual devices."""

import dataclasses
import json
import logging
import pathlib
import re
import types
from typing import ClassVar

import pytest
from flax import nnx

from core.byte_tokenizer import ByteTokenizer
from core.checkpoint import CheckpointError
from core.config import TransformerConfig
from core.hf_tokenizer import HFTokenizer
from experiments import build, load, schema, serve
from experiments import engine as serve_engine
from kvcache import capacity, formats
from kvcache import serving as engine_lib

# head_dim 64 (fp4 needs a multiple of 64); a block of 16 tokens in bf16: 2 layers x 16 x (K + V: 2 x 64 x 2 bytes)
CFG = TransformerConfig(vocab_size=264, d_model=128, num_layers=2, num_heads=2, num_kv_heads=1, d_ff=64)
BF16_BLOCK_BYTES = 2 * 16 * 2 * 64 * 2
SCRIPT = "naïve € 😀 ok".encode()  # 1-, 2-, 3- and 4-byte characters
BPE_DIR = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf" / "tokenizer"  # 320 ids: pad 0, bos 1, eos 2


def write_run(workdir, *, model=CFG, tokenizer="bytes", kvcache=None, sites=1, recipe="none"):
    """A finished run's workdir as far as serve reads it before loading: config.json (`model`, data.tokenizer,
    the `kvcache` section's keys given, mesh.site, precision.recipe), data.json and an (empty) checkpoints/."""
    workdir = pathlib.Path(workdir)
    (workdir / "checkpoints").mkdir(parents=True, exist_ok=True)
    config = {
        "model": dataclasses.asdict(model),
        "data": {"tokenizer": tokenizer},
        "kvcache": {"format": "bf16", **(kvcache or {})},
        "mesh": {"site": sites},
        "precision": {"recipe": recipe},
    }
    (workdir / "config.json").write_text(json.dumps(config))
    (workdir / "data.json").write_text(json.dumps({"fingerprint": "f"}))
    return workdir


class ScriptedEngine(engine_lib.EngineCore):
    """The engine's scheduler with a script for a model: a request's next token is token `len(output)` of the script
    (SCRIPT's bytes by default), then the EOS the engine was configured with; after the one-step prefill, one token
    per step (a multi-byte character arrives over several steps). The pool holds as many blocks as `memory_bytes`
    does for the model (kvcache.paged's rule)."""

    script: bytes | list[int] = SCRIPT
    prompts: ClassVar[list[list[int]]] = []  # what each instance was submitted, in order
    configs: ClassVar[list[engine_lib.EngineConfig]] = []  # each instance's config
    kv_formats: ClassVar[list[formats.Format]] = []  # each instance's KV format
    precisions: ClassVar[list[str]] = []  # the precision each load asked for
    events: ClassVar[list[str]] = []  # "warmup" and "submit", in the order they happened

    def __init__(self, model, fmt, config):
        cfg = model.cfg
        shape = capacity.ModelShape(
            full_attention_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim
        )
        num_blocks = capacity.num_blocks(config.memory_bytes, shape, fmt, block_size=config.block_size)
        super().__init__(engine_lib.Scheduler(config, fmt, num_blocks))
        ScriptedEngine.configs.append(config)
        ScriptedEngine.kv_formats.append(fmt)

    def warmup(self):
        ScriptedEngine.events.append("warmup")

    def submit(self, prompt, max_new_tokens, **kw):
        ScriptedEngine.prompts.append(list(prompt))
        ScriptedEngine.events.append("submit")
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
def a_run(tmp_path, monkeypatch):
    """The current directory is `tmp_path`, holding `run`: write_run's run of CFG (d_model 128, head_dim 64), byte
    tokenizer, bf16 KV cache. Returns write_run, to rewrite it."""
    monkeypatch.chdir(tmp_path)
    write_run("run")
    return lambda **kw: write_run("run", **kw)


@pytest.fixture
def scripted(monkeypatch, a_run):
    """`a_run`; the loader returns its config and a model that is only its config; the engine is ScriptedEngine."""

    def trained_model(workdir, site=0, precision="trained"):
        config = load.run_config(workdir)
        ScriptedEngine.precisions.append(precision)
        return config, types.SimpleNamespace(cfg=schema.model_config(config))

    monkeypatch.setattr(load, "trained_model", trained_model)
    monkeypatch.setattr(engine_lib, "Engine", ScriptedEngine)
    monkeypatch.setattr(ScriptedEngine, "script", SCRIPT)
    for name in ("prompts", "configs", "kv_formats", "events", "precisions"):
        monkeypatch.setattr(ScriptedEngine, name, [])
    return a_run


def serve_main(capsys, *args, workdir="run"):
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
        ("--decode-steps", "0", "integer >= 1"),
        ("--temperature", "nan", "finite number >= 0"),
        ("--temperature", "inf", "finite number >= 0"),
        ("--temperature", "-0.5", ">= 0"),
        ("--max-new-tokens", "0", "integer >= 1"),
        ("--max-new-tokens", "-3", "integer >= 1"),
        ("--max-new-tokens", "2.5", "integer >= 1"),
        ("--max-new-tokens", "nan", "integer >= 1"),
        ("--seed", "-1", "integer >= 0"),
        ("--seed", "0.5", "integer >= 0"),
        ("--seed", str(2**64), f"<= {2**64 - 1}"),  # the engine's random streams take 64-bit seeds
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


NARROW = TransformerConfig(d_model=16, num_heads=2, num_kv_heads=2, num_layers=1)  # head_dim 8: no fp4
MIN_MIB = BF16_BLOCK_BYTES / 2**20  # 0.0078125: one bf16 block of CFG, 16 tokens


@pytest.mark.parametrize(
    "run, args, needles",
    [
        # pools too small for one block (1e-7 MiB: 0 bytes) or for a request
        ({}, ["--kv-memory-mib=0.001"], ["--kv-memory-mib=0.001 holds no KV block", f"minimum is {MIN_MIB!r} MiB"]),
        ({}, ["--kv-memory-mib=1e-7"], ["--kv-memory-mib=1e-07 holds no KV block", f"{BF16_BLOCK_BYTES} bytes"]),
        (
            {},
            [f"--kv-memory-mib={MIN_MIB!r}", "--max-new-tokens=20"],
            ["--max-new-tokens=20", f"--kv-memory-mib={MIN_MIB!r}", "16 tokens in bf16", "--max-new-tokens <= 14"],
        ),
        (
            {},
            [f"--kv-memory-mib={MIN_MIB!r}", "--max-new-tokens=1", "--prompt=" + "y" * 20],
            ["--prompt: prompt 2 (21 tokens", f"--kv-memory-mib={MIN_MIB!r}", "at most 15 tokens"],
        ),
        # a site the run lacks
        ({}, ["--site=1"], ["--site=1", "mesh.site = 1", "allowed --site in 0..0"]),
        ({"sites": 2}, ["--site=2"], ["--site=2", "mesh.site = 2", "allowed --site in 0..1"]),
        # a format the model's heads do not fit, the scale rule without fp4 (given, or the run's format)
        ({"model": NARROW}, ["--kv-format=fp4"], ["--kv-format=fp4", "head_dim = 8", "['bf16', 'fp8']"]),
        (
            {},
            ["--scale-rule=mx", "--kv-format=fp8"],
            ["--scale-rule=mx", "fp4/k8v4 KV format only", "fp8 (--kv-format"],
        ),
        ({"kvcache": {"format": "fp8"}}, ["--scale-rule=mse"], ["--scale-rule=mse", "the run's kvcache.format"]),
    ],
)
def test_flags_this_run_cannot_serve_are_refused_before_it_loads(capsys, a_run, nothing_loads, run, args, needles):
    """Checked against the run's config.json alone: exit 2, one `error:` line naming the flag, the value and what is
    allowed, no traceback, and neither the model nor an engine is built."""
    a_run(**run)
    code, out, err = serve_main(capsys, "--prompt=x", *args)
    assert code == 2 and not out and err.startswith("error: ") and err.count("\n") == 1, err
    assert all(needle in err for needle in needles), (needles, err)


def test_a_prompt_that_is_not_text_nor_bytes_is_refused(capsys, tmp_path, nothing_loads):
    """A lone surrogate that is no escaped byte (U+D800) cannot come from a command line; refused by name."""
    code, out, err = serve_main(capsys, "--prompt=ok", "--prompt=a\ud800", workdir=tmp_path)
    assert code == 2 and not out and "error:" in err and "--prompt" in err and "prompt 2" in err and "\\ud800" in err, (
        err
    )


@pytest.mark.parametrize("argv", [["--help"], ["--http", "--help"]])
def test_help_states_each_default_once(capsys, monkeypatch, argv):
    """Both serve commands' --help: no flag's help names its default twice, and none says "(default: None)"."""
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        serve.main(argv)
    out = capsys.readouterr().out
    assert "(default: None)" not in out
    for block in re.split(r"\n(?=  -)", out.split("options:\n")[1]):
        assert " ".join(block.split()).count("(default:") <= 1, block


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
        "--kv-format": "the run's kvcache.format",
        "--scale-rule": "the run's kvcache.scale_rule",
        "--kv-memory-mib": "64.0",
        "--decode-steps": "8",
        "--temperature": "0.7",
        "--seed": "0",
        "--site": "0",
        "--precision": "trained",
    }
    assert set(helps) == {"--help", "--workdir", "--prompt", "--http", *defaults}, helps
    assert "OpenAI API over HTTP" in helps["--http"]
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
def test_the_loaders_failures_are_error_lines(capsys, monkeypatch, a_run, error, code):
    """A damaged checkpoint is a runtime failure (exit 1), a workdir that is no run or a site it lacks a usage
    error (exit 2): one `error:` line each (after the lines saying which KV format and GEMMs would serve), no
    traceback."""

    def trained_model(workdir, site=0, precision="trained"):
        raise error

    monkeypatch.setattr(load, "trained_model", trained_model)
    said = (
        "kv format: bf16 (the run's kvcache.format; --kv-format overrides)\nGEMMs: float (the run trained in float)\n"
    )
    assert serve_main(capsys, "--prompt=x") == (code, "", f"{said}error: {error}\n")


def test_an_empty_workdir_is_an_error_line(capsys, tmp_path):
    """The real loader on an empty directory (FileNotFoundError): exit 2 naming what is missing."""
    code, out, err = serve_main(capsys, "--prompt=x", workdir=tmp_path)
    assert code == 2 and not out and err.startswith("error: ") and "missing" in err and "Traceback" not in err


def test_characters_split_across_steps_stream_whole(capsys, scripted):
    """Every byte of SCRIPT comes in its own engine step: the streamed line is the prompt and SCRIPT as text, without
    a single U+FFFD (each step's bytes decoded alone gave one per byte of every multi-byte character); a second
    request is printed whole, each under the same header; the engine got the prompts' UTF-8 bytes after BOS, once
    it was warmed up (serve.warm_up), and the step's token budget is what the requests can hold."""
    code, out, err = serve_main(capsys, "--prompt=déjà ", "--prompt=b", "--kv-format=bf16", "--max-new-tokens=64")
    assert code == 0, err
    expected = "déjà " + SCRIPT.decode()
    assert out.splitlines() == ["--- request 0:", expected, "--- request 1:", "b" + SCRIPT.decode()]
    assert ScriptedEngine.prompts == [[257, *"déjà ".encode()], [257, *b"b"]]
    assert ScriptedEngine.events == ["warmup", "submit", "submit"]
    assert ScriptedEngine.configs[0].max_num_batched_tokens == (1 + 7 + 64) + (1 + 1 + 64)  # "déjà " is 7 bytes
    assert "\ufffd" not in out
    assert re.search(r"^compiled in \d+\.\d s \(.*times to first token below exclude it\)$", err, re.MULTILINE), err


def test_a_prompt_of_raw_bytes_is_served_as_those_bytes(capsys, scripted, monkeypatch):
    """`--prompt $'\\xff\\xc3'` reaches Python as surrogate escapes: the engine gets the bytes FF C3; the output shows
    FF as U+FFFD and C3 completed by the first generated byte (A9) into "é", as the whole byte stream decodes."""
    monkeypatch.setattr(ScriptedEngine, "script", b"\xa9!")
    code, out, err = serve_main(capsys, "--prompt=\udcff\udcc3", "--kv-format=bf16")
    assert code == 0, err
    assert ScriptedEngine.prompts == [[257, 0xFF, 0xC3]]
    assert out.splitlines() == [b"\xff\xc3\xa9!".decode("utf-8", errors="replace")] == ["\ufffdé!"]


def test_the_smallest_pool_serves_a_request_that_fills_it(capsys, scripted, monkeypatch):
    """The minimum --kv-memory-mib (one bf16 block of 16 tokens) serves BOS + "x" + 14 new tokens, exactly its 16
    (one more new token is refused: test_flags_this_run_cannot_serve_are_refused_before_it_loads)."""
    monkeypatch.setattr(ScriptedEngine, "script", b"y" * 20)  # no EOS before max_new_tokens
    code, out, err = serve_main(capsys, "--prompt=x", f"--kv-memory-mib={MIN_MIB!r}", "--max-new-tokens=14")
    assert code == 0 and out == "x" + "y" * 14 + "\n", err
    assert "bf16 KV pool: 16 tokens in 0.0078125 MiB" in err


@pytest.mark.parametrize(
    "kvcache, args, label, line",
    [
        ({"format": "fp8"}, [], "fp8", "fp8 (the run's kvcache.format; --kv-format overrides)"),
        ({"format": "fp8"}, ["--kv-format=bf16"], "bf16", "bf16 (--kv-format)"),
        (
            {"format": "fp4", "scale_rule": "mx", "rotate_k": False},
            [],
            "fp4 (mx, K unrotated)",
            "fp4 (the run's kvcache.format; --kv-format overrides), scale rule mx (the run's kvcache.scale_rule; "
            "--scale-rule overrides)",
        ),
        ({}, ["--kv-format=fp4", "--scale-rule=mx"], "fp4 (mx)", "fp4 (--kv-format), scale rule mx (--scale-rule)"),
        # the run's fp4 options do not apply to the format a flag picks
        ({"format": "fp4", "grid": "int4", "rotate_k": False}, ["--kv-format=fp8"], "fp8", "fp8 (--kv-format)"),
        (
            {"format": "nvfp4", "select": "4over6"},
            [],
            "nvfp4 (4over6)",
            "nvfp4 (the run's kvcache.format; --kv-format overrides)",
        ),
    ],
)
def test_the_kv_format_is_the_runs_unless_a_flag_says_otherwise(capsys, scripted, kvcache, args, label, line):
    """The run's kvcache section (format; for fp4 its scale rule and K rotation too) picks the format, --kv-format /
    --scale-rule replace what they name; stderr says which format serves and why."""
    scripted(kvcache=kvcache)
    code, _, err = serve_main(capsys, "--prompt=x", *args)
    assert code == 0, err
    assert [fmt.label for fmt in ScriptedEngine.kv_formats] == [label]
    assert f"kv format: {line}\n" in err and f"{label} KV pool:" in err, err


def test_a_bpe_run_is_served_with_its_tokenizer(capsys, scripted, monkeypatch):
    """A run whose data.tokenizer is a BPE: the engine gets the prompt's BPE ids after its BOS (1), never samples its
    PAD / BOS and stops at its EOS (2); the script's ids, one per step and cutting characters (b"r\\xc3"), stream as
    whole text."""
    tok = HFTokenizer.from_file(BPE_DIR)
    text = "crème brûlée, 日本語のテキストです 😀 ok"
    script = tok.encode(text, bos=False).tolist()
    assert any(tok.decode([i]) != tok.decode_bytes([i]).decode(errors="ignore") for i in script)  # a torn character
    scripted(tokenizer=str(BPE_DIR), model=dataclasses.replace(CFG, vocab_size=320))
    monkeypatch.setattr(ScriptedEngine, "script", script)
    code, out, err = serve_main(capsys, "--prompt=déjà ", "--kv-format=bf16", "--max-new-tokens=64")
    assert code == 0, err
    assert out.splitlines() == ["déjà " + text] and "\ufffd" not in out
    assert ScriptedEngine.prompts == [tok.encode("déjà ").tolist()] and ScriptedEngine.prompts[0][0] == 1
    assert f"{len(script) + 1} tokens" in err  # the script and the EOS that ended it
    [config] = ScriptedEngine.configs
    assert (config.eos_id, config.never, config.num_ids) == (2, (0, 1), 320)


def _saved_run(workdir, config):
    """(workdir, graphdef, state): a run's workdir as experiments.run writes it for `config` (config.json and
    data.json by write_records, a checkpoint at step 2 by core.checkpoint) without training: the initial state's
    parameters scaled so that they differ from the loader's own start from the same seed."""
    import jax

    from core import checkpoint as checkpoint_lib
    from core import train as train_lib
    from experiments import load

    schema.validate(config, num_devices=8)
    _, sharder = build.build_mesh(config)
    graphdef, state = train_lib.init_state(
        build.build_model_fn(config, sharder), build.build_optimizer(config), config.train.seed, sharder
    )
    state = state._replace(params=jax.jit(lambda p: jax.tree.map(lambda x: 1.5 * x + 0.01, p))(state.params))
    workdir.mkdir()
    load.write_records(str(workdir), config, types.SimpleNamespace(fingerprint="f", info={}))
    checkpointer = checkpoint_lib.Checkpointer(workdir / "checkpoints")
    compat = schema.checkpoint_compat(config, "f")
    checkpointer.save(2, state, loop={}, compat=compat, provenance=schema.provenance(config))
    checkpointer.close()
    return workdir, graphdef, state


def test_a_ufp4_run_loads_in_its_4_bit_gemms_or_in_float(tmp_path):
    """A UFP4 run loads computing as it trained (its 4-bit GEMMs: the logits of the saved state's own model) by
    default, and with precision="float" as its export does (the logits of the same parameters in a float model,
    which differ from the 4-bit ones); the returned config says which (precision.recipe)."""
    import jax
    import numpy as np

    from helpers import make_tiny_config

    config = make_tiny_config()
    config.model.update(num_layers=1, d_model=64)
    config.moe.every = 0
    config.mesh.update(data=1, model=1)
    config.precision.recipe = "ufp4"
    workdir, graphdef, state = _saved_run(tmp_path / "run", config)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 256)
    logits = lambda m: np.asarray(jax.jit(lambda t: m(t)[0])(tokens))  # noqa: E731
    four_bit = logits(nnx.merge(graphdef, state.params, state.rest))
    as_trained_config, as_trained = load.trained_model(str(workdir))
    as_float_config, as_float = load.trained_model(str(workdir), precision="float")
    assert (as_trained_config.precision.recipe, as_float_config.precision.recipe) == ("ufp4", "none")
    np.testing.assert_allclose(logits(as_trained), four_bit, rtol=0, atol=1e-5 * np.abs(four_bit).max())
    config.precision.recipe = "none"
    float_graphdef, _ = nnx.split(build.build_model_fn(config, build.build_mesh(config)[1])(nnx.Rngs(0)))
    in_float = logits(nnx.merge(float_graphdef, state.params, state.rest))
    np.testing.assert_allclose(logits(as_float), in_float, rtol=0, atol=1e-5 * np.abs(in_float).max())
    assert np.abs(in_float - four_bit).max() > 1e-2 * np.abs(in_float).max()  # (so the two really differ)
    with pytest.raises(ValueError, match="precision = 'fp4'; allowed: trained, float"):
        load.trained_model(str(workdir), precision="fp4")


def test_a_tensor_parallel_run_loads_and_serves_on_one_device(tmp_path, capsys, monkeypatch):
    """A run's workdir as a run on a mesh.model = 2 mesh writes it (config.json and data.json by
    experiments.load.write_records, the checkpoint of the training state by core.checkpoint, its parameters sharded
    over 'model' and scaled so that they differ from the loader's own start from the same seed) loads on one device:
    the config's mesh is one device, every parameter equals the saved one and lies on one device, and the logits
    equal those of the sharded model. Served, the run's KV format is the default (not fp4, which its heads cannot
    hold), every request has its header, and no step of the engine compiles after warm-up (jax.log_compiles).
    (Not trained: compiling a train step would multiply the time; a MoE sharded over mesh.expert loads by the same
    reset of the mesh but takes twice as long to compile.)"""
    import jax
    import numpy as np

    from core.model import split_params

    from helpers import make_tiny_config

    config = make_tiny_config()
    config.model.num_layers = 1
    config.moe.every = 0  # dense
    config.mesh.update(data=1, model=2)  # (kvcache.format: bf16, the default; head_dim 8 holds no fp4)
    workdir, graphdef, state = _saved_run(tmp_path / "run", config)
    assert any("'model'" in str(x.sharding.spec) for x in jax.tree.leaves(state.params))

    loaded_config, model = load.trained_model(str(workdir))
    assert [loaded_config.mesh[a] for a in ("site", "data", "expert", "model", "num_processes")] == [1] * 5

    def same(saved, loaded):
        assert len(loaded.sharding.device_set) == 1
        np.testing.assert_array_equal(np.asarray(loaded), np.asarray(saved))

    jax.tree.map(same, state.params, split_params(model)[1])  # (and the same tree)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 256)
    trained = nnx.merge(graphdef, state.params, state.rest)
    expected, got = (np.asarray(jax.jit(lambda t, m=m: m(t)[0])(tokens)) for m in (trained, model))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())

    # serve it (the model just loaded; serve's own checks read the workdir): compiles only while warming up
    monkeypatch.setattr(load, "trained_model", lambda workdir, site=0, precision="trained": (loaded_config, model))
    warm, compiles = [False], []  # whether warm-up had ended, at each compilation of the engine's step
    serve_warm_up = serve.warm_up

    def warm_up(engine):
        seconds = serve_warm_up(engine)
        warm[0] = True
        return seconds

    monkeypatch.setattr(serve, "warm_up", warm_up)

    class Compiles(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Compiling") and ("jit(forward)" in message or "jit(decode_steps)" in message):
                compiles.append(warm[0])

    handler = Compiles()
    logging.getLogger("jax").addHandler(handler)
    try:
        with jax.log_compiles(True):
            args = ["--prompt=ab", "--prompt=c", "--max-new-tokens=3", "--kv-memory-mib=0.01", "--temperature=0"]
            code, out, err = serve_main(capsys, *args, workdir=workdir)
    finally:
        logging.getLogger("jax").removeHandler(handler)
    assert code == 0, err
    assert "kv format: bf16 (the run's kvcache.format; --kv-format overrides)" in err
    assert compiles and not any(compiles), compiles
    lines = out.splitlines()
    assert lines[0] == "--- request 0:" and lines[1].startswith("ab") and lines[2] == "--- request 1:", out


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--port=70000"], ["--port", "'70000' is not an integer >= 0 and <= 65535"]),
        ([f"--seed={2**64}"], ["--seed", f"'{2**64}' is not an integer >= 0 and <= {2**64 - 1}"]),
        (
            ["--max-model-len=300", "--max-num-batched-tokens=256"],
            ["--max-model-len=300 must be >= 2 x --max-num-batched-tokens = 512"],
        ),
        (
            ["--max-num-batched-tokens=200"],
            ["max_model_len = 256 (the run's data.seq_len) must be >= 2 x --max-num-batched-tokens = 400"],
        ),
        (["--site=1"], ["--site=1: the run in run has mesh.site = 1 site(s); allowed --site in 0..0"]),
        (["--kv-memory-mib=0.0001"], ["--kv-memory-mib=0.0001 holds no KV block"]),
        (["--chat-template=missing.jinja"], ["--chat-template='missing.jinja' cannot be read"]),
        (["--chat-template=bad.jinja"], ["the chat template from bad.jinja does not compile"]),
        (["--scale-rule=mx"], ["--scale-rule=mx applies to the fp4/k8v4 KV format only"]),
        (["--generation-config=nowhere"], ["--generation-config='nowhere' does not exist; allowed: auto"]),
        (["--generation-config=run"], ["--generation-config='run' holds no generation_config.json"]),
        (["--generation-config=gen"], ["eos_token_id holds 999, outside the tokenizer's ids [0, 259)"]),
        (["--generation-config=badgen"], ["badgen/generation_config.json: top_p = 2; allowed: a number in (0, 1]"]),
    ],
)
def test_http_flags_are_refused_before_anything_loads(capsys, a_run, nothing_loads, args, needles):
    """`serve --http`: each bad flag is one `error:` line (exit 2) naming it, before the model loads."""
    pathlib.Path("bad.jinja").write_text("{% for m in messages %}{{ m.content }")
    for folder, fields in (("gen", {"eos_token_id": [258, 999]}), ("badgen", {"top_p": 2})):
        pathlib.Path(folder).mkdir()
        (pathlib.Path(folder) / "generation_config.json").write_text(json.dumps(fields))
    code, _, err = serve_main(capsys, "--http", *args)
    assert code == 2 and "error" in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def test_the_http_servers_max_model_len_is_the_models_context_unless_given(tmp_path):
    """--max-model-len defaults to what the model was made for: an imported checkpoint's max_position_embeddings
    (while its folder exists), else the run's data.seq_len, not a fixed 2048; --max-num-batched-tokens to 256 or
    half of that; flags given win."""
    from experiments.server import cli as http_cli

    run = schema.default_config()
    run.data.seq_len = 96
    parse = http_cli.build_parser().parse_args
    assert serve_engine.served_lengths(parse(["--workdir", "w"]), run) == (96, 48)
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"max_position_embeddings": 1000}))
    run.checkpoint.init_from = f"hf:{source}"
    assert serve_engine.served_lengths(parse(["--workdir", "w"]), run) == (1000, 256)
    given = parse(["--workdir", "w", "--max-model-len", "700", "--max-num-batched-tokens", "300"])
    assert serve_engine.served_lengths(given, run) == (700, 300)
    (source / "config.json").unlink()
    source.rmdir()  # the imported folder is gone: the run's own training length
    assert serve_engine.served_lengths(parse(["--workdir", "w"]), run) == (96, 48)


def test_decode_steps_reach_the_engine_config():
    """--decode-steps is the engine's decode steps per device call: EngineConfig's default unless given."""
    from experiments.server import cli as http_cli

    run, fmt = schema.default_config(), formats.get("bf16")
    for argv, steps in (
        (["--workdir", "w"], engine_lib.EngineConfig.decode_steps),
        (["--workdir", "w", "--decode-steps", "1"], 1),
    ):
        args = http_cli.build_parser().parse_args(argv)
        assert serve_engine.engine_config(args, run, fmt, ByteTokenizer()).decode_steps == steps


@pytest.mark.parametrize(
    "recipe, args, precision, line",
    [
        ("ufp4", [], "trained", "GEMMs: ufp4 (the run's training recipe; --precision float computes in float"),
        ("ufp4", ["--precision=float"], "float", "GEMMs: float (--precision float; the run trained with the ufp4"),
        ("none", [], "trained", "GEMMs: float (the run trained in float)"),
    ],
)
def test_serve_says_what_its_gemms_compute_in(capsys, scripted, recipe, args, precision, line):
    """A UFP4 run is served with its 4-bit GEMMs unless --precision float asks for float (what its export computes);
    stderr says which, and the loader is asked for it."""
    scripted(recipe=recipe)
    code, _, err = serve_main(capsys, "--prompt=x", *args)
    assert code == 0, err
    assert line in err and ScriptedEngine.precisions == [precision], err


@pytest.mark.parametrize(
    "text, words",
    [
        ("not json", "config.json is not JSON (Expecting value"),
        ("[1, 2]", "config.json holds a JSON list, not an object of config sections"),
        ('{"foo": {}}', "config.json: 'foo' is not a config section; allowed: checkpoint"),
        ('{"model": [1]}', "config.json: section 'model' is a JSON list"),
        ('{"model": {"dmodel": 3}}', "config.json: 'model.dmodel' is not a config key"),
        ('{"model": {"d_model": "abc"}}', "config.json: 'model.d_model' = 'abc'"),
        ('{"model": {"d_model": -3}}', "config.json: config key 'model.d_model' = -3 is outside the allowed range"),
    ],
)
def test_a_hand_edited_config_json_is_one_error_line_for_serve_and_export(capsys, a_run, text, words):
    """`serve`, `serve --http` and `experiments.hf export` on a run whose config.json was edited into something no
    run wrote: exit 2 and one `error:` line naming the file and the key, no traceback."""
    from experiments.hf import __main__ as hf_cli

    pathlib.Path("run/config.json").write_text(text)
    for command in (
        lambda: serve_main(capsys, "--prompt=x"),
        lambda: serve_main(capsys, "--http"),
        lambda: (hf_cli.main(["export", "--workdir=run", "--out=out"]), *capsys.readouterr()),
    ):
        code, _, err = command()
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err, err
        assert "run/config.json" in err
