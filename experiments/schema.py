"""The experiment config: its sections, defaults, validation, what keys imply, and what a checkpoint must share.

    config = schema.default_config()          # every section at its defaults; experiment files change some keys
    schema.validate(config)                   # static checks (no JAX backend touched)
    experiments.hf.load.resolve(config)       # fills in what other keys imply (checkpoint.init_from = "hf:DIR")
    schema.validate(config, num_devices=8)    # and with the devices the mesh is laid over

A section is a frozen dataclass declared by the package that owns it (core.config's declarations, `optim`, `moe`,
`precision`, `kvcache`; `fomoe`, and the `moe` checks that read other sections, are experiments.schema_moe's); this
module merges them into one schema and fills the registered choices (`optim.name`). Building components from a
config is experiments.build's.
"""

from __future__ import annotations

import dataclasses
import os

import ml_collections

from core import config as config_lib
from core import fields as fields_lib
from core import mesh_config
from core import schema as core_schema
from experiments import optimizers, schema_kvcache, schema_moe, schema_optim, schema_quant
from moe import config as moe_config

__all__ = [
    "HF_PREFIX",
    "SECTIONS",
    "checkpoint_compat",
    "default_config",
    "hf_checkpoint_problem",
    "hf_dir",
    "model_config",
    "provenance",
    "schema",
    "validate",
]

SECTIONS: dict[str, type] = {
    **config_lib.SECTIONS,
    "optim": schema_optim.OptimizerConfig,
    "moe": moe_config.MoEConfig,
    "fomoe": schema_moe.FoMoEConfig,
    "precision": schema_quant.PrecisionConfig,
    "kvcache": schema_kvcache.KVCacheConfig,
}
"""Every config section of an experiment: name -> its declaration (a frozen dataclass, see core.config)."""


def schema() -> core_schema.Schema:
    """The full experiment schema: every section's fields, with the registered choices filled in (`optim.name`:
    the names of experiments.optimizers)."""
    spec = core_schema.schema(SECTIONS)
    spec["optim"]["name"] = dataclasses.replace(spec["optim"]["name"], choices=optimizers.NAMES)
    return spec


def default_config() -> ml_collections.ConfigDict:
    """The default experiment config; experiment files start from it and change what they need."""
    return core_schema.defaults(schema())


def model_config(config: ml_collections.ConfigDict) -> config_lib.TransformerConfig:
    """The `model` section as its dataclass (`head_dim` 0 resolved to d_model / num_heads)."""
    return fields_lib.from_config(config_lib.TransformerConfig, config.model)


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None, source: bool = True) -> None:
    """Raises core.fields.ConfigError naming the first bad key, its value and what is allowed. Call once without
    devices (static checks) and once with `num_devices` (the mesh's sizes, the experts per device). `source`: also
    check that checkpoint.init_from's DIR is a Hugging Face checkpoint (False for a run's own config read back to
    load its checkpoint, which no longer reads DIR: the run serves and exports after DIR is gone)."""
    core_schema.validate(config, schema(), num_devices=num_devices)
    if source:
        hf_dir(config)  # checkpoint.init_from's form; what it implies is experiments.hf.load.resolve's
    optimizers.check(config.optim)  # the family keys (unused, out of range, b1^2 >= b2) and lr x weight decay
    sizes = None if num_devices is None else mesh_config.mesh_shape(config, num_devices)
    schema_moe.check(config, sizes)
    schema_moe.check_fomoe(config, sizes)
    if config.precision.last_blocks_high_precision > config.model.num_layers:
        raise fields_lib.ConfigError(
            f"config key 'precision.last_blocks_high_precision' = {config.precision.last_blocks_high_precision} "
            f"exceeds model.num_layers = {config.model.num_layers}."
        )
    schema_kvcache.check(
        fields_lib.from_config(schema_kvcache.KVCacheConfig, config.kvcache), model_config(config).head_dim
    )


HF_PREFIX = "hf:"
"""`checkpoint.init_from = "hf:DIR"` starts a run from the Hugging Face checkpoint in DIR."""


def hf_checkpoint_problem(directory: str) -> str | None:
    """Why `directory` is not a Hugging Face checkpoint directory (config.json and safetensors weights), in words
    that say what it is instead (missing, a file, empty, what it holds, PyTorch weights and how to convert them);
    None if it is one."""
    if not os.path.exists(directory):
        return "it does not exist"
    if not os.path.isdir(directory):
        return "it is a file, not a directory"
    names = sorted(os.listdir(directory))
    if not names:
        return "it is empty"
    listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    if "config.json" not in names:
        return f"it holds no config.json (it holds {listed})"
    config = os.path.join(directory, "config.json")
    if not os.path.isfile(config):
        return f"its config.json is {'a directory' if os.path.isdir(config) else 'not a regular file'}, not a JSON file"
    if not any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
        torch = [n for n in names if n.endswith((".bin", ".pt", ".pth"))]
        if torch:
            return (
                f"it holds PyTorch weights ({', '.join(torch[:3])}) but no safetensors: convert them, e.g. with "
                "transformers: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR) writes safetensors"
            )
        return f"it holds config.json but no model.safetensors or model.safetensors.index.json (it holds {listed})"
    return None


def hf_dir(config: ml_collections.ConfigDict) -> str | None:
    """DIR of `checkpoint.init_from = "hf:DIR"`; None for a random start (''). Raises ConfigError otherwise, saying
    what DIR is instead (`hf_checkpoint_problem`)."""
    spec = config.checkpoint.init_from
    if not spec:
        return None
    allowed = "allowed '' (random initialisation) or 'hf:DIR', DIR a Hugging Face checkpoint directory"
    if not spec.startswith(HF_PREFIX):
        raise fields_lib.ConfigError(
            f"config key 'checkpoint.init_from' = {spec!r}: {allowed} (the 'hf:' prefix is missing)"
        )
    why = hf_checkpoint_problem(spec[len(HF_PREFIX) :])
    if why is not None:
        raise fields_lib.ConfigError(f"config key 'checkpoint.init_from' = {spec!r}: {why}; {allowed}")
    return spec[len(HF_PREFIX) :]


def checkpoint_compat(config: ml_collections.ConfigDict, data_fingerprint: str) -> dict:
    """What a checkpoint must share with this config to be resumed (each section's `compat` declaration)."""
    return core_schema.checkpoint_compat(config, SECTIONS, data_fingerprint)


def provenance(config: ml_collections.ConfigDict) -> dict:
    """How a run's weights are trained beyond `checkpoint_compat` (each section's `provenance` declaration): a
    resume refuses a change of these unless `checkpoint.accept_changes`."""
    return core_schema.provenance(config, SECTIONS)
