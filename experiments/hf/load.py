"""`checkpoint.init_from = "hf:DIR"`: what a Hugging Face checkpoint directory implies for our config, and its
parameters (in their shardings).

    load.resolve(config)                        # what the config's keys imply: DIR's model and moe sections (and
                                                # tokenizer), in place (`apply_to`); a tokenizer path made absolute
    state = core.train.init_state(..., init_params=load.init_params(config))   # step 0 from DIR's tensors
    params = load.initial_params(config, abstract, shardings)   # DIR's tensors as our parameters
    model = load.pretrained_model(config, model_fn)             # model_fn(rngs)'s module holding DIR's weights

The `model` and `moe` sections are those the checkpoint's config.json maps to (`config_map.from_hf`); parameters are
built abstractly (no random initialisation is ever computed) and receive the checkpoint's tensors
(`weights.to_ours`), cast to `model.param_dtype`, each placed directly in its sharding (a device receives only its
slice). Errors name the file, the field or the tensor, and nothing is written anywhere. This module reads only the
`model` and `moe` sections' declarations (core.config.TransformerConfig, moe.config.MoEConfig) and
checkpoint.init_from's form (experiments.schema.hf_dir, which `validate` checks); the commands call `resolve`
between validations, training takes `init_params`, experiments.federated and experiments.pretrained compose the
whole model.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from core import config as config_lib
from core import fields as fields_lib
from core import tokenizer as tokenizer_lib
from core.byte_tokenizer import TokenizerError
from core.model import Transformer, split_params
from experiments.hf import config_map, weights
from experiments.schema import HF_PREFIX, hf_dir
from moe.config import MoEConfig

__all__ = ["apply_to", "init_params", "initial_params", "json_object", "pretrained_model", "resolve"]

# Training knobs config.json carries (router_aux_loss_coef): the checkpoint's value unless the config sets its own.
_KNOBS = frozenset({"moe.load_balance_weight", "moe.z_loss_weight"})


def source_config(config: ml_collections.ConfigDict) -> tuple[str | None, dict[str, Any]]:
    """(DIR, its config.json as a dict) of the checkpoint a run was imported from (`checkpoint.init_from =
    "hf:DIR"`) while DIR still exists; (None, {}) for a run of ours or one whose DIR is gone. A config.json that is
    no JSON object reads as {} (the import, which read it, refused such a file)."""
    init_from = str(config.checkpoint.get("init_from", "") or "")
    directory = init_from.removeprefix(HF_PREFIX) if init_from.startswith(HF_PREFIX) else ""
    if not directory or not os.path.isdir(directory):
        return None, {}
    return directory, json_object(os.path.join(directory, "config.json"))


def json_object(path: str) -> dict[str, Any]:
    """The JSON object in the file at `path`; {} if there is none, it cannot be read or is no JSON object (the
    checkpoint files import or export read besides what they check)."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def context_length(config: ml_collections.ConfigDict) -> tuple[int, str]:
    """(tokens, where the number comes from): the longest sequence the run's model was made for, the imported
    checkpoint's `max_position_embeddings` (while its directory exists), else the run's training length
    `data.seq_len`."""
    directory, hf = source_config(config)
    length = hf.get("max_position_embeddings")
    if isinstance(length, int) and not isinstance(length, bool) and length > 0:
        return length, f"max_position_embeddings of {os.path.join(str(directory), 'config.json')}"
    return int(config.data.seq_len), "the run's data.seq_len"


def _model(config: ml_collections.ConfigDict) -> config_lib.TransformerConfig:
    return fields_lib.from_config(config_lib.TransformerConfig, config.model)


