"""A Hugging Face checkpoint directory -> our config and a Transformer holding its weights.

    config, model = hf.load.model_from_hf("path/to/checkpoint")

The config is our defaults with the `model` and `moe` sections the checkpoint's config.json maps to
(`config_map.from_hf`); the model is built abstractly (no random initialisation) and receives the checkpoint's
tensors (`weights.to_ours`), cast to `model.param_dtype`. Errors name the file, the field or the tensor, and
nothing is written anywhere.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from core import config as config_lib
from core.mesh import Sharder
from core.model import Transformer, split_params
from experiments import build
from experiments.hf import config_map, weights
from moe.config import MoEConfig

__all__ = ["config_from_hf", "model_from_hf"]


def config_from_hf(hf_dir: str) -> ml_collections.ConfigDict:
    """Our default config with the sections `hf_dir/config.json` maps to, validated. Raises HFConfigError or
    ConfigError naming the field."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise config_map.HFConfigError(f"{path} does not exist: a Hugging Face checkpoint directory holds config.json")
    with open(path) as f:
        sections = config_map.from_hf(json.load(f), source=path)
    config = build.default_config()
    for name, values in sections.items():
        config[name].update(values)
    build.validate(config)
    return config


def model_from_hf(hf_dir: str) -> tuple[ml_collections.ConfigDict, Transformer]:
    """(config, Transformer with the checkpoint's weights) of the Hugging Face checkpoint in `hf_dir`."""
    config = config_from_hf(hf_dir)
    moe = config_lib.from_config(MoEConfig, config.moe)
    tensors = weights.to_ours(weights.read(hf_dir), build.model_config(config), moe, source=hf_dir)
    model_fn = build.build_model_fn(config, Sharder())
    graphdef, abstract_params, _ = split_params(nnx.eval_shape(lambda: model_fn(nnx.Rngs(0))))
    # the other variables (a MoE layer's resident expert ids) as built; the random parameters are never computed
    rest = jax.jit(lambda: split_params(model_fn(nnx.Rngs(0)))[2])()
    flat = dict(nnx.to_flat_state(abstract_params))
    dtype = jnp.dtype(config.model.param_dtype)
    for path, var in flat.items():
        var.set_value(jnp.asarray(tensors[".".join(map(str, path))], dtype))
    return config, nnx.merge(graphdef, nnx.from_flat_state(flat), rest)
