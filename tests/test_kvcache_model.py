"""The model's cached generation on the paged cache in every format, and the `kvcache` config section."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core import generate as generate_lib
from core.byte_tokenizer import ByteTokenizer
from core.fields import ConfigError
from core.model import Transformer, TransformerConfig
from experiments import build, schema
from kvcache import PagedKVCache, formats, paged_cache_factory

from helpers import forward

# D = 64, GQA 2
CFG = TransformerConfig(vocab_size=264, d_model=128, num_layers=2, num_heads=2, num_kv_heads=1, d_ff=96)


def _factory(fmt, **kw):
    return paged_cache_factory(
        fmt, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim, shuffle_blocks=0, **kw
    )


def _cached_logits(model, full, lengths, factory):
    """Padded prefill of ragged prompts, then 3 single-token steps: the logits of every real position."""
    cache = factory(3, 32)
    width = int(max(lengths))
    logits, _, cache = forward(model, full[:, :width], cache)
    cache = cache.advance(jnp.asarray(lengths) - width)
    got = [np.asarray(logits[b, :n]) for b, n in enumerate(lengths)]
    for _ in range(3):
        pos = np.asarray(cache.lengths)
        step, _, cache = forward(model, full[jnp.arange(3), pos][:, None], cache)
        got = [np.concatenate([g, np.asarray(step[b])]) for b, g in enumerate(got)]
    return got


@pytest.mark.parametrize("name", formats.NAMES)
def test_paged_decode_matches_full_forward(name):
    """Prefill + decode through the paged cache (shuffled block tables, block size 16 < the sequences) gives the
    uncached forward's logits within each format's quantisation error (max error over the max logit)."""
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    full = jax.random.randint(jax.random.key(1), (3, 24), 0, 256)
    ref = np.asarray(forward(model, full, None)[0])
    lengths = [5, 19, 12]
    got = _cached_logits(model, full, lengths, _factory(formats.get(name)))
    # measured: 6e-4, 7e-3, 4e-2, 3e-2, 4e-2
    tol = {"bf16": 3e-3, "fp8": 2.5e-2, "fp4": 1e-1, "nvfp4": 1e-1, "k8v4": 1e-1}[name]
    for b, n in enumerate(lengths):
        want = ref[b, : n + 3]
        err = np.abs(got[b] - want).max() / np.abs(want).max()
        assert err < tol, (name, b, err)


@pytest.mark.parametrize("name", ["bf16", "fp4"])
def test_paged_decode_at_head_dim_80(name):
    """A model with Phi-2's head dim (80; stored padded to 96 / 128 inside the format) decodes through the paged
    cache to the uncached forward's logits within the format's error, as at D = 64."""
    cfg = TransformerConfig(vocab_size=264, d_model=160, num_layers=1, num_heads=2, num_kv_heads=1, d_ff=96)
    assert cfg.head_dim == 80
    model = Transformer(cfg, rngs=nnx.Rngs(2))
    full = jax.random.randint(jax.random.key(3), (3, 24), 0, 256)
    ref = np.asarray(forward(model, full, None)[0])
    lengths = [5, 19, 12]
    factory = paged_cache_factory(formats.get(name), num_layers=1, num_kv_heads=1, head_dim=80, shuffle_blocks=0)
    got = _cached_logits(model, full, lengths, factory)
    tol = {"bf16": 3e-3, "fp4": 1e-1}[name]
    for b, n in enumerate(lengths):
        want = ref[b, : n + 3]
        assert np.abs(got[b] - want).max() / np.abs(want).max() < tol, (name, b)


def test_pallas_and_xla_generate_the_same_tokens():
    """Greedy generation with the fp4 paged cache: the Pallas kernels (interpreted) and the XLA reference agree."""
    model = Transformer(CFG, rngs=nnx.Rngs(2))
    prompts = [np.array([257, 10, 20, 30, 40]), np.array([257, 99])]
    out = {
        impl: generate_lib.generate(
            model,
            prompts,
            max_new_tokens=4,
            key=jax.random.key(0),
            cache_factory=_factory(formats.get("fp4"), implementation=impl),
            tokenizer=ByteTokenizer(),
        )
        for impl in ("xla", "pallas")
    }
    np.testing.assert_array_equal(out["pallas"], out["xla"])


def test_config_selects_the_cache(tiny_config):
    c = tiny_config
    c.model.d_model, c.model.num_heads, c.model.num_kv_heads = 128, 2, 1  # head_dim 64
    c.moe.every = 0
    model = Transformer(
        TransformerConfig(vocab_size=264, d_model=128, num_layers=2, num_heads=2, num_kv_heads=1, d_ff=64),
        rngs=nnx.Rngs(0),
    )
    schema.validate(c)
    assert build.build_cache_factory(c, model)(1, 16).__class__.__name__ == "DenseKVCache"
    c.kvcache.format, c.kvcache.scale_rule = "fp4", "mx"
    schema.validate(c)
    cache = build.build_cache_factory(c, model)(2, 40)
    assert isinstance(cache, PagedKVCache)
    assert cache.pool.fmt == formats.get("fp4", scale_rule="mx") and cache.block_tables.shape == (2, 3)
    c.kvcache.grid = "int4"
    schema.validate(c)
    cache = build.build_cache_factory(c, model)(1, 16)
    assert isinstance(cache, PagedKVCache) and cache.pool.fmt == formats.get("fp4", grid="int4", scale_rule="mx")
    c.kvcache.format = "nvfp4"  # takes no grid: the key would change nothing
    with pytest.raises(ConfigError, match="'kvcache.grid' = 'int4' has no effect on kvcache.format = 'nvfp4'.*fp4"):
        schema.validate(c)
    c.kvcache.format, c.kvcache.grid = "fp4", "e2m1"
    c.model.d_model = 96  # head_dim 48: fp4 cannot store it
    with pytest.raises(ConfigError, match="'kvcache.format' = 'fp4'.*head_dim = 48"):
        schema.validate(c)
    with pytest.raises(ConfigError, match="kvcache.implementation"):
        c.kvcache.implementation = "triton"
        schema.validate(c)