def _sections(directory: str) -> dict[str, dict[str, Any]]:
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise config_map.HFConfigError(f"{path} does not exist: a Hugging Face checkpoint directory holds config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise config_map.HFConfigError(f"{path} is not JSON: {e}") from None
    except OSError as e:  # a directory in its place, unreadable
        raise config_map.HFConfigError(f"{path} cannot be read ({e.strerror or e}): it must be the JSON file") from None
    return config_map.from_hf(hf, source=path)


def resolve(config: ml_collections.ConfigDict) -> None:
    """Fills in, in place, what other keys imply, between a first `experiments.schema.validate` and the one with
    devices: `checkpoint.init_from = "hf:DIR"` sets the architecture (model, moe) and tokenizer from the Hugging Face
    checkpoint in DIR (`apply_to`), and a tokenizer path becomes absolute, so that the run's config.json (which
    serve, export and sampling read back) means the same file from any directory. Raises ConfigError naming a
    conflicting key, HFConfigError or HFWeightsError for a checkpoint that does not fit."""
    if config.data.tokenizer != "bytes":
        config.data.tokenizer = os.path.abspath(config.data.tokenizer)
    apply_to(config)


def init_params(config: ml_collections.ConfigDict) -> Callable[..., nnx.State] | None:
    """Where step 0's parameters come from (`core.train.init_state`'s `init_params`): None for a random start, or
    `(abstract params, their shardings or None) -> checkpoint.init_from's parameters` (`initial_params`), each in
    its sharding (None: on the default device)."""
    if not config.checkpoint.init_from:
        return None
    return functools.partial(initial_params, config)


def apply_to(config: ml_collections.ConfigDict) -> None:
    """Sets, in place, what `checkpoint.init_from = "hf:DIR"` implies: the `model` and `moe` keys DIR's config.json maps
    to (the architecture is the checkpoint's), and `data.tokenizer` = DIR when DIR holds a tokenizer.json and the
    config keeps the byte tokenizer; without tokenizer.json the byte tokenizer is kept only for a checkpoint
    whose vocabulary can be its (`_check_byte_vocabulary`), unless the config names a tokenizer. Then the
    checkpoint's tensor names, shapes and dtypes are checked from the safetensors headers (no tensor is read).
    Nothing happens for a random start.

    Raises ConfigError for a key the config sets to a value other than its default and the checkpoint's (so a
    config file written for another model fails instead of being silently overridden) or a checkpoint without
    tokenizer.json that was not trained on bytes while the config names no tokenizer, HFConfigError for a
    config.json field we cannot honour, HFWeightsError for a tensor that does not fit."""
    directory = hf_dir(config)
    if directory is None:
        return
    directory = os.path.abspath(directory)
    config.checkpoint.init_from = HF_PREFIX + directory  # the same checkpoint from any working directory
    spec = {  # the defaults of the two sections a checkpoint's config.json maps to
        "model": fields_lib.section_fields(config_lib.TransformerConfig),
        "moe": fields_lib.section_fields(MoEConfig),
    }
    for section, values in _sections(directory).items():
        for key, value in values.items():
            current, default = config[section][key], spec[section][key].default
            if isinstance(current, list):  # a tuple that went through JSON
                current = tuple(current)
            if current != value and current != default and f"{section}.{key}" not in _KNOBS:
                raise fields_lib.ConfigError(
                    f"config key '{section}.{key}' = {current!r} conflicts with the checkpoint of "
                    f"checkpoint.init_from = {config.checkpoint.init_from!r}, which has {value!r}: the architecture "
                    "comes from the checkpoint; leave the key at its default or set it to the checkpoint's value"
                )
            if current == default:
                config[section][key] = value
    moe = fields_lib.from_config(MoEConfig, config.moe)
    weights.check(weights.headers(directory), _model(config), moe, source=directory)
    tokenizer = os.path.join(directory, "tokenizer.json")
    if config.data.tokenizer == "bytes" and os.path.isfile(tokenizer):
        config.data.tokenizer = directory
    elif config.data.tokenizer == "bytes":
        _check_byte_vocabulary(directory, config.model.vocab_size)
    try:
        tok = tokenizer_lib.load(config.data.tokenizer)
    except TokenizerError as e:
        raise fields_lib.ConfigError(str(e)) from None
    if tok.vocab_size > config.model.vocab_size:
        raise fields_lib.ConfigError(
            f"config key 'data.tokenizer' = {config.data.tokenizer!r} has {tok.vocab_size:,} ids, more than the "
            f"{config.model.vocab_size:,} of the checkpoint in {directory} (config.json vocab_size): it is not "
            "this model's tokenizer"
        )


BYTE_VOCAB_LIMIT = 384
"""The largest vocabulary taken for the byte tokenizer's 259 ids when a checkpoint has no tokenizer.json: 259 padded
to a multiple of 128, the coarsest padding in use."""

_OTHER_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "spiece.model", "vocab.txt")


