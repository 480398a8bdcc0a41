"""Head dims 80 and 96 (Phi-2's and Phi-3's heads) in every KV format: stored padded with zeros to the format's Dp.

Checked per format and D in (80, 96): the padded head dim and the bytes per token against the hand-computed sizes
(and the capacity planner and the pool using them); the round trip equals that of the same data padded by hand to
128 columns, bit for bit, and stays within the format's error bound; the zero padding adds nothing to a score
(q_pad . k_pad = 0, or under the Hadamard rotation (q_pad H) . (k_pad H) = q . k); the XLA reference decode equals
float64 attention over the dequantised K/V at the model's scale 1 / sqrt(D) (and, for bf16, the unquantised
attention within bf16 rounding); the Triton kernels (interpreted) and the TPU kernel (TPU interpret mode) equal the
reference at D = 96, the quantise-and-write kernel bit for bit. By default the kernels run for fp8 (Dp = 96, not a
power of two) and fp4 (Dp = 128, rotated K); every format, both head dims and the unified kernels are marked `slow`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kvcache_attention import make_case

from core import lowbit
from kvcache import PagedPool, capacity, formats, reference, split
from kvcache.kernels import attention as triton_attention
from kvcache.kernels import tpu_attention
from kvcache.kernels import write as write_kernel

HEAD_DIMS = (80, 96)
# Dp per format (both head dims) and the bytes one token and KV head takes at Dp (K side + V side), by hand.
PADDED = {"bf16": 96, "fp8": 96, "fp4": 128, "nvfp4": 128, "k8v4": 128}
BYTES = {
    "bf16": lambda dp: 2 * (2 * dp),
    "fp8": lambda dp: 2 * (dp + 4),
    "fp4": lambda dp: 2 * (dp // 2 + dp // 32),
    "nvfp4": lambda dp: 2 * (dp // 2 + dp // 16),
    "k8v4": lambda dp: (dp + 4) + (dp // 2 + dp // 32),
}
# Relative RMS round-trip error each format stays within (bf16: 8 significant bits; E4M3: 4; 4-bit codes).
BOUND = {"bf16": 2.0**-8, "fp8": 2.0**-4, "fp4": 0.2, "nvfp4": 0.2, "k8v4": 0.2}
KERNEL_FORMATS = [
    pytest.param(n, marks=() if n in ("fp8", "fp4") else pytest.mark.slow) for n in formats.NAMES
]  # fp8: Dp = 96; fp4: Dp = 128 and a rotated K

_quantize = jax.jit(lambda fmt, k, v: fmt.quantize(k, v), static_argnums=0)
_deq = jax.jit(lambda fmt, fields, rotated: fmt.dequantize(fields, rotated=rotated), static_argnums=(0, 2))
_prepare = jax.jit(lambda fmt, q: fmt.prepare_query(q), static_argnums=0)
_stored = jax.jit(lambda fmt, k, v: fmt.dequantize(fmt.quantize(k, v), rotated=True), static_argnums=0)
_ref_decode = jax.jit(reference.decode_attention, static_argnames=("fmt",))
_ref_unified = jax.jit(reference.unified_attention, static_argnames=("fmt", "max_query_len"))
_split_decode = jax.jit(split.decode_attention, static_argnames=("fmt", "blocks_per_partition"))


def _kv(shape, seed):
    """Random K (per-token magnitudes over two decades) and V, float32, no zeros."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=shape) * 10.0 ** rng.uniform(-1, 1, size=shape[:-1] + (1,))
    return k.astype(np.float32), rng.normal(size=shape).astype(np.float32)


def _pad(x, width):
    return np.concatenate([x, np.zeros((*x.shape[:-1], width - x.shape[-1]), x.dtype)], axis=-1)


