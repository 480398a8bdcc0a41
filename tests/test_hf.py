"""Hugging Face checkpoints against transformers' own forward, through fixtures (tests/fixtures/hf, made by its
committed script with transformers; these tests never import torch): for tiny random Llama (head_dim != d_model /
heads, Llama 3.1 RoPE scaling, untied), Qwen2 (q/k/v biases, tied), Qwen3 (q/k norm), Mixtral (sharded safetensors,
softmax top-2 SwiGLU experts) and Qwen3-MoE (a dense first layer) checkpoints, imported logits on a ragged batch,
every MoE layer's top-k experts, and 32 greedy tokens; and clear refusals of what the importer cannot honour."""

import json
import os
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core import generate as generate_lib
from experiments import build
from experiments.hf import config_map, export, load, weights

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
NAMES = ["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("name", NAMES)
def test_imported_model_equals_transformers(name):
    directory = os.path.join(FIXTURES, name)
    reference = np.load(os.path.join(directory, "reference.npz"))
    config, model = load.model_from_hf(directory)
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
    ],
)
def test_unsupported_config_fields_are_refused_by_name(tmp_path, changes, needle):
    directory = _copy(tmp_path)
    _edit_config(directory, **changes)
    with pytest.raises(config_map.HFConfigError, match="config.json: ") as e:
        load.model_from_hf(str(directory))
    assert needle in str(e.value), str(e.value)


def test_missing_shard_missing_tensor_and_wrong_shape_are_refused_by_name(tmp_path):
    directory = _copy(tmp_path, "mixtral")
    (directory / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(weights.HFWeightsError, match="model-00002-of-00003.safetensors: the shard is missing"):
        load.model_from_hf(str(directory))
    directory = _copy(tmp_path, "qwen2")
    _edit_config(directory, intermediate_size=40)
    with pytest.raises(weights.HFWeightsError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(48, 32\)"):
        load.model_from_hf(str(directory))
    _edit_config(directory, intermediate_size=48, num_hidden_layers=3)
    with pytest.raises(weights.HFWeightsError, match="tensor 'model.layers.2.input_layernorm.weight' is missing"):
        load.model_from_hf(str(directory))


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
    config, model = load.model_from_hf(directory)
    files = export.save(config, model, str(tmp_path), max_shard_bytes=100_000 if name == "mixtral" else 2**30)
    assert (name == "mixtral") == any(f.endswith("index.json") for f in files)
    original, again = weights.read(directory), weights.read(str(tmp_path))
    assert sorted(original) == sorted(again)
    for key, value in original.items():
        np.testing.assert_array_equal(again[key], value, err_msg=key)
    read = lambda d: config_map.from_hf(json.loads((d / "config.json").read_text()), source=str(d))  # noqa: E731
    assert read(tmp_path) == read(pathlib.Path(directory))


@pytest.mark.parametrize(
    "section, changes, needle",
    [
        ("moe", {"every": 1, "router": "sigmoid"}, "'moe.router' = 'sigmoid': only a softmax router maps"),
        ("model", {"norm": "layernorm"}, "'model.norm' = 'layernorm': only RMSNorm maps"),
        ("moe", {"every": 2, "router": "softmax", "expert_mlp": "swiglu"}, "'moe.every' = 2: Mixtral has experts"),
    ],
)
def test_what_maps_to_no_architecture_is_refused_before_writing(tmp_path, section, changes, needle):
    config = build.default_config()
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
    config, model = load.model_from_hf(os.path.join(FIXTURES, name))
    export.save(config, model, str(tmp_path))
    reference = np.load(os.path.join(FIXTURES, name, "reference.npz"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    with torch.no_grad():
        logits = loaded(torch.from_numpy(reference["tokens"].astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(logits, reference["logits"], rtol=0, atol=1e-5 * np.abs(logits).max())
