"""Hugging Face checkpoints against transformers' own forward, through fixtures (tests/fixtures/hf, made by its
committed script with transformers; these tests never import torch): for tiny random Llama (head_dim != d_model /
heads, Llama 3.1 RoPE scaling, untied), Qwen2 (q/k/v biases, tied), Qwen3 (q/k norm), Mixtral (sharded safetensors,
softmax top-2 SwiGLU experts) and Qwen3-MoE (a dense first layer) checkpoints, imported logits on a ragged batch,
every MoE layer's top-k experts, and 32 greedy tokens; and clear refusals of what the importer cannot honour."""

import collections
import dataclasses
import inspect
import json
import json.decoder
import os
import pathlib
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from core import fields as fields_lib
from core import generate as generate_lib
from core import mesh as mesh_lib
from core import train as train_lib
from core.fields import ConfigError
from core.model import split_params
from experiments import build, federated, pretrained, schema, schema_kvcache, serve
from experiments import load as run_load
from experiments import run as run_lib
from experiments.configs import finetune
from experiments.hf import __main__ as hf_cli
from experiments.hf import arch, config_map, export, load, weights
from kvcache.serving import Engine, EngineConfig
from moe import placement as placement_lib
from moe.config import MoEConfig

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
NAMES = ["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", "mistral", "qwen2_moe", "olmoe"]


@pytest.mark.parametrize("name", NAMES)
def test_imported_model_equals_transformers(name):
    directory = os.path.join(FIXTURES, name)
    reference = np.load(os.path.join(directory, "reference.npz"))
    config = pretrained.config_from_hf(directory)
    config.moe.grouped_matmul = "ragged_dot"  # the CPU's default windowed loop computes the same, compiles slower
    config, model = pretrained.model_from_hf(directory, config=config)
    logits, aux, _ = jax.jit(lambda t: model(t, intermediates=True))(jnp.asarray(reference["tokens"]))
    logits = np.asarray(logits)
    for row, n in enumerate(reference["lengths"]):  # ragged rows: each row's own prefix
        expected = reference["logits"][row, :n]
        scale = np.max(np.abs(expected))
        assert np.max(np.abs(logits[row, :n] - expected)) <= 1e-5 * scale, (name, row)
    routes = aux["intermediates"].get("routes", ())
    assert len(routes) == (len(reference["topk_experts"]) if "topk_experts" in reference else 0)
    for layer, chosen in enumerate(routes):
        np.testing.assert_array_equal(np.sort(np.asarray(chosen), -1), reference["topk_experts"][layer])
    greedy = generate_lib.generate(
        model,
        [reference["greedy_prompt"]],
        max_new_tokens=32,
        key=jax.random.key(0),
        cache_factory=generate_lib.dense_cache_factory(model, jnp.float32),
        eos_id=None,
        never=(),
        num_ids=None,
    )
    np.testing.assert_array_equal(greedy[0], reference["greedy"])
    assert config.model.vocab_size == reference["logits"].shape[-1]


def _copy(tmp_path, name="qwen3"):
    return shutil.copytree(os.path.join(FIXTURES, name), tmp_path / name)


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures = ['GPT2LMHeadModel']: supported: LlamaForCausalLM"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu': only 'silu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type 'yarn' is not implemented"),
        ({"use_sliding_window": True}, "use_sliding_window = True"),
        ({"some_new_field": 3}, "some_new_field = 3: a field this importer does not know"),
        ({"num_hidden_layers": -1}, "num_hidden_layers = -1: it maps to our config key 'model.num_layers' = -1"),
    ],
)
def test_unsupported_config_fields_are_refused_by_name(tmp_path, changes, needle):
    directory = _copy(tmp_path)
    _edit_config(directory, **changes)
    with pytest.raises(config_map.HFConfigError, match="config.json: ") as e:
        pretrained.model_from_hf(str(directory))
    assert needle in str(e.value), str(e.value)


