"""KV formats against independent NumPy float64 quantisers; the slot layout; the rotation; error bounds. The shared
numerics (E2M1 codes, powers of two, E4M3, Hadamard) are tested against ml_dtypes and NumPy in test_lowbit.py."""

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from core import lowbit
from kvcache import PagedPool, capacity, codecs, decode_attention, formats
from kvcache import write as kv_write

LEVELS = np.array(formats.E2M1_LEVELS)
# the format's functions as the cache runs them: jitted (one program per format and shape, not one per operation)
_quantize = jax.jit(lambda fmt, k, v: fmt.quantize(k, v), static_argnums=0)
_dequantize = jax.jit(lambda fmt, fields, rotated=False: fmt.dequantize(fields, rotated=rotated), static_argnums=(0, 2))
_prepare_query = jax.jit(lambda fmt, q: fmt.prepare_query(q), static_argnums=0)


def _round_trip(fmt, k, v, rotated=False):
    return _dequantize(fmt, _quantize(fmt, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32)), rotated)


def numpy_e2m1(x: np.ndarray) -> np.ndarray:
    """Nearest E2M1 value by brute force over the levels, ties to the even magnitude index, saturating at 6."""
    a = np.minimum(np.abs(x), 6.0)
    dist = np.abs(a[..., None] - LEVELS)
    best = dist.min(-1, keepdims=True)
    candidates = np.where(dist == best, np.arange(8), 99)
    even = np.where(candidates % 2 == 0, candidates, 99).min(-1)
    idx = np.where(even < 99, even, candidates.min(-1))
    return np.sign(x) * LEVELS[idx]


def numpy_fp4(x: np.ndarray, rule: str) -> np.ndarray:
    """UltraQuant fp4 of x [..., D] in float64: per 32 elements a power-of-two scale by the rule, then E2M1."""
    g = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    out = np.zeros_like(g)
    for idx in np.ndindex(g.shape[:-1]):
        a = np.abs(g[idx]).max()
        if a == 0:
            continue
        e = math.floor(math.log2(a)) - 2 if rule == "mx" else math.floor(math.log2(0.156 * a) + 0.5)
        out[idx] = numpy_e2m1(g[idx] / 2.0**e) * 2.0**e
    return out.reshape(x.shape)


def _kv(shape, seed=0, spread=True):
    rng = np.random.default_rng(seed)
    k, v = rng.normal(size=shape), rng.normal(size=shape)
    if spread:  # per-token magnitudes over 4 decades, an outlier channel, zeros and a negative zero
        k *= 10.0 ** rng.uniform(-2, 2, size=shape[:-1] + (1,))
        k[..., 7] *= 20.0
        k[0, 0, :32] = 0.0
        k[0, 0, 40] = -0.0
    return k.astype(np.float32), v.astype(np.float32)


def test_kernel_numerics_are_core_lowbit():
    """The names kernels import from kvcache.formats are core.lowbit's functions (one implementation), and the
    format's constants are core.lowbit's."""
    for name in ("encode_e2m1", "decode_e2m1", "pow2"):
        assert getattr(formats, name) is getattr(lowbit, name), name
    assert lowbit.GRIDS["e2m1"] == formats.E2M1_LEVELS and formats.E4M3_MAX == lowbit.E4M3_MAX
    s = jnp.arange(1, 254)
    np.testing.assert_array_equal(formats.scale_value(s), 2.0 ** (np.arange(1, 254) - 127.0))


