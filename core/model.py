"""A decoder-only transformer in Flax NNX with three slots that other packages fill without editing it.

    x = embed(tokens)                                  [B, T, d_model]
    for each block:  x = x + post_a(attn(norm_a(x)))    post_* = identity, or a norm with Peri-LN
                     x = x + post_f(ffn(norm_f(x)))
    logits = head(norm(x))                             tied to the embedding by default

Slots:
  * FFN: `ffn_factory(layer, path, rngs) -> module` whose `__call__(x, *, key=None)` returns `(y, aux)`, aux a
    dict of scalars (e.g. a MoE load-balance loss). Default: the dense SiLU MLP.
  * precision: every projection asks `precision.dot_general(path, key)` for the function with the signature of
    `jax.lax.dot_general` it multiplies with; `path` is the module path ("blocks.3.attn.q") so a policy can keep
    chosen layers in high precision, and `key` is a per-step, per-layer PRNG key (stochastic rounding) or None.
    A MoE's experts ask `precision.grouped_matmul(path, key)` the same way for a `jax.lax.ragged_dot`-like callable.
  * attention: training attention through `jax.nn.dot_product_attention`; cached decode through any
    `core.attention.KVCache` (the bf16 `DenseKVCache` here, quantised formats elsewhere).

Parameters carry logical axis names in their `axes` metadata; activations are constrained with a `Sharder`.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from core import attention as attention_lib
from core.config import TransformerConfig
from core.mesh import Sharder

__all__ = [
    "MLP",
    "Attention",
    "Block",
    "DefaultPrecision",
    "Dense",
    "DotGeneral",
    "GroupedMatmul",
    "Precision",
    "Transformer",
    "TransformerConfig",
    "count_params",
    "layer_key",
    "split_params",
]

DotGeneral = Callable[..., jax.Array]
GroupedMatmul = Callable[..., jax.Array]
"""`(lhs [M, K], rhs [G, K, N], group_sizes [G] int32, *, preferred_element_type=None) -> [M, N]`, the signature
of `jax.lax.ragged_dot`: rows sorted by group, group g multiplied by rhs[g] (a MoE's experts)."""


class Precision(Protocol):
    """The matmul-precision slot: which dot_general each projection and which grouped matmul each set of
    experts uses. `path` names the module ("blocks.3.attn.q", "blocks.1.ffn.experts.up"); `key` is that layer's
    PRNG key for this step (or None)."""

    def dot_general(self, path: str, key: jax.Array | None) -> DotGeneral: ...

    def grouped_matmul(self, path: str, key: jax.Array | None) -> GroupedMatmul: ...


@dataclasses.dataclass(frozen=True)
class DefaultPrecision:
    """Every projection uses `jax.lax.dot_general` in the activation dtype; experts use `grouped` (default
    `jax.lax.ragged_dot`; the MoE package passes its backend-chosen grouped matmul)."""

    grouped: GroupedMatmul = jax.lax.ragged_dot

    def dot_general(self, path: str, key: jax.Array | None) -> DotGeneral:
        del path, key
        return jax.lax.dot_general

    def grouped_matmul(self, path: str, key: jax.Array | None) -> GroupedMatmul:
        del path, key
        return self.grouped


def layer_key(key: jax.Array | None, path: str) -> jax.Array | None:
    """A key unique to (step key, module path); stable across runs (crc32, not Python's salted hash)."""
    return None if key is None else jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)