@pytest.mark.parametrize("name", formats.NAMES)
def test_padded_head_dim_and_bytes(name):
    """Dp and the stored bytes at D = 80 and 96 are the hand-computed padded sizes; the pool's fields and the
    capacity planner use them; head dims the format stores as they are keep Dp = D."""
    fmt = formats.get(name)
    for d in HEAD_DIMS:
        dp = PADDED[name]
        assert fmt.padded_head_dim(d) == dp
        assert fmt.bytes_per_token(2, d) == 2 * BYTES[name](dp) == fmt.bytes_per_token(2, dp)
        shape = capacity.ModelShape(3, 2, d)
        assert capacity.kv_bytes_per_token(shape, fmt) == 3 * 2 * BYTES[name](dp)
        pool = PagedPool.create(fmt, num_layers=3, num_kv_heads=2, head_dim=d, block_size=16, num_blocks=2)
        assert pool.nbytes == 2 * 16 * 3 * 2 * BYTES[name](dp)
        assert fmt.head_dim_of(pool.layer(0)) == dp
    for d in (64, 128):
        assert fmt.padded_head_dim(d) == d


@pytest.mark.parametrize(
    "name,head_dim,allowed",
    [("fp4", 48, "multiple of 64"), ("nvfp4", 112, "multiple of 64"), ("fp4", 192, "power of two")],
)
def test_other_head_dims_are_refused(name, head_dim, allowed):
    """A head dim neither stored as it is nor padded: one error naming head_dim, its value and what is allowed."""
    with pytest.raises(ValueError, match=rf"head_dim = {head_dim}: .*{allowed}.*or one of \[80, 96\]"):
        formats.get(name).bytes_per_token(1, head_dim)


def test_dequantize_refuses_cutting_the_rotated_basis():
    """The padding is not a set of columns in a rotated basis: asking for D there is refused (shapes only)."""
    fmt = formats.get("fp4")
    fields = {n: jax.ShapeDtypeStruct(shape, dtype) for n, (shape, dtype) in fmt.fields(2, 96).items()}
    assert jax.eval_shape(lambda f: fmt.dequantize(f, head_dim=96), fields)[0].shape == (2, 96)
    with pytest.raises(ValueError, match=r"head_dim = 96; allowed: the stored 128"):
        jax.eval_shape(lambda f: fmt.dequantize(f, rotated=True, head_dim=96), fields)


@pytest.mark.parametrize("name", formats.NAMES)
def test_round_trip_equals_hand_padded_and_is_bounded(name):
    """quantize at D stores exactly the bytes of the same data padded by hand to 128 columns (bf16 / fp8: their
    first Dp = 96, the rest zeros); the round trip's first D columns are the hand-padded data's, bit for bit, and
    stay within the format's error bound."""
    fmt = formats.get(name)
    for d, seed in zip(HEAD_DIMS, (1, 2)):
        k, v = _kv((5, 2, d), seed)
        got = _quantize(fmt, jnp.asarray(k), jnp.asarray(v))
        want = _quantize(fmt, jnp.asarray(_pad(k, 128)), jnp.asarray(_pad(v, 128)))
        for n in want:
            g, w = np.asarray(got[n])[..., None].view(np.uint8), np.asarray(want[n])[..., None].view(np.uint8)
            if g.shape != w.shape:  # bf16 / fp8 codes: 96 stored columns of the hand-padded 128
                assert g.ndim == 4 and not w[:, :, g.shape[2] :].any(), n
                w = w[:, :, : g.shape[2]]
            np.testing.assert_array_equal(g, w, n)
        k_hat, v_hat = (np.asarray(x)[..., :d] for x in _deq(fmt, got, False))
        k128, v128 = (np.asarray(x)[..., :d] for x in _deq(fmt, want, False))
        np.testing.assert_array_equal(k_hat, k128)
        np.testing.assert_array_equal(v_hat, v128)
        for x, x_hat in ((k, k_hat), (v, v_hat)):
            err = np.sqrt(np.mean((x_hat - x) ** 2, axis=-1) / np.mean(x.astype(np.float64) ** 2, axis=-1))
            assert err.max() <= BOUND[name], (d, err.max())


