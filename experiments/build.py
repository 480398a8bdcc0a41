"""The composition root: config -> model, precision, optimizer, data, mesh.

This is the only module that wires packages together. A component added by another package (an FFN, a precision
recipe, an optimizer) is registered here: its config section is merged into the schema, its choices are added to
the relevant field, and a builder below picks it from the config.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import jax
import ml_collections
import optax
from flax import nnx

import optim
from core import config as config_lib
from core import data as data_lib
from core import generate as generate_lib
from core import mesh as mesh_lib
from core import model as model_lib
from core import tokenizer as tokenizer_lib
from core import train as train_lib
from kvcache import config as kv_config
from kvcache import paged_cache_factory
from moe import config as moe_config
from moe.grouped_matmul import GroupedMatmulFn
from moe.layer import MoE
from optim import cautious_adamw, cautious_mgup_adamw, mgup_adamw, mgup_lion, mgup_muon
from optim import config as optim_config
from quant import config as quant_config
from quant import recipes as quant_recipes
from quant.precision import QuantPrecision

# name -> (learning-rate schedule, optim config section, its family's b1 / b2 / eps / momentum as resolved by
# optim.config.hyperparameters) -> optax transformation (without clipping). Every argument by keyword.
OPTIMIZERS: dict[
    str, Callable[[optax.Schedule, ml_collections.ConfigDict, dict[str, float]], optax.GradientTransformation]
] = {
    "adamw": lambda lr, o, h: optax.adamw(
        lr, b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=o.weight_decay, mask=decay_mask
    ),
    "cautious_adamw": lambda lr, o, h: cautious_adamw(
        lr, b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=o.weight_decay, weight_decay_mask=decay_mask
    ),
    "mgup_adamw": lambda lr, o, h: mgup_adamw(
        lr,
        b1=h["b1"],
        b2=h["b2"],
        eps=h["eps"],
        weight_decay=o.weight_decay,
        mask_ratio=o.mask_ratio,
        alpha=o.alpha,
        gamma=o.gamma,
        selection=o.selection,
        weight_decay_mask=decay_mask,
    ),
    "cautious_mgup_adamw": lambda lr, o, h: cautious_mgup_adamw(
        lr,
        b1=h["b1"],
        b2=h["b2"],
        eps=h["eps"],
        weight_decay=o.weight_decay,
        alpha=o.alpha,
        gamma=o.gamma,
        weight_decay_mask=decay_mask,
    ),
    "lion": lambda lr, o, h: optax.lion(lr, b1=h["b1"], b2=h["b2"], weight_decay=o.weight_decay, mask=decay_mask),
    "mgup_lion": lambda lr, o, h: mgup_lion(
        lr,
        b1=h["b1"],
        b2=h["b2"],
        weight_decay=o.weight_decay,
        mask_ratio=o.mask_ratio,
        alpha=o.alpha,
        gamma=o.gamma,
        selection=o.selection,
        weight_decay_mask=decay_mask,
    ),
    "muon": lambda lr, o, h: mgup_muon(
        lr,
        weight_decay=o.weight_decay,
        momentum=h["momentum"],
        adam_b1=h["b1"],
        adam_b2=h["b2"],
        adam_eps=h["eps"],
        mgup=False,
        weight_decay_mask=decay_mask,
    ),
    "mgup_muon": lambda lr, o, h: mgup_muon(
        lr,
        weight_decay=o.weight_decay,
        momentum=h["momentum"],
        adam_b1=h["b1"],
        adam_b2=h["b2"],
        adam_eps=h["eps"],
        mask_ratio=o.mask_ratio,
        alpha=o.alpha,
        gamma=o.gamma,
        selection=o.selection,
        weight_decay_mask=decay_mask,
    ),
}


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
    """The full experiment schema: every section's fields, with the registered choices filled in."""
    spec = config_lib.schema(SECTIONS)
    spec["optim"]["name"] = dataclasses.replace(spec["optim"]["name"], choices=tuple(OPTIMIZERS))
    return spec


def default_config() -> ml_collections.ConfigDict:
    """The default experiment config; experiment files start from it and change what they need."""
    return config_lib.defaults(schema())


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None) -> None:
    """Raises core.config.ConfigError naming the first bad key. Call once without and once with devices."""
    config_lib.validate(config, schema(), num_devices=num_devices)
    if config.checkpoint.init_from:  # its form; what it implies is `resolve`'s
        from experiments.hf import load as hf_load

        hf_load.hf_dir(config)
    optim_config.hyperparameters(config.optim)  # a family key the chosen optimizer does not use
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
    if config.checkpoint.init_from:
        from experiments.hf import load as hf_load

        hf_load.apply_to(config)


def init_params(config: ml_collections.ConfigDict) -> Callable[..., nnx.State] | None:
    """Where step 0's parameters come from (`core.train.init_state`'s `init_params`): None for a random start, or
    `(abstract params, their shardings or None) -> the checkpoint of checkpoint.init_from's parameters`, each in its
    sharding (None: on the default device)."""
    if not config.checkpoint.init_from:
        return None
    from experiments.hf import load as hf_load

    return functools.partial(hf_load.initial_params, config)


def model_config(config: ml_collections.ConfigDict) -> config_lib.TransformerConfig:
    """The `model` section as its dataclass."""
    return config_lib.from_config(config_lib.TransformerConfig, config.model)