@pytest.mark.parametrize("rule", formats.SCALE_RULES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp4_matches_numpy_element_for_element(rule, head_dim):
    """fp4 dequantised V (and K without rotation) equal the float64 NumPy quantiser exactly, both scale rules."""
    k, v = _kv((3, 2, head_dim), seed=head_dim)
    fmt = formats.get("fp4", scale_rule=rule, rotate_k=False)
    k_hat, v_hat = _round_trip(fmt, k, v)
    np.testing.assert_array_equal(np.asarray(k_hat, np.float64), numpy_fp4(k, rule))
    np.testing.assert_array_equal(np.asarray(v_hat, np.float64), numpy_fp4(v, rule))


def test_scale_exponent_is_exact_at_powers_of_two():
    """The mx rule's floor(log2 a) - 2 is exact at and next to powers of two over the whole normal range (float32
    log2 alone rounds across integers there), clipped to [-126, 126] at both ends (2^127 <= a < 2^128 has exponent
    125); 0 for a zero group."""
    k = np.arange(-126, 128)
    p = (2.0**k).astype(np.float32)
    a = np.concatenate([p, np.nextafter(p, np.float32(0)), np.nextafter(p, np.float32(np.inf))])
    a = a[np.isfinite(a) & (a >= 2.0**-126)]  # a subnormal absmax reads as 0 where the platform flushes
    exponent = jax.jit(formats.ue8m0_exponent, static_argnums=1)
    e = np.asarray(exponent(jnp.asarray(a), "mx"))
    np.testing.assert_array_equal(e, np.clip(np.frexp(a.astype(np.float64))[1] - 1 - 2, -126, 126))
    assert int(exponent(jnp.float32(np.finfo(np.float32).max), "mx")) == 125
    assert int(exponent(jnp.float32(0.0), "mx")) == 0
    assert int(exponent(jnp.float32(1e38), "mse")) == 124  # round(log2(0.156e38))


def test_fp4_error_bound_mx():
    """OCP rule: a / s in [4, 8), so every element errs by at most s (half E2M1's widest step, 2) below 6 s and
    by at most 2 s where it saturates: |x - q| <= 2 s = absmax / 2 at worst, s otherwise."""
    k, v = _kv((4, 2, 128), seed=1)
    fmt = formats.get("fp4", scale_rule="mx", rotate_k=False)
    _, v_hat = _round_trip(fmt, k, v)
    g, err = v.reshape(4, 2, 4, 32), np.abs(np.asarray(v_hat) - v).reshape(4, 2, 4, 32)
    s = 2.0 ** (np.floor(np.log2(np.abs(g).max(-1, keepdims=True))) - 2)
    assert (err <= np.where(np.abs(g) > 6 * s, 2 * s, s) + 1e-7).all()


def test_fp8_error_bound():
    """E4M3 has 3 mantissa bits: relative error <= 2^-4 in the normal range, absolute <= 2^-10 s below it."""
    k, v = _kv((5, 3, 64), seed=2)
    fmt = formats.get("fp8")
    fields = _quantize(fmt, jnp.asarray(k), jnp.asarray(v))
    k_hat, _ = _dequantize(fmt, fields)
    scale = np.abs(k).max(-1, keepdims=True) / 448.0
    np.testing.assert_allclose(np.asarray(fields["k_scale"])[..., None], scale, rtol=1e-6)
    err = np.abs(np.asarray(k_hat) - k)
    assert (err <= 2.0**-4 * np.abs(k) + 2.0**-10 * scale + 1e-12).all()
    assert np.abs(np.asarray(k_hat)).max(-1).min() > 0  # the largest entry survives


def test_bf16_error_bound():
    k, v = _kv((2, 2, 64), seed=3)
    fmt = formats.get("bf16")
    k_hat, _v_hat = _round_trip(fmt, k, v)
    assert (np.abs(np.asarray(k_hat) - k) <= 2.0**-8 * np.abs(k)).all()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotation_is_orthonormal_and_keeps_scores(head_dim):
    """H / sqrt(D) is a symmetric orthogonal +-1/sqrt(D) matrix; rotating q and k by it leaves q.k unchanged; fp4's
    dequantised K rotated back approximates K better than without rotation on outlier channels."""
    h = formats.hadamard(head_dim).astype(np.float64)
    assert formats.hadamard(head_dim).dtype == np.float32
    np.testing.assert_array_equal(h, lowbit.hadamard(head_dim, normalized=True).astype(np.float32))
    np.testing.assert_allclose(h @ h.T, np.eye(head_dim), atol=1e-12)
    rng = np.random.default_rng(head_dim)
    q, k = rng.normal(size=(6, head_dim)), rng.normal(size=(6, head_dim))
    fmt = formats.get("fp4", fp8_query=False)
    q_rot = np.asarray(_prepare_query(fmt, jnp.asarray(q, jnp.float32)), np.float64)
    np.testing.assert_allclose((q_rot * (k @ h)).sum(-1), (q * k).sum(-1), rtol=1e-5, atol=1e-5)
    k_rot_hat, _ = _round_trip(fmt, k, k, rotated=True)
    k_hat, _ = _round_trip(fmt, k, k)
    np.testing.assert_allclose(np.asarray(k_hat, np.float64), np.asarray(k_rot_hat, np.float64) @ h, atol=1e-5)


def test_rotation_helps_outlier_channels():
    """Synthetic K with two outlier channels: the rotated fp4 K has a smaller error than the unrotated one."""
    rng = np.random.default_rng(0)
    k = rng.normal(size=(256, 1, 128)) * np.where(np.isin(np.arange(128), [5, 77]), 20.0, 1.0)
    errors = {}
    for rotate in (False, True):
        fmt = formats.get("fp4", rotate_k=rotate)
        k_hat, _ = _round_trip(fmt, k, k)
        errors[rotate] = np.linalg.norm(np.asarray(k_hat) - k) / np.linalg.norm(k)
    assert errors[True] < errors[False], errors


def test_fp8_query_rounds_to_e4m3_values():
    q = jnp.asarray(np.random.default_rng(0).normal(size=(4, 64)) * 30, jnp.float32)
    prepared = _prepare_query(formats.get("fp4"), q)
    np.testing.assert_array_equal(prepared, prepared.astype(jnp.float8_e4m3fn).astype(jnp.float32))
    exact = _prepare_query(formats.get("fp4", fp8_query=False), q)
    assert 0 < float(jnp.max(jnp.abs(prepared - exact) / (jnp.abs(exact) + 1e-3))) <= 2.0**-4


@pytest.mark.parametrize("name,options", [("bf16", {}), ("fp8", {}), ("fp4", {}), ("fp4", {"scale_rule": "mx"})])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_slots_round_trip_and_sizes(name, options, head_dim):
    """pack -> unpack returns the same bytes; the slot is 4D (bf16), 2D + 8 (fp8), D + D/16 (fp4): 136 B at 128."""
    fmt = formats.get(name, **options)
    k, v = _kv((3, 2, head_dim), seed=4)
    fields = _quantize(fmt, jnp.asarray(k), jnp.asarray(v))
    slots = jax.jit(formats.pack_slots, static_argnums=0)(fmt, fields)
    expected = {"bf16": 4 * head_dim, "fp8": 2 * head_dim + 8, "fp4": head_dim + head_dim // 16}[name]
    assert slots.shape == (3, 2, expected) and slots.dtype == jnp.uint8
    assert fmt.bytes_per_token(2, head_dim) == 2 * expected
    back = jax.jit(formats.unpack_slots, static_argnums=(0, 2))(fmt, slots, head_dim)
    for n in fields:
        np.testing.assert_array_equal(np.asarray(back[n]).view(np.uint8), np.asarray(fields[n]).view(np.uint8))
    if name == "fp4":  # the spec's layout: K codes first, then K scales, V codes, V scales
        half = head_dim // 2
        np.testing.assert_array_equal(slots[..., :half], fields["k_codes"])
        np.testing.assert_array_equal(slots[..., half : half + head_dim // 32], fields["k_scales"])
    assert formats.get("fp4").bytes_per_token(1, 128) == 136


def test_split_half_packing():
    """Byte j holds element j in its low nibble and element j + D/2 in its high nibble."""
    v = np.zeros((1, 1, 64), np.float32)
    v[0, 0, 3], v[0, 0, 35] = 1.0, -6.0  # one group each: scale exponents chosen from these values
    fields = _quantize(formats.get("fp4", scale_rule="mx"), jnp.asarray(v), jnp.asarray(v))
    byte = int(fields["v_codes"][0, 0, 3])
    assert float(formats.decode_e2m1(jnp.uint8(byte & 15))) * 2.0 ** (0 - 2) == 1.0
    assert float(formats.decode_e2m1(jnp.uint8(byte >> 4))) * 2.0 ** (2 - 2) == -6.0


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="'fp5' unknown; allowed"):
        formats.get("fp5")
    with pytest.raises(ValueError, match="scale_rule = 'rms'"):
        formats.get("fp4", scale_rule="rms")
    with pytest.raises(ValueError, match="takes no options"):
        formats.get("fp8", scale_rule="mx")
    for head_dim in (112, 192):  # (raised while tracing: nothing runs; 80 and 96 are stored padded)
        ones = jax.ShapeDtypeStruct((1, 1, head_dim), jnp.float32)
        with pytest.raises(ValueError, match=f"head_dim = {head_dim}"):
            jax.eval_shape(formats.get("fp4").quantize, ones, ones)
    x = np.ones((1, 1, 192), np.float32)
    assert np.all(_quantize(formats.get("fp4", rotate_k=False), x, x)["k_scales"] > 0)


def test_a_new_format_is_one_definition_and_its_registration():
    """A format defined and registered here (a float32 codec for K and V, no scales) is served by name with nothing
    else changed: `get`, the capacity planner, the paged pool, quantise-on-write and decode attention, through the XLA
    reference and through the Pallas kernels (which read the codec's `kernel_groups` default and its
    `kernel_write`)."""

    class Float32(codecs.Codec):
        def fields(self, prefix, num_kv_heads, head_dim):
            return {prefix: ((num_kv_heads, head_dim), jnp.float32)}

        def encode(self, prefix, x):
            return {prefix: x.astype(jnp.float32)}

        def decode(self, fields, prefix):
            return fields[prefix]

        def kernel_write(self, outs, prefix, row, blk, h, off, head_dim):
            outs[prefix][blk, h, pl.ds(off, 1), :] = row()

    @dataclasses.dataclass(frozen=True)
    class F32(formats.Format):
        name: ClassVar[str] = "f32-test"

        def codecs(self):
            return Float32(), Float32()

    formats.register(F32)
    try:
        fmt = formats.get("f32-test")
        assert capacity.kv_bytes_per_token(capacity.ModelShape(3, 2, 64), "f32-test") == 3 * 2 * 2 * 64 * 4
        pool = PagedPool.create(fmt, num_layers=1, num_kv_heads=2, head_dim=64, num_blocks=4, block_size=16)
        rng = np.random.default_rng(7)
        k, v = (jnp.asarray(rng.normal(size=(40, 2, 64)), jnp.float32) for _ in range(2))
        q = jnp.asarray(rng.normal(size=(1, 4, 64)), jnp.float32)
        slots, tables, seq_lens = jnp.arange(40), jnp.array([[0, 1, 2, 3]]), jnp.array([40])
        outs = {}
        for impl in ("xla", "pallas"):
            fields = kv_write(pool.layer(0), k, v, slots, fmt=fmt, implementation=impl)
            np.testing.assert_array_equal(fields["k"].transpose(0, 2, 1, 3).reshape(64, 2, 64)[:40], k)
            outs[impl] = decode_attention(q, fields, tables, seq_lens, fmt=fmt, implementation=impl)
        scores = np.einsum("hd,shd->hs", np.asarray(q[0], np.float64), np.repeat(np.asarray(k), 2, axis=1)) / 8.0
        p = np.exp(scores - scores.max(-1, keepdims=True))
        want = np.einsum("hs,shd->hd", p / p.sum(-1, keepdims=True), np.repeat(np.asarray(v), 2, axis=1))
        for impl, out in outs.items():
            np.testing.assert_allclose(np.asarray(out[0]), want, rtol=2e-3, atol=2e-3, err_msg=impl)
    finally:
        del formats.REGISTRY["f32-test"]
    with pytest.raises(ValueError, match="'f32-test' unknown"):
        formats.get("f32-test")