@pytest.mark.parametrize("name", formats.NAMES)
def test_zero_padding_adds_nothing_to_scores(name):
    """The prepared query is the hand-padded query's, bit for bit; unrotated, its padding columns and the stored
    keys' are zeros (q_pad . k_pad = 0 exactly); rotated (fp4), (q_pad H) . (k_pad H) = q . k in float64."""
    fmt = formats.get(name)
    rng = np.random.default_rng(3)
    for d in HEAD_DIMS:
        dp = PADDED[name]
        q = rng.normal(size=(5, 2, d)).astype(np.float32)
        qp = np.asarray(_prepare(fmt, jnp.asarray(q)))
        assert qp.shape == (5, 2, dp)
        np.testing.assert_array_equal(qp, np.asarray(_prepare(fmt, jnp.asarray(_pad(q, dp)))))
        k, v = _kv((5, 2, d), seed=d)
        if fmt.rotation(d) is None:  # the stored basis is the model's, padded
            keys = np.asarray(_deq(fmt, _quantize(fmt, jnp.asarray(k), jnp.asarray(v)), False)[0])
            assert np.all(qp[..., d:] == 0) and np.all(keys[..., d:] == 0)
            np.testing.assert_array_equal(np.sum(qp[..., d:] * keys[..., d:], -1), 0.0)
        else:
            h = lowbit.hadamard(dp, normalized=True)
            qh, kh = _pad(q.astype(np.float64), dp) @ h, _pad(k.astype(np.float64), dp) @ h
            np.testing.assert_allclose(np.sum(qh * kh, -1), np.sum(q * k.astype(np.float64), -1), rtol=1e-12, atol=1e-9)


def _float64_attention(q, k, v, q_pos, groups, head_dim):
    """float64 softmax(q k^T / sqrt(head_dim)) v of queries q [n, H, Dq] at positions q_pos over [S, K, Dq]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    s = np.einsum("nhd,shd->nhs", q, k) / np.sqrt(head_dim)
    s = np.where(np.arange(k.shape[0])[None, None] <= np.asarray(q_pos)[:, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("nhs,shd->nhd", p / p.sum(-1, keepdims=True), v)


SEQ_LENS, GROUPS, NUM_KV = [1, 15, 33], 2, 2


@pytest.mark.parametrize("name", formats.NAMES)
def test_reference_decode_matches_float64(name):
    """The XLA reference decode at D equals float64 attention over the dequantised K/V and the prepared query in
    the stored basis (Dp columns, scale 1 / sqrt(D)), cut to D; bf16 also the unquantised attention (bf16
    tolerance). The split-KV XLA decode (two blocks per partition) equals the reference."""
    fmt = formats.get(name)
    for d in HEAD_DIMS:
        q, fields, tables, seq_lens, _qsl, kvs = make_case(
            fmt, SEQ_LENS, [1] * 3, num_kv=NUM_KV, groups=GROUPS, head_dim=d, seed=d
        )
        out = np.asarray(_ref_decode(q, fields, tables, seq_lens, fmt=fmt))
        assert out.shape == (3, NUM_KV * GROUPS, d)
        got = _split_decode(q, fields, tables, seq_lens, fmt=fmt, blocks_per_partition=2)
        np.testing.assert_allclose(np.asarray(got), out, rtol=1e-5, atol=1e-5)
        q_prep = np.asarray(_prepare(fmt, q))
        k_all, v_all = (jnp.asarray(np.concatenate([kv[i] for kv in kvs]), jnp.float32) for i in (0, 1))
        k_hat_all, v_hat_all = (np.asarray(x) for x in _stored(fmt, k_all, v_all))  # [S, K, Dp], stored basis
        starts = np.cumsum([0] + SEQ_LENS)
        for b, (k, v) in enumerate(kvs):
            k_hat, v_hat = k_hat_all[starts[b] : starts[b + 1]], v_hat_all[starts[b] : starts[b + 1]]
            pos = [SEQ_LENS[b] - 1]
            want = _float64_attention(q_prep[b : b + 1], k_hat, v_hat, pos, GROUPS, d)[..., :d]
            np.testing.assert_allclose(out[b : b + 1], want, rtol=2e-5, atol=2e-5)
            if name == "bf16":
                exact = _float64_attention(np.asarray(q)[b : b + 1], k, v, pos, GROUPS, d)
                np.testing.assert_allclose(out[b : b + 1], exact, rtol=2e-2, atol=2e-2)


def _kernel_case(fmt, d, q_lens):
    return make_case(fmt, SEQ_LENS, q_lens, num_kv=NUM_KV, groups=GROUPS, head_dim=d, seed=d + 1)


def _check_kernels(name, d):
    fmt = formats.get(name)
    q, fields, tables, seq_lens, _qsl, kvs = _kernel_case(fmt, d, [1] * 3)
    want = np.asarray(_ref_decode(q, fields, tables, seq_lens, fmt=fmt))
    got = triton_attention.decode_attention(q, fields, tables, seq_lens, fmt=fmt, partitions=2, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    got = tpu_attention.decode_attention(q, fields, tables, seq_lens, fmt=fmt, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # The write kernel stores the XLA write's bytes (the rows padded and rotated before it).
    k = jnp.asarray(np.concatenate([a for a, _ in kvs]), jnp.float32)[:9]
    v = jnp.asarray(np.concatenate([b for _, b in kvs]), jnp.float32)[:9]
    slots = jnp.asarray(np.array([3, 17, -1, 40, 0, 50, 51, 52, 20], np.int32))
    ref = reference.write(fields, k, v, slots, fmt=fmt)
    out = write_kernel.write(fields, k, v, slots, fmt=fmt, interpret=True)
    for n in ref:
        np.testing.assert_array_equal(np.asarray(out[n]).view(np.uint8), np.asarray(ref[n]).view(np.uint8), n)


@pytest.mark.parametrize("name", KERNEL_FORMATS)
def test_kernels_match_reference_at_96(name):
    """At D = 96 the Triton decode kernel (interpreted, two partitions) and the TPU decode kernel (TPU interpret
    mode) equal the XLA reference; the Triton write kernel stores the XLA write's bytes."""
    _check_kernels(name, 96)