def optimizer_metrics(opt_state) -> dict:
    """What the optimizer reports about its last update, logged with the train metrics (MGUP's selected
    fraction; nothing for the other optimizers)."""
    return optim.state_metrics(opt_state)


def checkpoint_compat(config: ml_collections.ConfigDict, data_fingerprint: str) -> dict:
    """What a checkpoint must share with this config to be resumed (each section's `compat` declaration)."""
    return config_lib.checkpoint_compat(config, SECTIONS, data_fingerprint)


def provenance(config: ml_collections.ConfigDict) -> dict:
    """How a run's weights are trained beyond `checkpoint_compat` (each section's `provenance` declaration): a
    resume refuses a change of these unless `checkpoint.accept_changes`."""
    return config_lib.provenance(config, SECTIONS)


def decay_mask(params):
    """Which leaves weight decay applies to: a tree of bools like `params`, True for matrices (ndim >= 2) whose path
    does not name the embedding table; False for norms, biases and the embedding."""

    def keep(path, leaf):
        return leaf.ndim >= 2 and "embedding" not in jax.tree_util.keystr(path)

    return jax.tree_util.tree_map_with_path(keep, params)


def build_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """Gradient clipping (if enabled) followed by the chosen optimizer on the warm-up + decay schedule, with its
    family's b1 / b2 / eps / momentum unless the config sets them (optim.config.hyperparameters; the table is in
    docs/configuration.md). Raises ConfigError for a family key the chosen optimizer does not use."""
    o = config.optim
    schedule = train_lib.learning_rate_schedule(o, config.train.steps)
    inner = OPTIMIZERS[o.name](schedule, o, optim_config.hyperparameters(o))
    return optax.chain(optax.clip_by_global_norm(o.grad_clip_norm), inner) if o.grad_clip_norm > 0 else inner


def build_model_fn(
    config: ml_collections.ConfigDict, sharder: mesh_lib.Sharder, *, resident=None, routing_mode: str = "partitioned"
) -> Callable[[nnx.Rngs], model_lib.Transformer]:
    """`rngs -> Transformer` with the precision and FFN slots chosen by the config. `resident` (global expert
    ids) and `routing_mode` build one FoMoE site's view (moe.layer.MoE); the default hosts every expert."""
    cfg = model_config(config)
    moe = config_lib.from_config(moe_config.MoEConfig, config.moe)
    precision = build_precision(config, GroupedMatmulFn(moe.grouped_matmul))

    def ffn_factory(layer: int, path: str, rngs: nnx.Rngs) -> nnx.Module:
        if moe.is_moe_layer(layer):
            return MoE(
                cfg,
                moe,
                path=path,
                rngs=rngs,
                precision=precision,
                shard=sharder,
                resident=resident,
                routing_mode=routing_mode,
            )
        return model_lib.MLP(cfg, path=path, precision=precision, shard=sharder, rngs=rngs)

    return lambda rngs: model_lib.Transformer(
        cfg, rngs=rngs, precision=precision, ffn_factory=ffn_factory, shard=sharder
    )


def build_precision(config: ml_collections.ConfigDict, grouped: Callable) -> model_lib.Precision:
    """The matmul-precision slot: the default (lax.dot_general, `grouped` for experts) or a quant recipe, whose fixed
    RHT signs are drawn from the run's seed `train.seed`."""
    p = config.precision
    if p.recipe == "none":
        return model_lib.DefaultPrecision(grouped=grouped)
    recipe = quant_config.apply(quant_recipes.get(p.recipe), p)
    return QuantPrecision(recipe, num_layers=config.model.num_layers, grouped=grouped, seed=config.train.seed)


def build_cache_factory(config: ml_collections.ConfigDict, model: model_lib.Transformer) -> generate_lib.CacheFactory:
    """The KV cache of cached generation: the dense bf16 cache, or a paged cache in the configured format."""
    kv, cfg = config_lib.from_config(kv_config.KVCacheConfig, config.kvcache), model.cfg
    if kv.format == "bf16" and not kv.paged:
        return generate_lib.dense_cache_factory(model)
    return paged_cache_factory(
        kv_config.make_format(kv),
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        block_size=kv.block_size,
        implementation=kv.implementation,
    )


def build_mesh(config: ml_collections.ConfigDict) -> tuple[jax.sharding.Mesh, mesh_lib.Sharder]:
    mesh = mesh_lib.make_mesh(config)
    return mesh, mesh_lib.Sharder(mesh, tuple(tuple(r) for r in config.mesh.rules))


def build_tokenizer(config: ml_collections.ConfigDict) -> tokenizer_lib.Tokenizer:
    """The tokenizer `data.tokenizer` names (core.tokenizer.load: 'bytes' or a tokenizer.json); raises
    core.tokenizer.TokenizerError naming data.tokenizer."""
    return tokenizer_lib.load(config.data.tokenizer)


def build_data(config: ml_collections.ConfigDict) -> tuple[data_lib.Corpus, data_lib.Batches]:
    """Loads the corpus, tokenized by `data.tokenizer`, and the per-process batch source (which carries the
    tokenizer: its padding id and bytes per id reach the loss and the evaluation, core.train)."""
    d = config.data
    corpus = data_lib.load_corpus(
        d.path or None, val_fraction=d.val_fraction, jsonl_field=d.jsonl_field, tokenizer=build_tokenizer(config)
    )
    batches = data_lib.Batches(
        corpus,
        seq_len=d.seq_len,
        global_batch=d.batch_size,
        seed=d.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    return corpus, batches