class Dense(nnx.Module):
    """y = x @ W (+ b) through the precision slot. W: [in, out] with logical axes `axes`; b: [out] (zeros at
    init) when `bias`.

    Args:
      x: [..., in] in any float dtype; computed in `dtype` with float32 accumulation, returned in `dtype`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: tuple[str | None, str | None],
        path: str,
        precision: Precision,
        cfg: TransformerConfig,
        rngs: nnx.Rngs,
        std: float | None = None,
        bias: bool = False,
    ):
        std = cfg.init_std if std is None else std
        w = std * jax.random.normal(rngs.params(), (in_features, out_features), jnp.float32)
        self.kernel = nnx.Param(w.astype(cfg.weight_dtype), axes=axes)
        if bias:
            self.bias = nnx.Param(jnp.zeros((out_features,), cfg.weight_dtype), axes=(axes[1],))
        self.path = path
        self.precision = precision
        self.dtype = cfg.compute_dtype

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        dot_general = self.precision.dot_general(self.path, layer_key(key, self.path))
        lead = x.shape[:-1]
        x = x.astype(self.dtype).reshape(-1, x.shape[-1])  # [M, in]: the weight gradient contracts one axis
        w = self.kernel.get_value().astype(self.dtype)
        y = dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        if hasattr(self, "bias"):  # added in float32, outside the (possibly low-precision) product
            y = y + self.bias.get_value().astype(jnp.float32)
        return y.astype(self.dtype).reshape(*lead, w.shape[1])


class Norm(nnx.Module):
    """RMSNorm (x / rms(x) * scale) or LayerNorm ((x - mean) / std * scale + bias) over the last axis, computed in
    float32; `kind` defaults to the config's `norm`, `axis` names the normalised dimension for sharding."""

    def __init__(self, dim: int, cfg: TransformerConfig, *, kind: str | None = None, axis: str | None = "embed"):
        self.kind, self.eps, self.dtype = kind or cfg.norm, cfg.norm_eps, cfg.compute_dtype
        self.scale = nnx.Param(jnp.ones((dim,), cfg.weight_dtype), axes=(axis,))
        if self.kind == "layernorm":
            self.bias = nnx.Param(jnp.zeros((dim,), cfg.weight_dtype), axes=(axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        if self.kind == "layernorm":
            x = x - jnp.mean(x, axis=-1, keepdims=True)
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        y = y * self.scale.get_value().astype(jnp.float32)
        if self.kind == "layernorm":
            y = y + self.bias.get_value().astype(jnp.float32)
        return y.astype(self.dtype)


class MLP(nnx.Module):
    """The dense FFN: SwiGLU  down(silu(gate(x)) * up(x))  or plain  down(silu(up(x))).

    `__call__(x [B, T, d_model], *, key) -> (y [B, T, d_model], aux={})`, the FFN-slot signature.
    """

    def __init__(self, cfg: TransformerConfig, *, path: str, precision: Precision, shard: Sharder, rngs: nnx.Rngs):
        dense: dict[str, Any] = dict(path=path, precision=precision, cfg=cfg, rngs=rngs)
        self.gated = cfg.mlp == "swiglu"
        if self.gated:
            self.gate = Dense(cfg.d_model, cfg.d_ff, axes=("embed", "mlp"), **{**dense, "path": f"{path}.gate"})
        self.up = Dense(cfg.d_model, cfg.d_ff, axes=("embed", "mlp"), **{**dense, "path": f"{path}.up"})
        self.down = Dense(
            cfg.d_ff,
            cfg.d_model,
            axes=("mlp", "embed"),
            **{**dense, "path": f"{path}.down"},
            std=cfg.init_std / math.sqrt(2 * cfg.num_layers),
        )
        self.shard = shard

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        h = jax.nn.silu(self.gate(x, key=key)) * self.up(x, key=key) if self.gated else jax.nn.silu(self.up(x, key=key))
        h = self.shard(h, ("batch", "seq", "mlp"))
        return self.down(h, key=key), {}


class Attention(nnx.Module):
    """Multi-head / grouped-query self-attention with RoPE.

    q: [B, T, H, D], k, v: [B, T, K, D] (D = cfg.head_dim, which need not be d_model / H); optional q/k/v and
    output biases, optional RMSNorm of q and k before RoPE (per head: Qwen3; over the whole projections: OLMoE),
    optional Llama 3.1 RoPE scaling;
    output projection back to d_model.
    """

    def __init__(
        self, cfg: TransformerConfig, *, layer: int, path: str, precision: Precision, shard: Sharder, rngs: nnx.Rngs
    ):
        d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        common: dict[str, Any] = dict(precision=precision, cfg=cfg, rngs=rngs)
        self.q = Dense(d, h * hd, axes=("embed", "heads"), path=f"{path}.q", bias=cfg.qkv_bias, **common)
        self.k = Dense(d, kv * hd, axes=("embed", "kv_heads"), path=f"{path}.k", bias=cfg.qkv_bias, **common)
        self.v = Dense(d, kv * hd, axes=("embed", "kv_heads"), path=f"{path}.v", bias=cfg.qkv_bias, **common)
        self.o = Dense(
            h * hd,
            d,
            axes=("heads", "embed"),
            path=f"{path}.o",
            bias=cfg.out_bias,
            **common,
            std=cfg.init_std / math.sqrt(2 * cfg.num_layers),
        )
        self.qk_norm = cfg.qk_norm_over if cfg.qk_norm else None  # "head", "projection" or None
        if self.qk_norm == "projection":  # over the whole projections (OLMoE): a scale per channel
            self.q_norm = Norm(h * hd, cfg, kind="rmsnorm", axis="heads")
            self.k_norm = Norm(kv * hd, cfg, kind="rmsnorm", axis="kv_heads")
        elif self.qk_norm == "head":  # one scale per head dimension, shared by the heads
            self.q_norm = Norm(hd, cfg, kind="rmsnorm", axis=None)
            self.k_norm = Norm(hd, cfg, kind="rmsnorm", axis=None)
        self.layer, self.num_heads, self.num_kv_heads, self.head_dim = layer, h, kv, hd
        self.impl, self.shard = cfg.attention_impl, shard

    def __call__(
        self,
        x: jax.Array,
        rot: attention_lib.Rotary,
        *,
        key: jax.Array | None = None,
        cache: attention_lib.KVCache | None = None,
    ):
        """x: [B, T, d_model], rot: the positions' rotation (`attention_lib.rotary`, [B, T, 1, head_dim / 2]).
        Returns (y [B, T, d_model], cache)."""
        b, t, _ = x.shape
        q, k = self.q(x, key=key), self.k(x, key=key)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v(x, key=key).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = attention_lib.apply_rotary(q, rot), attention_lib.apply_rotary(k, rot)
        q = self.shard(q, ("batch", "seq", "heads", None))
        k = self.shard(k, ("batch", "seq", "kv_heads", None))
        v = self.shard(v, ("batch", "seq", "kv_heads", None))
        if cache is None:
            out = attention_lib.causal_attention(q, k, v, implementation=self.impl)
        else:
            out, cache = cache.update_and_attend(self.layer, q, k, v)
        out = self.shard(out, ("batch", "seq", "heads", None)).reshape(b, t, self.num_heads * self.head_dim)
        return self.o(out, key=key), cache


FFNFactory = Callable[[int, str, nnx.Rngs], nnx.Module]
"""(layer index, module path, rngs) -> FFN module with `__call__(x, *, key) -> (y, aux)`."""


class Block(nnx.Module):
    """Pre-norm residual block (Peri-LN adds output norms): attention then FFN."""

    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        layer: int,
        precision: Precision,
        shard: Sharder,
        ffn_factory: FFNFactory,
        rngs: nnx.Rngs,
    ):
        path = f"blocks.{layer}"
        self.attn_norm = Norm(cfg.d_model, cfg)
        self.attn = Attention(cfg, layer=layer, path=f"{path}.attn", precision=precision, shard=shard, rngs=rngs)
        self.ffn_norm = Norm(cfg.d_model, cfg)
        self.ffn = ffn_factory(layer, f"{path}.ffn", rngs)
        if cfg.peri_ln:
            self.attn_out_norm = Norm(cfg.d_model, cfg)
            self.ffn_out_norm = Norm(cfg.d_model, cfg)
        self.peri_ln, self.shard = cfg.peri_ln, shard

    def __call__(self, x, rot, *, key=None, cache=None):
        h, cache = self.attn(self.attn_norm(x), rot, key=key, cache=cache)
        x = x + (self.attn_out_norm(h) if self.peri_ln else h)
        h, aux = self.ffn(self.ffn_norm(x), key=key)
        x = x + (self.ffn_out_norm(h) if self.peri_ln else h)
        return self.shard(x, ("batch", "seq", "embed")), aux, cache


class Transformer(nnx.Module):
    """The decoder-only language model.

    Call: `model(tokens [B, T] int32, *, key=None, cache=None, positions=None, intermediates=False)` returns
    `(logits [B, T, vocab] float32, aux, cache)`: scalar aux entries named `loss/*` are summed over layers (they
    join the objective), the other scalars (statistics) averaged over the layers that report them. Non-scalar
    entries an FFN reports are per-layer intermediates (a MoE layer's "routes"): with `intermediates=True`,
    `aux["intermediates"][name]` holds them in layer order (a tuple, one per reporting layer); otherwise they are
    dropped, and XLA prunes their computation. Without a cache, positions
    default to 0..T-1 and attention is causal over the T tokens; with a cache, the tokens continue each sequence
    at `cache.lengths` and the returned cache has advanced by T.
    """

    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        rngs: nnx.Rngs,
        precision: Precision | None = None,
        ffn_factory: FFNFactory | None = None,
        shard: Sharder | None = None,
    ):
        precision = DefaultPrecision() if precision is None else precision
        shard = Sharder() if shard is None else shard
        if ffn_factory is None:

            def ffn_factory(layer, path, rngs):
                return MLP(cfg, path=path, precision=precision, shard=shard, rngs=rngs)

        emb = cfg.init_std * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model), jnp.float32)
        self.embedding = nnx.Param(emb.astype(cfg.weight_dtype), axes=("vocab", "embed"))
        self.blocks = nnx.List(
            [
                Block(cfg, layer=i, precision=precision, shard=shard, ffn_factory=ffn_factory, rngs=rngs)
                for i in range(cfg.num_layers)
            ]
        )
        self.final_norm = Norm(cfg.d_model, cfg)
        if not cfg.tie_embeddings:
            self.head = Dense(
                cfg.d_model,
                cfg.vocab_size,
                axes=("embed", "vocab"),
                path="head",
                precision=precision,
                cfg=cfg,
                rngs=rngs,
            )
        self.rope_scaling = (
            attention_lib.RopeScaling(
                cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len
            )
            if cfg.rope_scaling == "llama3"
            else None
        )
        self.cfg, self.precision, self.shard = cfg, precision, shard

    def __call__(
        self,
        tokens: jax.Array,
        *,
        key: jax.Array | None = None,
        cache: attention_lib.KVCache | None = None,
        positions: jax.Array | None = None,
        intermediates: bool = False,
    ):
        t = tokens.shape[1]
        if positions is None:  # without a cache every sequence starts at 0: one row of positions [1, T] for all
            start = jnp.zeros((1,), jnp.int32) if cache is None else cache.lengths
            positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        x = jnp.take(self.embedding.get_value(), tokens, axis=0).astype(self.cfg.compute_dtype)
        x = self.shard(x, ("batch", "seq", "embed"))
        sums: dict[str, jax.Array] = {}
        counts: dict[str, int] = {}
        per_layer: dict[str, list[jax.Array]] = {}
        # One rotation table for every layer ([1, T, 1, D / 2] without a cache).
        rot = attention_lib.rotary(positions, self.cfg.head_dim, self.cfg.rope_theta, self.rope_scaling)
        for block in self.blocks:
            x, block_aux, cache = block(x, rot, key=key, cache=cache)
            for name, value in block_aux.items():
                if jnp.ndim(value):  # an intermediate (a MoE layer's routes): kept per layer, on request only
                    per_layer.setdefault(name, []).append(value)
                    continue
                sums[name] = sums.get(name, 0.0) + value
                counts[name] = counts.get(name, 0) + 1
        # Losses add up over layers; statistics (e.g. a router's load balance) are averaged over the layers
        # that report them.
        aux: dict = {k: v if k.startswith("loss/") else v / counts[k] for k, v in sums.items()}
        if intermediates:
            aux["intermediates"] = {name: tuple(values) for name, values in per_layer.items()}
        x = self.final_norm(x)
        if self.cfg.tie_embeddings:
            dot_general = self.precision.dot_general("head", layer_key(key, "head"))
            table = self.embedding.get_value().astype(self.cfg.compute_dtype)
            logits = dot_general(x, table, (((2,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        else:
            logits = self.head(x, key=key)
        logits = self.shard(logits.astype(jnp.float32), ("batch", "seq", "vocab"))
        if cache is not None:
            cache = cache.advance(t)
        return logits, aux, cache


def split_params(module: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, the nnx.Param variables, every other variable) of `module`: what a train state holds apart."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc] # (flax's variadic return)
    return graphdef, params, rest


def count_params(model: nnx.Module) -> int:
    """Number of scalar parameters (nnx.Param leaves)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