def test_missing_shard_missing_tensor_and_wrong_shape_are_refused_by_name(tmp_path):
    directory = _copy(tmp_path, "mixtral")
    (directory / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(weights.HFWeightsError, match="model-00002-of-00003.safetensors: the shard is missing"):
        pretrained.model_from_hf(str(directory))
    directory = _copy(tmp_path, "qwen2")
    _edit_config(directory, intermediate_size=40)
    with pytest.raises(weights.HFWeightsError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(48, 32\)"):
        pretrained.model_from_hf(str(directory))
    _edit_config(directory, intermediate_size=48, num_hidden_layers=3)
    with pytest.raises(weights.HFWeightsError, match="tensor 'model.layers.2.input_layernorm.weight' is missing"):
        pretrained.model_from_hf(str(directory))


@pytest.mark.hf
@pytest.mark.parametrize("name", NAMES)
def test_fixtures_are_what_transformers_computes(name):
    """Where torch and transformers are installed (never in the default environment): the fixture's logits are
    transformers' own forward of its checkpoint, and so are its greedy tokens (`make_fixtures.py` says how)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    directory = os.path.join(FIXTURES, name)
    reference = np.load(os.path.join(directory, "reference.npz"))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(reference["tokens"].astype(np.int64))).logits.numpy()
        seq = [int(t) for t in reference["greedy_prompt"]]
        for _ in range(32):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    np.testing.assert_allclose(logits, reference["logits"], rtol=0, atol=1e-5 * np.abs(logits).max())
    np.testing.assert_array_equal(np.array(seq[5:]), reference["greedy"])


@pytest.mark.parametrize("name", NAMES)
def test_export_of_an_imported_model_is_the_checkpoint(tmp_path, name):
    """import -> export: every tensor equal to the original file's, the config.json mapping to the same sections
    (Mixtral written as shards with an index, as it came)."""
    directory = os.path.join(FIXTURES, name)
    config, model = pretrained.model_from_hf(directory)
    files = export.save(config, model, str(tmp_path), max_shard_bytes=100_000 if name == "mixtral" else 2**30)
    assert (name == "mixtral") == any(f.endswith("index.json") for f in files)
    original, again = weights.read(directory), weights.read(str(tmp_path))
    assert sorted(original) == sorted(again)
    for key, value in original.items():
        np.testing.assert_array_equal(again[key], value, err_msg=key)
    read = lambda d: config_map.from_hf(json.loads((d / "config.json").read_text()), source=str(d))  # noqa: E731
    assert read(tmp_path) == read(pathlib.Path(directory))


def test_an_architecture_is_one_entry_read_by_import_and_export(monkeypatch):
    """An entry added to experiments.hf.arch.ARCHITECTURES (here Qwen3's under another name, preferred by export as
    the later of two a config fits) is what import reads and what export writes: no other table names it."""
    qwen3 = arch.get("Qwen3ForCausalLM")
    assert qwen3 is not None
    entry = dataclasses.replace(qwen3, name="TestQwen3ForCausalLM", model_type="test_qwen3")
    monkeypatch.setattr(arch, "ARCHITECTURES", (*arch.ARCHITECTURES, entry))
    directory = os.path.join(FIXTURES, "qwen3")
    with open(os.path.join(directory, "config.json")) as f:
        hf = json.load(f)
    sections = config_map.from_hf(hf, source="qwen3")
    assert config_map.from_hf({**hf, "architectures": [entry.name]}, source="renamed") == sections
    written = export.hf_config(pretrained.config_from_hf(directory))
    assert written["architectures"] == [entry.name] and written["model_type"] == "test_qwen3"
    assert config_map.from_hf(written, source="exported") == sections


@pytest.mark.parametrize(
    "section, changes, needle",
    [
        ("moe", {"every": 1, "router": "sigmoid"}, "'moe.router' = 'sigmoid': only a softmax router maps"),
        ("model", {"norm": "layernorm"}, "'model.norm' = 'layernorm': only RMSNorm maps"),
        ("moe", {"every": 2, "router": "softmax", "expert_mlp": "swiglu"}, "'moe.every' = 2: Mixtral has experts"),
    ],
)
def test_what_maps_to_no_architecture_is_refused_before_writing(tmp_path, section, changes, needle):
    config = schema.default_config()
    config[section].update(changes)
    with pytest.raises(export.HFExportError, match=re.escape(needle)):
        export.save(config, nnx.Module(), str(tmp_path / "out"))  # refused before the model is read
    assert not (tmp_path / "out").exists()


@pytest.mark.hf
@pytest.mark.parametrize("name", NAMES)
def test_transformers_loads_our_export(tmp_path, name):
    """Where transformers is installed: our export of each imported fixture loads as its architecture and computes
    the fixture's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config, model = pretrained.model_from_hf(os.path.join(FIXTURES, name))
    export.save(config, model, str(tmp_path))
    reference = np.load(os.path.join(FIXTURES, name, "reference.npz"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    with torch.no_grad():
        logits = loaded(torch.from_numpy(reference["tokens"].astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(logits, reference["logits"], rtol=0, atol=1e-5 * np.abs(logits).max())


def _corpus(tmp_path):
    """A small text corpus (two copies of a standard-library module's source) with half of it held out."""
    path = tmp_path / "corpus.txt"
    path.write_text(inspect.getsource(json.decoder) * 2)
    return str(path)


def _tiny_data(config, tmp_path):
    config.data.update(path=_corpus(tmp_path), seq_len=16, batch_size=8, val_fraction=0.5)
    return config


def test_an_imported_checkpoint_is_a_run_that_serves_through_the_paged_cache(tmp_path):
    """`import` writes a run at step 0 whose parameters are the checkpoint's; the run loads back and its greedy
    generation through the engine's bf16 paged cache equals transformers' own (its first 12 of the fixture's 32 tokens).
    The same workdir served by `python -m experiments.serve --http` answers a greedy /v1/completions with
    transformers' tokens too (the first 6: the run's byte tokenizer never samples the 7th, id 286 >= 259), with the
    checkpoint's max_position_embeddings as its max_model_len, and stops cleanly (exit 0) on SIGTERM. The fp8 / fp4
    formats on an imported (and exported, reloaded) model: experiments.reproduce.hf's table."""
    directory = os.path.join(FIXTURES, "qwen3")
    reference = np.load(os.path.join(directory, "reference.npz"))
    workdir = tmp_path / "run"
    config = _tiny_data(schema.default_config(), tmp_path)
    config.mesh.data = 1
    summary = pretrained.import_to(str(workdir), directory, config=config, eval_batches=0)  # runs evaluate: elsewhere
    assert summary["steps"] == 0
    assert summary["num_params"] == sum(x.size for x in weights.read(directory).values())  # the checkpoint's
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["checkpoint"]["init_from"] == "hf:" + directory and saved["model"]["head_dim"] == 64
    config, model = run_load.trained_model(str(workdir))
    expected = weights.to_ours(weights.read(directory), schema.model_config(config), _moe(config), source=directory)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        np.testing.assert_array_equal(np.asarray(var.get_value()), expected[".".join(map(str, path))])
    fmt = schema_kvcache.make_format(
        fields_lib.from_config(schema_kvcache.KVCacheConfig, {**config.kvcache, "format": "bf16"})
    )
    engine = Engine(model, fmt, EngineConfig(memory_bytes=2**18, eos_id=None, never=(), num_ids=None))
    request = engine.submit(reference["greedy_prompt"].tolist(), 12)
    engine.run()
    np.testing.assert_array_equal(request.output, reference["greedy"][:12])
    flags = ["--kv-format", "bf16", "--kv-memory-mib", "1", "--max-num-batched-tokens", "16"]
    command = [sys.executable, "-m", "experiments.serve", "--http", "--workdir", str(workdir), "--port", "0", *flags]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(FIXTURES) + "/../..")
    try:
        url, said = _listening_url(server)
        assert "max_model_len: 64 tokens (max_position_embeddings of" in said  # the checkpoint's, not a fixed 2048
        body = {
            "prompt": reference["greedy_prompt"].tolist(),
            "max_tokens": 6,
            "temperature": 0,
            "return_token_ids": True,
        }
        post = urllib.request.Request(
            url + "/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(post, timeout=60) as response:
            choice = json.loads(response.read())["choices"][0]
        assert choice["token_ids"] == reference["greedy"][:6].tolist() and choice["finish_reason"] == "length"
    finally:
        server.send_signal(signal.SIGTERM)
        status = server.wait(30)
        rest = server.stderr.read() if server.stderr else ""
    assert status == 0 and "stopped: every open request was answered" in rest, rest  # SIGTERM stops it cleanly


def _listening_url(server: subprocess.Popen, timeout: float = 120.0) -> tuple[str, str]:
    """(the base URL `experiments.serve --http` prints on stderr once it listens, the stderr up to it); fails if it
    exits or times out."""
    assert server.stderr is not None
    deadline, lines = time.monotonic() + timeout, []
    with selectors.DefaultSelector() as selector:
        selector.register(server.stderr, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if selector.select(timeout=1.0):
                line = server.stderr.readline()
                lines.append(line)
                if found := re.search(r"serving `[^`]*` on (http://\S+/v1)", line):
                    return found.group(1), "".join(lines)
                if not line:
                    break
    raise AssertionError(f"the server did not start: {''.join(lines)}")


def test_imported_parameters_are_created_in_their_shardings():
    """On a data x tensor mesh (4 x 2) each device receives only its slice of a head-sharded projection, and the
    values are the checkpoint's."""
    directory = os.path.join(FIXTURES, "qwen3")
    config = schema.default_config()
    config.checkpoint.init_from = "hf:" + directory
    config.mesh.update(data=4, model=2)
    load.resolve(config)
    schema.validate(config, num_devices=8)
    _, sharder = build.build_mesh(config)
    _, abstract, _ = split_params(nnx.eval_shape(lambda: build.build_model_fn(config, sharder)(nnx.Rngs(0))))
    params = load.initial_params(config, abstract, mesh_lib.param_shardings(abstract, sharder))
    q = dict(nnx.to_flat_state(params))[("blocks", 0, "attn", "q", "kernel")].get_value()
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert {s.data.shape for s in q.addressable_shards} == {(32, 128)}  # [d_model, heads x head_dim / 2]
    expected = weights.read(directory)["model.layers.0.self_attn.q_proj.weight"].T
    np.testing.assert_array_equal(np.asarray(q), expected)


def test_import_refuses_before_writing_anything(tmp_path, capsys):
    """A tensor that does not fit is refused from the safetensors headers, and a held-out split too short for the
    evaluation before anything is built, each with exit code 2 and no workdir created; a workdir that already holds
    a run is refused too."""
    directory = _copy(tmp_path, "qwen2")
    _edit_config(directory, intermediate_size=40)
    workdir = tmp_path / "w"
    argv = ["import", "--hf-dir", str(directory), "--workdir", str(workdir), "--eval-batches", "0"]
    assert hf_cli.main(argv) == 2
    assert "'model.layers.0.mlp.gate_proj.weight' has shape (48, 32), expected (40, 32)" in capsys.readouterr().err
    assert not workdir.exists()
    _edit_config(directory, intermediate_size=48)
    short = ["--data-path", _corpus(tmp_path), "--eval-batches", "8"]  # a held-out split too short for 8 batches
    assert hf_cli.main([*argv[:-2], *short]) == 2
    assert "train.eval_batches=8 needs 256 non-overlapping windows" in capsys.readouterr().err
    assert not workdir.exists()
    (workdir / "checkpoints" / "3").mkdir(parents=True)
    assert hf_cli.main(argv) == 2
    assert "already holds a run's checkpoints" in capsys.readouterr().err


def test_an_export_stopped_halfway_leaves_nothing_in_out_and_the_next_one_cleans_up(tmp_path, capsys, monkeypatch):
    """An export that dies writing its weights (here: save_file raises) leaves --out absent and its partial files
    beside it in `<out>.exporting`, not in --out; the next export (into the same --out) removes them and writes
    the whole checkpoint."""
    import safetensors.numpy

    workdir, out = tmp_path / "w", tmp_path / "out"
    hf_args = ["import", "--hf-dir", os.path.join(FIXTURES, "qwen2"), "--workdir", str(workdir)]
    assert hf_cli.main([*hf_args, "--eval-batches", "0"]) == 0
    real = safetensors.numpy.save_file

    def dies(tensors, filename, metadata=None):
        real(tensors, filename, metadata)
        raise KeyboardInterrupt  # (as a kill would: after the bytes are on disk)

    monkeypatch.setattr(safetensors.numpy, "save_file", dies)
    with pytest.raises(KeyboardInterrupt):
        hf_cli.main(["export", f"--workdir={workdir}", f"--out={out}"])
    assert not out.exists() and (tmp_path / "out.exporting" / "model.safetensors").exists()
    monkeypatch.undo()
    assert hf_cli.main(["export", f"--workdir={workdir}", f"--out={out}"]) == 0, capsys.readouterr().err
    assert not (tmp_path / "out.exporting").exists()
    assert sorted(os.listdir(out)) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    )


def test_a_rerun_of_a_killed_import_starts_it_over_and_finishes(tmp_path, capsys):
    """What an import killed during its checkpoint write (orbax's temporary folder) or before summary.json (a whole
    step-0 checkpoint) leaves: the same import run again says it starts over, finishes (exit 0, summary.json) and
    the workdir serves; a fine-tune's checkpoints (step > 0) are still refused."""
    directory = os.path.join(FIXTURES, "qwen2")
    workdir = tmp_path / "w"
    argv = ["import", "--hf-dir", directory, "--workdir", str(workdir), "--eval-batches", "0"]
    assert hf_cli.main(argv) == 0
    (workdir / "summary.json").unlink()  # killed before summary.json
    (workdir / "checkpoints" / "0.orbax-checkpoint-tmp-7").mkdir()  # and a temporary folder of a killed write
    assert hf_cli.main(argv) == 0
    assert "holds an import that was stopped before it finished (no summary.json): starting it over" in (
        capsys.readouterr().out
    )
    assert sorted(os.listdir(workdir / "checkpoints")) == ["0"] and (workdir / "summary.json").exists()
    run_load.trained_model(str(workdir))
    (workdir / "summary.json").unlink()
    (workdir / "checkpoints" / "20").mkdir()
    assert hf_cli.main(argv) == 2
    assert "already holds a run's checkpoints" in capsys.readouterr().err


@pytest.mark.parametrize("keep", ["half", "100 bytes"])
def test_a_truncated_safetensors_file_is_one_error_line_naming_it(tmp_path, capsys, keep):
    """model.safetensors cut in its data or to 100 bytes (inside the header): `experiments.hf import` and a
    fine-tuning run from it each stop with one `error:` line naming the file and exit code 2, creating no workdir."""
    directory = _copy(tmp_path, "qwen2")
    path = directory / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2 if keep == "half" else 100)
    workdir = tmp_path / "w"
    argv = ["import", "--hf-dir", str(directory), "--workdir", str(workdir), "--eval-batches", "0"]
    finetune_argv = [
        "run",
        f"--config=experiments/configs/finetune.py:{directory}",
        f"--workdir={workdir}",
        f"--config.data.path={_corpus(tmp_path)}",
    ]
    for code in (lambda: hf_cli.main(argv), lambda: run_lib.main(finetune_argv)):
        assert code() == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and str(path) in err[0], err
        assert not workdir.exists()


def test_export_refuses_a_folder_that_holds_a_model_and_replace_leaves_no_stale_shard(tmp_path, capsys):
    """An export written in 3 shards, then again into the same folder: refused, naming the folder and what is there
    (no file touched); with --replace, one model.safetensors and no stale shard or index remain (a file of the
    user's stays), and the importer reads the new model."""
    config, model = pretrained.model_from_hf(os.path.join(FIXTURES, "qwen2"))
    out = tmp_path / "out"
    tensor_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    first = export.save(config, model, str(out), max_shard_bytes=tensor_bytes // 3 + 1)
    assert sum(f.endswith(".safetensors") for f in first) >= 3
    (out / "NOTES.txt").write_text("mine")
    before = sorted(os.listdir(out))
    with pytest.raises(export.HFExportError, match=f"--out {out} is not empty .*model-00001-of"):
        export.save(config, model, str(out))
    assert sorted(os.listdir(out)) == before
    export.save(config, model, str(out), replace=True)
    assert sorted(f for f in os.listdir(out) if "safetensors" in f) == ["model.safetensors"]
    assert (out / "NOTES.txt").read_text() == "mine"
    _, again = pretrained.model_from_hf(str(out))
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(again, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_carries_what_it_imported(tmp_path):
    """A bfloat16 checkpoint with a chat template, a generation_config.json and max_position_embeddings 64,
    imported and exported: the export holds the same template, generation config and max_position_embeddings, its
    tensors are bfloat16 as imported (float32 when asked), its files are readable by others as transformers'
    are (0644 under umask 022), and re-imported it is the model. With the source's config.json turned into a
    directory, the export is refused naming it (it would silently lose the dtype and max_position_embeddings)."""
    from safetensors.numpy import save_file

    directory = _copy(tmp_path, "qwen2")
    tensors = weights.read(str(directory))
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, str(directory / "model.safetensors"))
    _edit_config(directory, dtype="bfloat16")
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (directory / "chat_template.jinja").write_text(template)
    config, model = pretrained.model_from_hf(str(directory))
    out = tmp_path / "out"
    previous = os.umask(0o022)
    try:
        files = export.save(config, model, str(out))
    finally:
        os.umask(previous)
    assert (out / "chat_template.jinja").read_text() == template
    assert (out / "generation_config.json").read_text() == (directory / "generation_config.json").read_text()
    written = json.loads((out / "config.json").read_text())
    assert written["max_position_embeddings"] == 64 and written["dtype"] == "bfloat16"
    assert {x.dtype for x in weights.read(str(out)).values()} == {np.dtype(ml_dtypes.bfloat16)}
    assert {oct(os.stat(f).st_mode & 0o777) for f in files} == {"0o644"}
    _, again = pretrained.model_from_hf(str(out))
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(again, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bf16 values survive a bf16 round trip
    export.save(config, model, str(out), replace=True, dtype="float32")
    assert {x.dtype for x in weights.read(str(out)).values()} == {np.dtype(np.float32)}
    (directory / "config.json").unlink()  # the source's config.json a directory: refused, not exported as float32
    (directory / "config.json").mkdir()
    before = sorted(os.listdir(out))
    with pytest.raises(
        export.HFExportError, match=f"{directory}/config.json, the config of the checkpoint .* is a dir"
    ):
        export.save(config, model, str(out), replace=True)
    assert sorted(os.listdir(out)) == before


def test_a_folder_that_is_no_checkpoint_is_named_as_what_it_is(tmp_path, capsys):
    """`experiments.hf import --hf-dir` names a missing folder, an empty one, one without config.json (naming what
    it holds), one whose config.json is a directory and a PyTorch-only one (saying how to convert) by the flag, in
    one line (no traceback); a fine-tuning config names the config key
    with the same reason; `serve --workdir` on a checkpoint folder points to `experiments.hf import`."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "config.json").write_text("{}")
    (tmp_path / "torch" / "pytorch_model.bin").write_bytes(b"x")
    shutil.copytree(os.path.join(FIXTURES, "qwen2"), tmp_path / "folder_config")
    (tmp_path / "folder_config" / "config.json").unlink()
    (tmp_path / "folder_config" / "config.json").mkdir()
    cases = {
        "missing": "does not exist",
        "empty": "is empty",
        "other": "holds no config.json (it holds notes.txt)",
        "torch": "holds PyTorch weights (pytorch_model.bin) but no safetensors",
        "folder_config": "its config.json is a directory, not a JSON file",
    }
    for name, reason in cases.items():
        directory = tmp_path / name
        argv = ["import", "--hf-dir", str(directory), "--workdir", str(tmp_path / "w"), "--eval-batches", "0"]
        assert hf_cli.main(argv) == 2
        err = capsys.readouterr().err
        assert f"--hf-dir={directory}: " in err and reason in err and len(err.strip().splitlines()) == 1, err
        with pytest.raises(ConfigError, match=f"'checkpoint.init_from' = 'hf:{directory}': .*{re.escape(reason)}"):
            schema.hf_dir(finetune.get_config(str(directory)))
    assert serve.main([f"--workdir={os.path.join(FIXTURES, 'qwen2')}", "--prompt=x"]) == 2
    assert "a Hugging Face checkpoint, not a run" in capsys.readouterr().err


def test_import_without_evaluation_tokenizes_nothing_and_records_the_corpus(tmp_path, capsys, monkeypatch):
    """`import --eval-batches 0` never loads (tokenizes) the corpus, yet its data.json holds the fingerprint the
    loaded corpus has; `--eval-batch-size` sets the held-out batches' size (what the held-out split must hold)."""
    directory, corpus = _copy(tmp_path, "qwen2"), _corpus(tmp_path)
    real = build.corpus_lib.load_corpus

    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was tokenized")

    monkeypatch.setattr(build.corpus_lib, "load_corpus", refuse)
    argv = ["import", "--hf-dir", str(directory), "--data-path", corpus, "--eval-batches", "0"]
    assert hf_cli.main([*argv, "--workdir", str(tmp_path / "a")]) == 0, capsys.readouterr().err
    recorded = json.loads((tmp_path / "a" / "data.json").read_text())
    assert recorded["fingerprint"] == real(corpus).fingerprint and recorded["source"] == corpus
    monkeypatch.setattr(build.corpus_lib, "load_corpus", real)
    smaller = [*argv[:-1], "2", "--eval-batch-size", "8", "--workdir", str(tmp_path / "b")]
    assert hf_cli.main(smaller) == 2  # this corpus's 2% held out is too short even for these
    assert "train.eval_batches=2 needs 16 non-overlapping windows" in capsys.readouterr().err


def _moe(config):
    return fields_lib.from_config(MoEConfig, config.moe)


def test_fine_tuning_starts_from_the_checkpoint(tmp_path, capsys):
    """`checkpoint.init_from = "hf:DIR"` (experiments/configs/finetune.py), here with MGUP-AdamW: the first step's
    training loss is the imported model's loss on that step's batch (computed here from
    `pretrained.model_from_hf`), and the held-out rows are one at step 0 (the imported model's loss on the
    held-out batch) and one at the end, although the run is shorter than train.eval_every (printed as `step 1/1:
    held-out ...`); a config that sets an architecture key to another value is refused by name."""
    directory = os.path.join(FIXTURES, "llama")
    config = _tiny_data(finetune.get_config(directory), tmp_path)
    config.optim.update(name="mgup_adamw", warmup_steps=0)
    config.train.update(steps=1, log_every=1, eval_batches=1, progress=False)
    config.mesh.data = 1  # one device (the import test places parameters over 8)
    assert run_lib.run(config, str(tmp_path / "ft")) == 0
    printed = capsys.readouterr().out
    assert "step 0 (the starting weights): held-out" in printed and "step 1/1: held-out" in printed, printed
    [row] = [
        r for r in map(json.loads, (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()) if "train_loss" in r
    ]
    _, model = pretrained.model_from_hf(directory, config=config)  # resolved by the run: llama's architecture
    _, batches = build.build_data(config)
    key = jax.random.fold_in(jax.random.PRNGKey(config.train.seed), 0)  # the train step's key of step 0
    loss, _ = train_lib.lm_loss(model, jnp.asarray(batches.train_batch(0)), key=key)
    assert abs(row["train_loss"] - float(loss)) <= 1e-4 * float(loss), (row["train_loss"], float(loss))
    held = [r for r in map(json.loads, (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert [r["step"] for r in held] == [0, 1] and config.train.eval_every > 1
    _, at_start = train_lib.lm_loss(model, jnp.asarray(batches.val_batches(1)[0]))
    assert abs(held[0]["val_loss"] - float(at_start["loss"])) <= 1e-4 * held[0]["val_loss"]
    bad = _tiny_data(finetune.get_config(directory), tmp_path)
    bad.model.d_model = 64
    with pytest.raises(fields_lib.ConfigError, match=r"'model.d_model' = 64 conflicts with the checkpoint .* has 32"):
        load.resolve(bad)


def test_a_federation_starts_each_site_from_its_resident_experts_and_a_site_exports_as_its_own_model(tmp_path):
    """A pretrained MoE over 2 sites with overlap 1: site s holds the checkpoint's experts that the placement puts
    there, its router's columns of those experts (partitioned routing), and every other parameter whole. Site 1's
    model exports as a Qwen3-MoE of its 2 experts (not all 4) that computes its logits; under skip-token routing (a
    site routes to experts it does not hold) export refuses by name."""
    directory = os.path.join(FIXTURES, "qwen3_moe")
    config = _tiny_data(finetune.get_config(directory), tmp_path)
    config.mesh.update(site=2, data=1)
    config.fomoe.update(overlap=1, local_steps=1)
    load.resolve(config)
    schema.validate(config, num_devices=8)
    graphdef, _, _, state = federated.initial_state(config, pretrained=True)
    expected = weights.to_ours(weights.read(directory), schema.model_config(config), _moe(config), source=directory)
    placement = placement_lib.fixed_placement(config.moe.num_experts, 2, 1)
    for path, var in nnx.to_flat_state(state.train.params):
        key, value = ".".join(map(str, path)), np.asarray(var.get_value())
        for site in range(2):
            if key.endswith(("ffn.gate", "ffn.up", "ffn.down")):
                np.testing.assert_array_equal(value[site], expected[key][placement.experts[site]], err_msg=key)
            elif key.endswith("ffn.router"):
                np.testing.assert_array_equal(value[site], expected[key][:, placement.experts[site]], err_msg=key)
            else:
                np.testing.assert_array_equal(value[site], expected[key], err_msg=key)
    site_model = nnx.merge(graphdef, *jax.tree.map(lambda x: x[1], (state.train.params, state.train.rest)))
    export.save(federated.site_config(config), site_model, str(tmp_path / "site1"))
    exported, again = pretrained.model_from_hf(str(tmp_path / "site1"))
    assert exported.moe.num_experts == 2
    tokens = jnp.asarray(np.load(os.path.join(directory, "reference.npz"))["tokens"])
    np.testing.assert_allclose(again(tokens)[0], site_model(tokens)[0], rtol=0, atol=1e-5)
    config.fomoe.routing = "skip_token"
    with pytest.raises(export.HFExportError, match="'fomoe.routing' = 'skip_token'"):
        export.save(federated.site_config(config), site_model, str(tmp_path / "skip"))
    assert not (tmp_path / "skip").exists()


def test_a_checkpoint_without_tokenizer_json_keeps_the_byte_tokenizer_only_if_its_vocabulary_can_be_it(
    tmp_path, capsys
):
    """No tokenizer.json: a 500-id vocabulary (more than 259 padded to 384), another tokenizer's file
    (tokenizer.model) and special ids other than the byte tokenizer's are each refused by `import` (exit 2, no
    workdir) naming the reason and the way out; `--tokenizer PATH` imports the 500-id model with that tokenizer;
    the 300-id fixtures without special ids import with the byte tokenizer (the other tests)."""
    from safetensors.numpy import load_file, save_file

    directory = _copy(tmp_path, "qwen2")  # tied embeddings: one [vocab, d] tensor
    tensors = load_file(str(directory / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = np.concatenate([embed, embed[:200]])
    save_file(tensors, str(directory / "model.safetensors"))
    _edit_config(directory, vocab_size=500)
    workdir = tmp_path / "w"
    argv = ["import", "--hf-dir", str(directory), "--workdir", str(workdir), "--eval-batches", "0"]
    assert hf_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer.json and 500 ids in its vocabulary" in err and "--tokenizer PATH" in err, err
    assert not workdir.exists()
    tokenizer = os.path.join(FIXTURES, "tokenizer")
    assert hf_cli.main([*argv, "--tokenizer", tokenizer]) == 0, capsys.readouterr().err
    assert json.loads((workdir / "config.json").read_text())["data"]["tokenizer"] == tokenizer
    for name, edit, words in [
        (
            "spm",
            lambda d: (d / "tokenizer.model").write_bytes(b"\x0a\x01"),
            "has no tokenizer.json but tokenizer.model",
        ),
        ("ids", lambda d: _edit_config(d, eos_token_id=2), "eos_token_id = 2 (the byte tokenizer's: 258)"),
    ]:
        other = shutil.copytree(os.path.join(FIXTURES, "qwen2"), tmp_path / name)
        edit(other)
        assert hf_cli.main(["import", "--hf-dir", str(other), "--workdir", str(tmp_path / f"w{name}")]) == 2
        assert words in capsys.readouterr().err
        assert not (tmp_path / f"w{name}").exists()


@pytest.mark.parametrize("bad", ["nan", "inf in bfloat16", "fifo"])
def test_non_finite_weights_and_a_fifo_are_refused_by_import_naming_them(tmp_path, capsys, bad):
    """A NaN in one float32 tensor, an Inf in a bfloat16 checkpoint, and a FIFO in place of model.safetensors (which
    would block the reader forever): `import` exits 2 with one error line naming the file (and the tensor), and
    writes no workdir."""
    from safetensors.numpy import load_file, save_file

    directory = _copy(tmp_path, "qwen2")
    path = directory / "model.safetensors"
    name = "model.layers.0.mlp.up_proj.weight"
    if bad == "fifo":
        path.unlink()
        os.mkfifo(path)
        words = [f"{path}: not a regular file"]
    else:
        tensors = load_file(str(path))
        if bad == "nan":
            tensors[name][3, 1] = np.nan
        else:
            tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
            tensors[name][0, 0] = np.inf
        save_file(tensors, str(path))
        words = [str(path), f"tensor {name!r} holds 1 non-finite values"]
    workdir = tmp_path / "w"
    assert hf_cli.main(["import", "--hf-dir", str(directory), "--workdir", str(workdir), "--eval-batches", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    assert not workdir.exists()


def test_a_mistral_checkpoint_with_a_sliding_window_is_refused_by_name(tmp_path):
    """MistralForCausalLM imports without a window (the fixture); with `sliding_window` set, the field is named."""
    directory = _copy(tmp_path, "mistral")
    _edit_config(directory, sliding_window=16)
    with pytest.raises(config_map.HFConfigError, match="sliding_window = 16: no sliding window"):
        pretrained.model_from_hf(str(directory))


def _imported(tmp_path, capsys):
    """A workdir imported from the Qwen2 fixture (no evaluation): a run that exports."""
    workdir = tmp_path / "w"
    args = ["import", "--hf-dir", os.path.join(FIXTURES, "qwen2"), "--workdir", str(workdir), "--eval-batches", "0"]
    assert hf_cli.main(args) == 0, capsys.readouterr().err
    capsys.readouterr()
    return workdir


EXPORTED = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_an_export_killed_at_any_instant_leaves_the_old_state_or_the_whole_export_and_a_rerun_succeeds(
    tmp_path, capsys, monkeypatch
):
    """A kill (here: an interruption raised inside os.replace) just before, or just after, the rename that makes
    `<out>.exporting` the export: --out is absent or complete, nothing else is left, and the same command rerun
    exits 0 with the whole export (finding the same bytes there: nothing written). With --replace into a folder
    holding a model and a file of the user's, a kill after the first file moved in is finished by the rerun: the new
    model, no stale file, the user's file kept, no `<out>.exported` left."""
    workdir, out = _imported(tmp_path, capsys), tmp_path / "out"
    argv = ["export", f"--workdir={workdir}", f"--out={out}"]
    real = os.replace

    def killed(after: bool, target):
        def replace(src, dst):
            hit = os.path.abspath(dst) == os.path.abspath(target) or os.path.dirname(os.path.abspath(dst)) == str(out)
            if hit and after:
                real(src, dst)
            if hit:
                raise KeyboardInterrupt  # (as a kill would, at this instant)
            real(src, dst)

        return replace

    for after in (False, True):
        shutil.rmtree(out, ignore_errors=True)
        monkeypatch.setattr(os, "replace", killed(after, out))
        with pytest.raises(KeyboardInterrupt):
            hf_cli.main(argv)
        monkeypatch.setattr(os, "replace", real)
        left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out"))
        assert left == (["out"] if after else ["out.exporting"]), left
        if after:
            assert sorted(os.listdir(out)) == EXPORTED
        assert hf_cli.main(argv) == 0, capsys.readouterr().err
        said = capsys.readouterr().out
        assert ("already holds this export" in said) == after, said
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == ["out"]
        assert sorted(os.listdir(out)) == EXPORTED
    first = (out / "model.safetensors").read_bytes()

    (out / "NOTES.txt").write_text("mine")
    (out / "model-00002-of-00002.safetensors").write_bytes(b"stale")
    monkeypatch.setattr(os, "replace", killed(True, out / "model.safetensors"))
    with pytest.raises(KeyboardInterrupt):
        hf_cli.main([*argv, "--replace", "--dtype=bfloat16"])
    monkeypatch.setattr(os, "replace", real)
    assert (tmp_path / "out.exported").is_dir()
    assert hf_cli.main([*argv, "--replace", "--dtype=bfloat16"]) == 0, capsys.readouterr().err
    assert sorted(os.listdir(out)) == sorted([*EXPORTED, "NOTES.txt"])
    assert (out / "NOTES.txt").read_text() == "mine" and (out / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == ["out"]


def test_an_export_to_a_read_only_folder_or_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """--out on a read-only file system (its folder cannot be created: OSError EROFS, as root meets it whatever the
    mode bits) exits 2; a disk found too small before writing, and one that fills while the safetensors are written
    (safetensors' SafetensorError, os error 28), exit 1. Each says so in one `error:` line naming --out (no
    traceback), and leaves neither --out nor `<out>.exporting`."""
    import errno

    import safetensors
    import safetensors.numpy

    workdir, out = _imported(tmp_path, capsys), tmp_path / "out"
    argv = ["export", f"--workdir={workdir}", f"--out={out}"]

    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):  # a folder in --out's parent: a read-only file system
        if os.path.dirname(os.path.abspath(path)) == str(tmp_path):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_mkdir(path, *args, **kwargs)

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    Usage = collections.namedtuple("Usage", "total used free")
    cases = [
        (os, "mkdir", read_only, 2, ["cannot be written", "Read-only file system"]),
        (shutil, "disk_usage", lambda path: Usage(2**20, 2**20 - 4096, 4096), 1, ["needs about", "No space left"]),
        (safetensors.numpy, "save_file", full, 1, ["could not be written", "No space left on device", "removed"]),
    ]
    for module, name, fake, code, words in cases:
        with monkeypatch.context() as patch:
            patch.setattr(module, name, fake)
            assert hf_cli.main(argv) == code, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and str(out) in err[0], err
        assert all(w in err[0] for w in words), (words, err)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == [], name


def test_an_export_of_a_run_trained_here_frames_prompts_as_the_run_and_our_server_do(tmp_path):
    """A run trained here with a BPE saved before tokenizers carried a framing rule (tokenizer_legacy/: no
    post-processor) frames its prompts with BOS, as its corpus did; its export writes that rule into the exported
    tokenizer, so the export (read by transformers through its post-processor) gives the prompt ids the run does."""
    from core.hf_tokenizer import HFTokenizer
    from experiments.hf import generation

    config, model = pretrained.model_from_hf(os.path.join(FIXTURES, "qwen2"))
    with config.unlocked():
        config.checkpoint.init_from = ""  # trained here
        config.data.tokenizer = os.path.join(FIXTURES, "tokenizer_legacy")
    legacy = HFTokenizer.from_file(config.data.tokenizer)
    assert legacy.framing == ((), ()) and legacy.bos_id is not None
    export.save(config, model, str(tmp_path / "out"))
    exported = HFTokenizer.from_file(tmp_path / "out")
    text = "def f(x):\n    return x  # <|eos|>"
    ours = generation.run_tokenizer(config).encode_prompt(text).tolist()
    assert ours[0] == legacy.bos_id and ours[1:] == legacy.encode_prompt(text).tolist()
    assert exported.encode_prompt(text).tolist() == ours