@pytest.mark.slow
@pytest.mark.parametrize("name", formats.NAMES)
def test_kernels_match_reference_at_80(name):
    """As at 96, at D = 80 (bf16 / fp8 pad to 96, the 4-bit formats to 128)."""
    _check_kernels(name, 80)


@pytest.mark.slow
@pytest.mark.parametrize("name", formats.NAMES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_unified_kernels_match_reference(name, d):
    """The unified kernels (prefill chunks and decode) equal the reference at D = 80 and 96."""
    fmt = formats.get(name)
    q_lens = [1, 3, 20]
    q, fields, tables, seq_lens, qsl, _ = _kernel_case(fmt, d, q_lens)
    want = np.asarray(_ref_unified(q, fields, tables, seq_lens, qsl, fmt=fmt, max_query_len=20))
    got = triton_attention.unified_attention(
        q, fields, tables, seq_lens, qsl, fmt=fmt, max_query_len=20, interpret=True
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    got = tpu_attention.unified_attention(q, fields, tables, seq_lens, qsl, fmt=fmt, max_query_len=20, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def _lower(kernel, name, d):
    """StableHLO text of one kernel at head dim d over abstract arguments (8 pool blocks of 16 slots, 2 KV heads,
    4 query heads): the Triton kernels for "cuda", the TPU kernel for "tpu"."""
    fmt = formats.get(name)
    fields = {n: jax.ShapeDtypeStruct((8, 2, 16, *s[1:]), dt) for n, (s, dt) in fmt.fields(2, d).items()}
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    if kernel == "write":
        fn = jax.jit(lambda *a: write_kernel.write(*a, fmt=fmt, interpret=False))
        return fn.trace(fields, f32(7, 2, d), f32(7, 2, d), i32(7)).lower(lowering_platforms=("cuda",)).as_text()
    module = triton_attention if kernel == "triton" else tpu_attention
    kw = dict(device="h100") if kernel == "triton" else {}
    fn = jax.jit(lambda *a: module.unified_attention(*a, fmt=fmt, max_query_len=3, partitions=2, interpret=False, **kw))
    platform = "cuda" if kernel == "triton" else "tpu"
    traced = fn.trace(f32(5, 4, d), fields, i32(3, 4), i32(3), i32(4))
    return traced.lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize(
    "name,d",
    [("bf16", 96)]
    + [pytest.param(n, d, marks=pytest.mark.slow) for n in formats.NAMES for d in HEAD_DIMS if (n, d) != ("bf16", 96)],
)
def test_kernels_lower_at_padded_head_dims(name, d):
    """The kernels lower for the accelerators at the stored head dim: Triton takes only power-of-two arrays, and
    bf16's Dp = 96 is not one (the write kernel stores rows 32 columns at a time); the TPU kernel's blocks are
    [rows, Dp]."""
    for kernel, marker in (("write", "xla.gpu.triton"), ("triton", "xla.gpu.triton"), ("tpu", "tpu_custom_call")):
        assert marker in _lower(kernel, name, d), (kernel, name, d)
