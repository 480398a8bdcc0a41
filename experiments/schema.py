"""The experiment config: its sections, defaults, validation, what keys imply, and what a checkpoint must share.

    config = schema.default_config()          # every section at its defaults; experiment files change some keys
    schema.validate(config)                   # static checks (no JAX backend touched)
    schema.resolve(config)                    # fills in what other keys imply (checkpoint.init_from = "hf:DIR")
    schema.validate(config, num_devices=8)    # and with the devices the mesh is laid over

A section is a frozen dataclass declared by the package that owns it (core.config's declarations, `optim`, `moe`,
`fomoe`, `precision`, `kvcache`); this module merges them into one schema and fills the registered choices
(`optim.name`). Building components from a config is experiments.build's.
"""

from __future__ import annotations

import dataclasses
import os

import ml_collections

from core import config as config_lib
from experiments.hf import load as hf_load
from kvcache import config as kv_config
from moe import config as moe_config
from optim import config as optim_config
from optim import registry as optim_registry
from quant import config as quant_config

__all__ = [
    "SECTIONS",
    "checkpoint_compat",
    "default_config",
    "model_config",
    "provenance",
    "resolve",
    "schema",
    "validate",
]

SECTIONS: dict[str, type] = {
    **config_lib.SECTIONS,
    "optim": optim_config.OptimizerConfig,
    "moe": moe_config.MoEConfig,
    "fomoe": moe_config.FoMoEConfig,
    "precision": quant_config.PrecisionConfig,
    "kvcache": kv_config.KVCacheConfig,
}
"""Every config section of an experiment: name -> its declaration (a frozen dataclass, see core.config)."""


def schema() -> config_lib.Schema:
    """The full experiment schema: every section's fields, with the registered choices filled in (`optim.name`:
    the names of optim.registry)."""
    spec = config_lib.schema(SECTIONS)
    spec["optim"]["name"] = dataclasses.replace(spec["optim"]["name"], choices=optim_registry.NAMES)
    return spec


def default_config() -> ml_collections.ConfigDict:
    """The default experiment config; experiment files start from it and change what they need."""
    return config_lib.defaults(schema())


def model_config(config: ml_collections.ConfigDict) -> config_lib.TransformerConfig:
    """The `model` section as its dataclass (`head_dim` 0 resolved to d_model / num_heads)."""
    return config_lib.from_config(config_lib.TransformerConfig, config.model)


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None, source: bool = True) -> None:
    """Raises core.config.ConfigError naming the first bad key, its value and what is allowed. Call once without
    devices (static checks) and once with `num_devices` (the mesh's sizes, the experts per device). `source`: also
    check that checkpoint.init_from's DIR is a Hugging Face checkpoint (False for a run's own config read back to
    load its checkpoint, which no longer reads DIR: the run serves and exports after DIR is gone)."""
    config_lib.validate(config, schema(), num_devices=num_devices)
    if source:
        hf_load.hf_dir(config)  # checkpoint.init_from's form; what it implies is `resolve`'s
    optim_registry.check(config.optim)  # the family keys (unused, out of range, b1^2 >= b2) and lr x weight decay
    sizes = None if num_devices is None else config_lib.mesh_shape(config, num_devices)
    moe_config.check(config, sizes)
    moe_config.check_fomoe(config, sizes)
    if config.precision.last_blocks_high_precision > config.model.num_layers:
        raise config_lib.ConfigError(
            f"config key 'precision.last_blocks_high_precision' = {config.precision.last_blocks_high_precision} "
            f"exceeds model.num_layers = {config.model.num_layers}."
        )
    kv_config.check(config_lib.from_config(kv_config.KVCacheConfig, config.kvcache), model_config(config).head_dim)


def resolve(config: ml_collections.ConfigDict) -> None:
    """Fills in, in place, what other keys imply before `validate`: `checkpoint.init_from = "hf:DIR"` sets the
    architecture (model, moe) and tokenizer from the Hugging Face checkpoint in DIR (experiments.hf.load.apply_to).
    Raises ConfigError naming a conflicting key. A tokenizer path becomes absolute, so that the run's config.json
    (which serve, export and sampling read back) means the same file from any directory."""
    if config.data.tokenizer != "bytes":
        config.data.tokenizer = os.path.abspath(config.data.tokenizer)
    hf_load.apply_to(config)


def checkpoint_compat(config: ml_collections.ConfigDict, data_fingerprint: str) -> dict:
    """What a checkpoint must share with this config to be resumed (each section's `compat` declaration)."""
    return config_lib.checkpoint_compat(config, SECTIONS, data_fingerprint)


def provenance(config: ml_collections.ConfigDict) -> dict:
    """How a run's weights are trained beyond `checkpoint_compat` (each section's `provenance` declaration): a
    resume refuses a change of these unless `checkpoint.accept_changes`."""
    return config_lib.provenance(config, SECTIONS)
