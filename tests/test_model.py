"""The transformer against an independent float64 NumPy implementation; causality; cache; the three slots."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core import attention as attention_lib
from core import generate as generate_lib
from core.attention import DenseKVCache
from core.byte_tokenizer import ByteTokenizer
from core.model import DefaultPrecision, Transformer, TransformerConfig, count_params

from helpers import forward

CONFIGS = {
    "mha-rms": TransformerConfig(vocab_size=264, d_model=32, num_layers=2, num_heads=4, num_kv_heads=4, d_ff=48),
    "gqa-layernorm-silu": TransformerConfig(
        vocab_size=264, d_model=48, num_layers=2, num_heads=6, num_kv_heads=2, d_ff=40, norm="layernorm", mlp="silu"
    ),
    "mqa-periln-untied": TransformerConfig(
        vocab_size=272,
        d_model=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=1,
        d_ff=64,
        peri_ln=True,
        tie_embeddings=False,
        rope_theta=500.0,
    ),
    # Qwen2/3 and Llama 3.1 features: head_dim 12 != d_model / num_heads = 8, q/k/v and output biases, per-head q/k
    # RMSNorm, Llama 3.1 RoPE scaling (an original length of 16, so positions 0..19 cross every regime)
    "headdim-bias-qknorm-llama3": TransformerConfig(
        vocab_size=264,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        qkv_bias=True,
        out_bias=True,
        qk_norm=True,
        d_ff=48,
        rope_scaling="llama3",
        rope_factor=4.0,
        rope_original_max_len=16,
    ),
}


def _params(model):
    return {
        ".".join(map(str, k)): np.asarray(v.get_value(), np.float64)
        for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def numpy_forward(cfg: TransformerConfig, p: dict, tokens: np.ndarray) -> np.ndarray:
    """Float64 reference written from the formulas (not from core.model): returns logits [B, T, V]."""
    b, t = tokens.shape
    hd, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def norm(x, prefix):
        if cfg.norm == "layernorm":
            x = x - x.mean(-1, keepdims=True)
            y = x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps)
            return y * p[prefix + ".scale"] + p[prefix + ".bias"]
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * p[prefix + ".scale"]

    def scaled(f):  # Llama 3.1's rule for one frequency
        wavelength, big = 2 * np.pi / f, cfg.rope_original_max_len
        if wavelength < big / cfg.rope_high_freq_factor:
            return f
        if wavelength > big / cfg.rope_low_freq_factor:
            return f / cfg.rope_factor
        smooth = (big / wavelength - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        return (1 - smooth) * f / cfg.rope_factor + smooth * f

    def rope(x):  # x [B, T, N, D]
        pos = np.arange(t)[:, None]
        freq = cfg.rope_theta ** (-np.arange(hd // 2) * 2.0 / hd)
        if cfg.rope_scaling == "llama3":
            freq = np.array([scaled(f) for f in freq])
        ang = (pos * freq)[None, :, None, :]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)

    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    x = p["embedding"][tokens]
    for layer in range(cfg.num_layers):
        pre = f"blocks.{layer}"
        a = norm(x, pre + ".attn_norm")
        q, k, v = (a @ p[f"{pre}.attn.{n}.kernel"] + p.get(f"{pre}.attn.{n}.bias", 0.0) for n in "qkv")
        q, k, v = q.reshape(b, t, h, hd), k.reshape(b, t, kv, hd), v.reshape(b, t, kv, hd)
        if cfg.qk_norm:  # RMSNorm over each head's hd values
            q = q / np.sqrt((q * q).mean(-1, keepdims=True) + cfg.norm_eps) * p[pre + ".attn.q_norm.scale"]
            k = k / np.sqrt((k * k).mean(-1, keepdims=True) + cfg.norm_eps) * p[pre + ".attn.k_norm.scale"]
        q, k = rope(q), rope(k)
        out = np.zeros((b, t, h, hd))
        for head in range(h):
            g = head // (h // kv)
            s = np.einsum("btd,bsd->bts", q[:, :, head], k[:, :, g]) / np.sqrt(hd)
            s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, :, head] = np.einsum("bts,bsd->btd", w, v[:, :, g])
        y = out.reshape(b, t, h * hd) @ p[pre + ".attn.o.kernel"] + p.get(pre + ".attn.o.bias", 0.0)
        x = x + (norm(y, pre + ".attn_out_norm") if cfg.peri_ln else y)
        f = norm(x, pre + ".ffn_norm")
        if cfg.mlp == "swiglu":
            z = silu(f @ p[pre + ".ffn.gate.kernel"]) * (f @ p[pre + ".ffn.up.kernel"])
        else:
            z = silu(f @ p[pre + ".ffn.up.kernel"])
        y = z @ p[pre + ".ffn.down.kernel"]
        x = x + (norm(y, pre + ".ffn_out_norm") if cfg.peri_ln else y)
    x = norm(x, "final_norm")
    return x @ (p["embedding"].T if cfg.tie_embeddings else p["head.kernel"])


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shape", [(1, 1), (2, 7), (3, 20)])
def test_forward_matches_float64_numpy(name, shape):
    cfg = CONFIGS[name]
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    # Non-trivial norm scales/biases so that every parameter matters.
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] in ("scale", "bias"):
            var.set_value(var.get_value() + 0.3 * jax.random.normal(jax.random.key(len(path)), var.shape))
    tokens = np.asarray(jax.random.randint(jax.random.key(1), shape, 0, 259))
    logits, aux, cache = forward(model, jnp.asarray(tokens), None)
    assert aux == {} and cache is None and logits.dtype == jnp.float32
    ref = numpy_forward(cfg, _params(model), tokens)
    np.testing.assert_allclose(np.asarray(logits), ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("t, heads, kv_heads, blocks", [(20, 4, 2, 4), (7, 3, 1, 3), (3, 2, 2, 4), (16, 2, 1, 1)])
def test_causal_attention_and_its_gradients_equal_float64(t, heads, kv_heads, blocks):
    """core.attention.causal_attention's row blocks (ragged: T not a multiple of the blocks, fewer rows than blocks,
    one block) give the attention and the gradients of q, k, v of a float64 softmax over the causal mask."""
    rng = np.random.default_rng(t)
    q, k, v = (rng.normal(size=(2, t, n, 8)) for n in (heads, kv_heads, kv_heads))
    ct = rng.normal(size=q.shape)

    def reference(q, k, v):
        rep = heads // kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(8.0)
        s = jnp.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)

    def loss(fn, *qkv):
        return jnp.sum(fn(*qkv) * ct)

    ours = functools.partial(attention_lib.causal_attention, blocks=blocks)
    value, grads = jax.value_and_grad(functools.partial(loss, ours), argnums=(0, 1, 2))(
        *(jnp.asarray(a, jnp.float32) for a in (q, k, v))
    )
    with jax.enable_x64(True):
        ref, ref_grads = jax.value_and_grad(functools.partial(loss, reference), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_causal(name):
    """Changing token j changes no logit at positions < j, and does change position j."""
    cfg = CONFIGS[name]
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 256)
    base = forward(model, tokens, None)[0]
    for j in (0, 5, 15):
        changed = tokens.at[:, j].set((tokens[:, j] + 17) % 256)
        out = forward(model, changed, None)[0]
        np.testing.assert_array_equal(np.asarray(out[:, :j]), np.asarray(base[:, :j]))
        assert np.abs(np.asarray(out[:, j] - base[:, j])).max() > 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decode_matches_full_forward(name):
    """Prefill of ragged prompts then one token at a time gives the logits of the full uncached forward."""
    cfg = CONFIGS[name]
    model = Transformer(cfg, rngs=nnx.Rngs(4))
    full = jax.random.randint(jax.random.key(5), (3, 12), 0, 256)
    ref = np.asarray(forward(model, full, None)[0])
    lengths = jnp.array([3, 7, 5])
    cache = DenseKVCache.create(
        num_layers=cfg.num_layers,
        batch=3,
        capacity=16,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=jnp.float32,
    )
    logits, _, cache = forward(model, full[:, :7], cache)  # padded prefill (row 0 and 2 hold extra tokens)
    cache = cache.advance(lengths - 7)
    for b, n in enumerate([3, 7, 5]):
        np.testing.assert_allclose(np.asarray(logits[b, :n]), ref[b, :n], rtol=1e-4, atol=1e-5)
    # Each sequence continues with its own next tokens, from its own length.
    for _step in range(4):
        pos = np.asarray(cache.lengths)
        nxt = full[jnp.arange(3), pos][:, None]
        logits, _, cache = forward(model, nxt, cache)
        for b in range(3):
            np.testing.assert_allclose(np.asarray(logits[b, 0]), ref[b, pos[b]], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.array([7, 11, 9]))


def test_generate_greedy_matches_recompute():
    """Greedy cached generation equals argmax decoding by full recomputation (specials other than EOS masked)."""
    cfg = CONFIGS["gqa-layernorm-silu"]
    model = Transformer(cfg, rngs=nnx.Rngs(6))
    prompts = [np.array([257, 10, 20, 30]), np.array([257, 99])]
    out = generate_lib.generate(
        model,
        prompts,
        max_new_tokens=6,
        key=jax.random.key(0),
        cache_factory=generate_lib.dense_cache_factory(model, jnp.float32),
        tokenizer=ByteTokenizer(),
    )
    ids = np.arange(cfg.vocab_size)
    forward = jax.jit(lambda t: model(t)[0])  # causal: positions after the last real token do not matter
    for b, prompt in enumerate(prompts):
        buf = np.full((1, len(prompt) + 6), 65, np.int32)
        buf[0, : len(prompt)] = prompt
        for i in range(6):
            logits = np.asarray(forward(jnp.asarray(buf))[0, len(prompt) + i - 1]).copy()
            logits[(ids >= 256) & (ids != 258)] = -np.inf
            assert out[b, i] == int(np.argmax(logits)), (b, i)
            if out[b, i] == 258:
                assert (out[b, i + 1 :] == 256).all()
                break
            buf[0, len(prompt) + i] = out[b, i]


def test_generate_validates_input():
    model = Transformer(CONFIGS["mha-rms"], rngs=nnx.Rngs(0))
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match=r"missing \['eos_id', 'never', 'num_ids'\]"):  # no byte-tokenizer defaults
        generate_lib.generate(model, [np.array([1])], max_new_tokens=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="at least one token"):
        generate_lib.generate(model, [np.array([], np.int32)], max_new_tokens=2, key=jax.random.key(0), tokenizer=tok)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_lib.generate(model, [np.array([1])], max_new_tokens=0, key=jax.random.key(0), tokenizer=tok)


@dataclasses.dataclass(frozen=True)
class RecordingPrecision:
    """Scales every product by `factor` on the chosen paths and records the paths and keys it was asked for."""

    log: list = dataclasses.field(default_factory=list, hash=False, compare=False)
    factor: float = 1.0
    paths: tuple = ()

    def dot_general(self, path, key):
        self.log.append((path, None if key is None else tuple(np.asarray(jax.random.key_data(key)).ravel())))
        scale = self.factor if path in self.paths else 1.0
        return lambda *a, **kw: scale * jax.lax.dot_general(*a, **kw)

    def grouped_matmul(self, path, key):
        raise NotImplementedError("the dense models these tests record have no experts")


def test_precision_slot_reaches_every_projection():
    cfg = CONFIGS["mqa-periln-untied"]
    precision = RecordingPrecision()
    model = Transformer(cfg, rngs=nnx.Rngs(0), precision=precision)
    tokens = jnp.ones((1, 4), jnp.int32)
    model(tokens, key=jax.random.PRNGKey(1))
    paths = [p for p, _ in precision.log]
    expected = {
        f"blocks.{i}.{m}"
        for i in range(3)
        for m in ("attn.q", "attn.k", "attn.v", "attn.o", "ffn.gate", "ffn.up", "ffn.down")
    } | {"head"}
    assert set(paths) == expected and len(paths) == len(expected)
    keys = [k for _, k in precision.log]
    assert len(set(keys)) == len(keys), "each projection gets its own key"
    precision.log.clear()
    base = forward(model, tokens)[0]  # (recorded while tracing)
    assert {p for p, _ in precision.log} == expected and all(k is None for _, k in precision.log)
    # Changing the dot_general of one projection changes the output: the slot is really used.
    scaled = Transformer(cfg, rngs=nnx.Rngs(0), precision=RecordingPrecision(factor=2.0, paths=("blocks.1.ffn.up",)))
    assert np.abs(np.asarray(forward(scaled, tokens)[0] - base)).max() > 1e-5
    a, b = jax.random.normal(jax.random.key(0), (2, 3)), jax.random.normal(jax.random.key(1), (3, 4))
    product = DefaultPrecision().dot_general("x", None)(a, b, (((1,), (0,)), ((), ())))
    np.testing.assert_allclose(np.asarray(product), np.asarray(a, np.float64) @ np.asarray(b, np.float64), rtol=1e-5)


class AuxFFN(nnx.Module):
    """An FFN-slot module: a scaled identity that reports an auxiliary loss and a statistic."""

    def __init__(self, layer, path, rngs):
        self.w = nnx.Param(jnp.full((), 0.5), axes=())
        self.layer = layer

    def __call__(self, x, *, key=None):
        return self.w.get_value() * x, {
            "loss/aux": jnp.float32(self.layer + 1),
            "metric": jnp.float32(2 * self.layer + 1),
        }


def test_ffn_slot_and_aux_losses():
    from core.train import lm_loss

    cfg = CONFIGS["mha-rms"]
    model = Transformer(cfg, rngs=nnx.Rngs(0), ffn_factory=AuxFFN)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(2, 9)), jnp.int32)
    _logits, aux, _ = forward(model, tokens[:, :-1])
    # Losses add up over the layers; statistics are averaged over the layers that report them.
    assert float(aux["loss/aux"]) == 1.0 + 2.0 and float(aux["metric"]) == (1.0 + 3.0) / 2
    objective, metrics = nnx.jit(lm_loss)(model, tokens)
    np.testing.assert_allclose(float(objective), float(metrics["loss"]) + 3.0, rtol=1e-6)
    assert count_params(model) == (264 * 32 + 2 * (4 * 32 * 32 + 2 * 32 + 1) + 32)