def _check_byte_vocabulary(directory: str, vocab_size: int) -> None:
    """Raises ConfigError unless a checkpoint without tokenizer.json can be the byte tokenizer's (core.tokenizer:
    PAD 256, BOS 257, EOS 258): no other tokenizer's files, at most BYTE_VOCAB_LIMIT ids, and config.json's special
    ids, where given, the byte tokenizer's."""
    fix = "set data.tokenizer to its tokenizer.json (experiments.hf import: --tokenizer PATH)"
    found = [name for name in _OTHER_TOKENIZER_FILES if os.path.exists(os.path.join(directory, name))]
    if found:
        raise fields_lib.ConfigError(
            f"{directory} has no tokenizer.json but {', '.join(found)}: its tokenizer is not the byte tokenizer, and "
            "this project reads tokenizer.json only; write one with transformers "
            "(AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)), or " + fix
        )
    if vocab_size > BYTE_VOCAB_LIMIT:
        raise fields_lib.ConfigError(
            f"{directory} has no tokenizer.json and {vocab_size:,} ids in its vocabulary (config.json vocab_size), "
            f"more than the byte tokenizer's 259 padded (at most {BYTE_VOCAB_LIMIT}): it was not trained on bytes; "
            + fix
        )
    hf = json_object(os.path.join(directory, "config.json"))
    byte_ids = {"pad_token_id": 256, "bos_token_id": 257, "eos_token_id": 258}
    wrong = {k: hf[k] for k, v in byte_ids.items() if hf.get(k) is not None and hf[k] != v}
    if wrong:
        shown = ", ".join(f"{k} = {v} (the byte tokenizer's: {byte_ids[k]})" for k, v in wrong.items())
        raise fields_lib.ConfigError(
            f"{directory} has no tokenizer.json and config.json's {shown}: its vocabulary is not the byte "
            "tokenizer's; " + fix
        )


def initial_params(
    config: ml_collections.ConfigDict, abstract: nnx.State, shardings: nnx.State | None = None
) -> nnx.State:
    """The parameters of checkpoint.init_from's checkpoint as an nnx.State shaped like `abstract` (the model's
    parameters from `nnx.eval_shape`), each array created in its entry of `shardings` (None: the default device)
    from the host copy, so a device receives only its slice. Raises HFWeightsError naming the file and tensor."""
    directory = hf_dir(config)
    if directory is None:
        raise ValueError("initial_params needs checkpoint.init_from = 'hf:DIR'")
    moe = fields_lib.from_config(MoEConfig, config.moe)
    tensors = weights.to_ours(weights.read(directory), _model(config), moe, source=directory)
    return _place(abstract, tensors, shardings, jnp.dtype(config.model.param_dtype))


def _place(abstract: nnx.State, tensors: Mapping[str, np.ndarray], shardings, dtype) -> nnx.State:
    flat = dict(nnx.to_flat_state(abstract))
    where = {} if shardings is None else dict(nnx.to_flat_state(shardings))
    for path, var in flat.items():
        host = np.asarray(tensors[".".join(map(str, path))]).astype(dtype)
        var.set_value(_on(host, where[path].get_value()) if path in where else jnp.asarray(host))
    return nnx.from_flat_state(flat)


def _on(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """`host` as an array in `sharding`: each device receives only its slice."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def pretrained_model(config: ml_collections.ConfigDict, model_fn) -> Transformer:
    """`model_fn(rngs)`'s module (the model of the resolved `config`, or a FoMoE federation's global model) holding
    checkpoint.init_from's weights, on the default device. It is built abstractly: the random parameters are never
    computed; the other variables (a MoE layer's resident expert ids) are as built."""
    graphdef, abstract, _ = split_params(nnx.eval_shape(lambda: model_fn(nnx.Rngs(0))))
    rest = jax.jit(lambda: split_params(model_fn(nnx.Rngs(0)))[2])()
    return nnx.merge(graphdef, initial_params(config, abstract), rest)
