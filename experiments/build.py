"""The composition root's builders: config -> model, precision, KV cache factory, mesh, tokenizer, data, optimizer.

A component added by another package (an FFN, a precision recipe, an optimizer) gets its config section in
experiments.schema and a builder here that picks it from a validated config. The schema itself
(`schema.default_config()`, `schema.validate(config)`) lives in experiments.schema; nothing is re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import ml_collections
import optax
from flax import nnx

import optim
from core import corpus as corpus_lib
from core import data as data_lib
from core import fields as fields_lib
from core import generate as generate_lib
from core import mesh as mesh_lib
from core import model as model_lib
from core import tokenizer as tokenizer_lib
from core import train as train_lib
from experiments import optimizers, schema_kvcache, schema_moe, schema_quant
from experiments.schema import model_config
from kvcache import paged_cache_factory
from moe import reshuffle, spes
from moe.grouped_matmul import GroupedMatmulFn
from moe.layer import MoE
from quant import recipes as quant_recipes
from quant.precision import QuantPrecision


def optimizer_metrics(opt_state) -> dict:
    """What the optimizer reports about its last update, logged with the train metrics (MGUP's selected
    fraction; nothing for the other optimizers)."""
    return optim.state_metrics(opt_state)


def decay_mask(params):
    """Which leaves weight decay applies to: a tree of bools like `params`, True for matrices (ndim >= 2) whose path
    does not name the embedding table; False for norms, biases and the embedding."""

    def keep(path, leaf):
        return leaf.ndim >= 2 and "embedding" not in jax.tree_util.keystr(path)

    return jax.tree_util.tree_map_with_path(keep, params)


def build_optimizer(config: ml_collections.ConfigDict, params: nnx.State | None = None) -> optax.GradientTransformation:
    """The optimizer of every kind of run (a plain run's, and each site's inner optimizer of a federated one):
    gradient clipping (if enabled) followed by the optimizer `optim.name` names in experiments.optimizers, on the
    warm-up + decay schedule, with its family's b1 / b2 / eps / momentum unless the config sets them
    (experiments.optimizers.hyperparameters; the table is in docs/configuration.md) and weight decay on `decay_mask`'s
    leaves. A federated run with random placement (mesh.site > 1, fomoe.placement = "random") ends the chain with
    moe.reshuffle.arrival_warmup over `fomoe.arrival_warmup` steps, placed by `params` (a site model's nnx.Param
    state: where each expert axis lies); with SPES (fomoe.outer = "spes") it ends with moe.spes.owned_only, placed
    likewise (moe.spes.assign_owners sets which experts each site trains). Raises ConfigError for an unknown name or
    a family key the chosen optimizer does not use, ValueError for a random placement or SPES without `params`."""
    o = config.optim
    schedule = train_lib.learning_rate_schedule(o, config.train.steps)
    inner = optimizers.lookup(o.name).build(schedule, o, optimizers.hyperparameters(o), decay_mask)
    optimizer = optax.chain(optax.clip_by_global_norm(o.grad_clip_norm), inner) if o.grad_clip_norm > 0 else inner
    if config.mesh.site > 1 and config.fomoe.placement == "random":  # arrived experts ramp their updates up
        if params is None:
            raise ValueError("build_optimizer: a random placement (fomoe.placement) needs a site model's params")
        warmup = reshuffle.arrival_warmup(reshuffle.expert_dims(params), config.fomoe.arrival_warmup)
        optimizer = optax.chain(optimizer, warmup)
    if config.mesh.site > 1 and config.fomoe.outer == "spes":  # a site trains only the experts it owns
        if params is None:
            raise ValueError("build_optimizer: SPES (fomoe.outer = 'spes') needs a site model's params")
        optimizer = optax.chain(optimizer, spes.owned_only(spes.expert_matrices(params)))
    return optimizer


def build_outer_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation | None:
    """A federated run's outer optimizer: optim.diloco_outer at `fomoe.outer_learning_rate` and
    `fomoe.outer_momentum` for `fomoe.outer = "diloco"`; None for LocalAdamW (the sites' states are averaged)."""
    f = config.fomoe
    return optim.diloco_outer(f.outer_learning_rate, momentum=f.outer_momentum) if f.outer == "diloco" else None


def build_model_fn(
    config: ml_collections.ConfigDict, sharder: mesh_lib.Sharder, *, resident=None, routing_mode: str = "partitioned"
) -> Callable[[nnx.Rngs], model_lib.Transformer]:
    """`rngs -> Transformer` with the precision and FFN slots chosen by the config. `resident` (global expert
    ids) and `routing_mode` build one FoMoE site's view (moe.layer.MoE); the default hosts every expert."""
    cfg = model_config(config)
    moe = schema_moe.moe_config(config)
    precision = build_precision(config, GroupedMatmulFn(moe.grouped_matmul))

    def ffn_factory(layer: int, path: str, rngs: nnx.Rngs) -> nnx.Module:
        if moe.is_moe_layer(layer):
            return MoE.in_transformer(
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
    recipe = schema_quant.apply(quant_recipes.get(p.recipe), p)
    return QuantPrecision(recipe, num_layers=config.model.num_layers, grouped=grouped, seed=config.train.seed)


def build_cache_factory(config: ml_collections.ConfigDict, model: model_lib.Transformer) -> generate_lib.CacheFactory:
    """The KV cache of cached generation: the dense bf16 cache, or a paged cache in the configured format."""
    kv, cfg = fields_lib.from_config(schema_kvcache.KVCacheConfig, config.kvcache), model.cfg
    if kv.format == "bf16" and not kv.paged:
        return generate_lib.dense_cache_factory(model)
    return paged_cache_factory(
        schema_kvcache.make_format(kv),
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
    core.byte_tokenizer.TokenizerError naming data.tokenizer."""
    return tokenizer_lib.load(config.data.tokenizer)


def describe_data(config: ml_collections.ConfigDict) -> corpus_lib.CorpusRecord:
    """The fingerprint and info `build_data`'s corpus would have, without tokenizing it (for a run that reads no
    batch, such as an import without evaluation)."""
    return corpus_lib.describe_corpus(**_corpus_args(config))


def _corpus_args(config: ml_collections.ConfigDict) -> dict:
    """The corpus the `data` section names, as `core.corpus.load_corpus`'s (and `describe_corpus`') arguments."""
    d = config.data
    tokenizer = build_tokenizer(config)
    return dict(path=d.path or None, val_fraction=d.val_fraction, jsonl_field=d.jsonl_field, tokenizer=tokenizer)


def build_data(config: ml_collections.ConfigDict) -> tuple[corpus_lib.Corpus, data_lib.Batches]:
    """Loads the corpus, tokenized by `data.tokenizer`, and the per-process batch source (which carries the
    tokenizer: its padding id and bytes per id reach the loss and the evaluation, core.train)."""
    d = config.data
    corpus = corpus_lib.load_corpus(**_corpus_args(config))
    batches = data_lib.Batches(
        corpus,
        seq_len=d.seq_len,
        global_batch=d.batch_size,
        seed=d.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    return corpus, batches
