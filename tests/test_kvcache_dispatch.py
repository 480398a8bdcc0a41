"""The attention implementation registry: the order "auto" tries per backend, fallback on a refusal (one logged line,
the XLA reference's output), explicit refusals raising, the "pallas" alias, input refusals (concrete arrays and under
jit), and the on-chip budgets of `kvcache.kernels.budgets` against hand-computed byte counts.

Budget refusals are made before a kernel is built, so most cases here never run Pallas; one runs the Triton kernel
interpreted with a tile shrunk to fit RDNA4's LDS, and (when the Mosaic TPU module exists) one runs "pallas_tpu".
"""

import importlib.util
import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvcache import attention, formats, kernels, reference
from kvcache.attention import decode_attention, resolve, unified_attention, write
from kvcache.kernels import attention as attention_kernel
from kvcache.kernels import budgets

BS = 16
# Jitted entry points (every call of the tests that compute goes through one: op-by-op dispatch is slow). The
# choice of implementation, and its log line, happen once per trace; the value checks need eager calls.
_unified = jax.jit(
    unified_attention, static_argnames=("fmt", "implementation", "max_query_len", "partitions", "device")
)
_decode = jax.jit(decode_attention, static_argnames=("fmt", "implementation", "partitions", "device"))
_write = jax.jit(write, static_argnames=("fmt", "implementation"))
_ref_unified = jax.jit(reference.unified_attention, static_argnames=("fmt", "max_query_len"))
_ref_decode = jax.jit(reference.decode_attention, static_argnames=("fmt",))
BF16 = formats.get("bf16")
FP4 = formats.get("fp4")


def make_case(fmt, seq_lens, q_lens, *, num_kv, groups, head_dim, seed=0):
    """A one-layer pool with each sequence's tokens in shuffled blocks (written by the reference), block tables with
    a padding column, queries of the ragged batch (q_lens per sequence) and the decode queries (one per sequence)."""
    rng = np.random.default_rng(seed)
    per_seq = [-(-s // BS) for s in seq_lens]
    num_blocks = sum(per_seq) + 2
    order = rng.permutation(num_blocks)
    tables = np.full((len(seq_lens), max(per_seq) + 1), order[-1], np.int32)
    slots, c = [], 0
    for b, (s, n) in enumerate(zip(seq_lens, per_seq)):
        tables[b, :n] = order[c : c + n]
        c += n
        pos = np.arange(s)
        slots.append(tables[b, pos // BS] * BS + pos % BS)
    flat = np.concatenate(slots).astype(np.int32)
    fields = {
        name: jnp.zeros((num_blocks, num_kv, BS, *shape[1:]), dtype)
        for name, (shape, dtype) in fmt.fields(num_kv, head_dim).items()
    }
    k, v = (jnp.asarray(rng.normal(size=(len(flat), num_kv, head_dim)), jnp.float32) for _ in range(2))
    fields = _write(fields, k, v, jnp.asarray(flat), fmt=fmt, implementation="xla")
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(qsl[-1], num_kv * groups, head_dim)), jnp.float32)
    qd = jnp.asarray(rng.normal(size=(len(seq_lens), num_kv * groups, head_dim)), jnp.float32)
    return q, qd, fields, jnp.asarray(tables), jnp.asarray(np.array(seq_lens, np.int32)), jnp.asarray(qsl)


# Decode with 32 query heads on one KV head at D = 256 (bf16): the Triton kernel's rows are 32 even at tile 1, and
# its tiles need 32*256*4 + (32*256*4 + 2*32*4) + 32*16*4 + 16*1024 + 2*16*32*4 = 88,320 B: over RDNA4's 65,536.
BIG_DECODE = dict(num_kv=1, groups=32, head_dim=256)
BIG_DECODE_BYTES = 88_320


@pytest.mark.parametrize(
    "backend, op, expected",
    [
        ("tpu", "unified", ("pallas_tpu", "xla")),
        ("tpu", "decode", ("pallas_tpu", "xla")),
        ("tpu", "write", ("pallas_tpu", "xla")),
        ("gpu", "unified", ("pallas_triton", "xla")),
        ("gpu", "decode", ("pallas_triton", "xla_split", "xla")),
        ("gpu", "write", ("pallas_triton", "xla")),
        ("cpu", "unified", ("xla",)),
        ("cpu", "decode", ("xla_split", "xla")),
        ("cpu", "write", ("xla",)),
        ("METAL", "decode", ("xla_split", "xla")),  # any other backend: the CPU order
    ],
)
def test_auto_order_per_backend(backend, op, expected):
    assert resolve("auto", op, backend) == expected
    assert resolve(None, op, backend) == expected


def test_names_aliases_and_sequences():
    assert resolve("pallas", "decode") == ("pallas_triton",)
    assert attention.IMPLEMENTATIONS["pallas"] is attention.IMPLEMENTATIONS["pallas_triton"]
    assert resolve(("pallas", "pallas_triton", "xla"), "unified") == ("pallas_triton", "xla")  # repeats dropped
    assert resolve(("pallas_tpu", "auto"), "decode", "gpu") == ("pallas_tpu", "pallas_triton", "xla_split", "xla")
    with pytest.raises(ValueError, match=r"implementation = 'cuda'; allowed: \['pallas_tpu'"):
        resolve(("xla", "cuda"), "decode")
    with pytest.raises(ValueError, match=r"implementation = \(\); allowed"):
        resolve((), "decode")
    # every name is a config value: experiments' kvcache section reads its choices from the dict
    from core.fields import section_fields
    from experiments import schema_kvcache

    choices = section_fields(schema_kvcache.KVCacheConfig)["implementation"].choices
    assert set(choices or ()) == {"pallas_tpu", "pallas_triton", "pallas", "xla_split", "xla", "auto"}


def test_auto_on_this_backend_equals_the_reference():
    """The default (auto) on the test backend (CPU: xla_split for decode, xla otherwise) equals the reference."""
    q, qd, fields, tables, seq_lens, qsl = make_case(BF16, [1, 17, 40], [1, 5, 3], num_kv=2, groups=2, head_dim=64)
    assert jax.default_backend() == "cpu"
    out = _unified(q, fields, tables, seq_lens, qsl, fmt=BF16, max_query_len=5)
    ref = _ref_unified(q, fields, tables, seq_lens, qsl, fmt=BF16, max_query_len=5)
    np.testing.assert_array_equal(out, ref)
    out = _decode(qd, fields, tables, seq_lens, fmt=BF16)
    ref = _ref_decode(qd, fields, tables, seq_lens, fmt=BF16)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_refusal_falls_back_with_one_logged_line(caplog):
    _q, qd, fields, tables, seq_lens, _qsl = make_case(BF16, [3, 33], [1, 1], **BIG_DECODE)
    ref = _ref_decode(qd, fields, tables, seq_lens, fmt=BF16)
    with caplog.at_level(logging.WARNING, logger="kvcache.attention"):
        out = _decode(qd, fields, tables, seq_lens, fmt=BF16, implementation=("pallas_triton", "xla"), device="rdna4")
    np.testing.assert_array_equal(out, ref)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvcache.attention"]
    assert len(lines) == 1, lines
    assert "decode_attention: implementation 'pallas_triton' refused" in lines[0]
    assert f"needs {BIG_DECODE_BYTES:,} B of LDS; rdna4 has 65,536 B" in lines[0]
    assert lines[0].endswith("running 'xla'")


def test_an_explicit_refusing_implementation_raises(caplog):
    q, qd, fields, tables, seq_lens, qsl = make_case(BF16, [3, 33], [1, 1], **BIG_DECODE)
    message = f"needs {BIG_DECODE_BYTES:,} B of LDS; rdna4 has 65,536 B"
    for name in ("pallas_triton", "pallas", ["pallas_triton"]):
        with pytest.raises(NotImplementedError, match=message):
            decode_attention(qd, fields, tables, seq_lens, fmt=BF16, implementation=name, device="rdna4")
    with pytest.raises(ValueError, match="device = 'rdna5'; allowed: None"):
        decode_attention(qd, fields, tables, seq_lens, fmt=BF16, implementation="pallas_triton", device="rdna5")
    # xla_split offers no unified attention: named alone, a ValueError; in a sequence, a logged skip
    with pytest.raises(ValueError, match="implementation = 'xla_split' offers no unified_attention"):
        unified_attention(q, fields, tables, seq_lens, qsl, fmt=BF16, implementation="xla_split")
    with caplog.at_level(logging.WARNING, logger="kvcache.attention"):
        out = _unified(q, fields, tables, seq_lens, qsl, fmt=BF16, implementation=("xla_split", "xla"))
    np.testing.assert_array_equal(out, _ref_unified(q, fields, tables, seq_lens, qsl, fmt=BF16))
    assert [r.getMessage() for r in caplog.records] == [
        "unified_attention: implementation 'xla_split' refused (offers no unified_attention); running 'xla'"
    ]


def test_partitions_are_a_hint_in_a_sequence_and_an_error_alone():
    q, _qd, fields, tables, seq_lens, qsl = make_case(BF16, [5, 50], [2, 3], num_kv=1, groups=4, head_dim=64)
    ref = _ref_unified(q, fields, tables, seq_lens, qsl, fmt=BF16)
    out = _unified(q, fields, tables, seq_lens, qsl, fmt=BF16, implementation=("xla_split", "xla"), partitions=2)
    np.testing.assert_array_equal(out, ref)
    out = _unified(q, fields, tables, seq_lens, qsl, fmt=BF16, partitions=2)  # auto on CPU: xla
    np.testing.assert_array_equal(out, ref)
    with pytest.raises(ValueError, match=r"partitions applies to implementation=\['pallas_tpu'"):
        unified_attention(q, fields, tables, seq_lens, qsl, fmt=BF16, implementation="xla", partitions=2)


def test_a_missing_tpu_module_is_a_logged_refusal(monkeypatch, caplog):
    """With the Mosaic module unavailable (an import of None in sys.modules fails), pallas_tpu refuses and the
    next implementation runs."""
    monkeypatch.setitem(sys.modules, "kvcache.kernels.tpu_attention", None)
    monkeypatch.delattr(kernels, "tpu_attention", raising=False)  # (set on the package once imported)
    _q, qd, fields, tables, seq_lens, _qsl = make_case(FP4, [9, 20], [1, 1], num_kv=2, groups=1, head_dim=64)
    with caplog.at_level(logging.WARNING, logger="kvcache.attention"):
        out = _decode(qd, fields, tables, seq_lens, fmt=FP4, implementation=("pallas_tpu", "xla"))
    np.testing.assert_array_equal(out, _ref_decode(qd, fields, tables, seq_lens, fmt=FP4))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "'pallas_tpu' refused (the Mosaic TPU kernels are not available" in line and line.endswith("'xla'")
    with pytest.raises(NotImplementedError, match="Mosaic TPU kernels are not available"):
        decode_attention(qd, fields, tables, seq_lens, fmt=FP4, implementation="pallas_tpu")


@pytest.mark.skipif(
    importlib.util.find_spec("kvcache.kernels.tpu_attention") is None,
    reason="kvcache.kernels.tpu_attention (the Mosaic TPU kernel) is not in this tree",
)
def test_pallas_tpu_through_the_registry():
    """pallas_tpu (TPU interpret mode on a CPU) through the public function equals the reference."""
    _q, qd, fields, tables, seq_lens, _qsl = make_case(BF16, [1, 17, 35], [1, 1, 1], num_kv=1, groups=2, head_dim=64)
    out = _decode(qd, fields, tables, seq_lens, fmt=BF16, implementation="pallas_tpu")
    ref = _ref_decode(qd, fields, tables, seq_lens, fmt=BF16)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [dict(num_kv=1, groups=2, head_dim=64), dict(num_kv=2, groups=1, head_dim=128)])
def test_input_refusals_on_concrete_arrays(shape):
    q, qd, fields, tables, seq_lens, qsl = make_case(BF16, [3, 33], [1, 2], **shape)
    num_blocks, capacity = fields["k"].shape[0], tables.shape[1] * BS
    call = lambda **kw: decode_attention(  # noqa: E731
        qd, fields, kw.get("tables", tables), kw.get("seq_lens", seq_lens), fmt=BF16, implementation="xla"
    )
    with pytest.raises(ValueError, match=rf"^seq_lens\[1\] = {capacity + 1}; allowed: 0 .. {capacity} \(block_tables'"):
        call(seq_lens=seq_lens.at[1].set(capacity + 1))
    call(seq_lens=seq_lens.at[1].set(capacity))  # exactly full: accepted
    with pytest.raises(ValueError, match=rf"^seq_lens\[0\] = -1; allowed: 0 .. {capacity}"):
        call(seq_lens=seq_lens.at[0].set(-1))
    with pytest.raises(ValueError, match=rf"^block_tables\[1, 2\] = {num_blocks}; allowed: 0 .. {num_blocks - 1} "):
        call(tables=tables.at[1, 2].set(num_blocks))
    with pytest.raises(ValueError, match=r"^block_tables\[0, 0\] = -3; allowed: 0 .. "):
        unified_attention(q, fields, tables.at[0, 0].set(-3), seq_lens, qsl, fmt=BF16, implementation="xla")
    k = jnp.ones((3, *fields["k"].shape[1:2], qd.shape[-1]), jnp.float32)
    slots = jnp.array([-1, 0, num_blocks * BS], jnp.int32)
    with pytest.raises(ValueError, match=rf"^slot_mapping\[2\] = {num_blocks * BS}; allowed: negative \(skip\) or 0 "):
        write(fields, k, k, slots, fmt=BF16)
    written = write(fields, k, k, slots.at[2].set(num_blocks * BS - 1), fmt=BF16)  # the last slot: accepted
    assert written["k"].shape == fields["k"].shape


def test_under_jit_only_shapes_are_checked():
    """Traced values are unknown: bad values pass the checks under jit (the kernels clamp or skip them), bad
    shapes are still refused."""
    _q, qd, fields, tables, seq_lens, _qsl = make_case(BF16, [3, 33], [1, 2], num_kv=1, groups=2, head_dim=64)
    decode = jax.jit(lambda *a: decode_attention(*a, fmt=BF16, implementation="xla"))
    out = decode(qd, fields, tables, seq_lens.at[1].set(10_000))
    assert out.shape == qd.shape
    decode(qd, fields, tables.at[0, 0].set(-5), seq_lens)
    store = jax.jit(lambda f, k, s: write(f, k, k, s, fmt=BF16, implementation="xla"))
    store(fields, jnp.ones((1, 1, 64), jnp.float32), jnp.array([10**6], jnp.int32))
    with pytest.raises(ValueError, match=r"block_tables \(2,\) must be \[B, max_blocks\]"):
        decode(qd, fields, tables[:, 0], seq_lens)


# On-chip budgets.

FAMILY_BYTES = {
    "tpu_v4": 16 * 2**20,
    "tpu_v5e": 16 * 2**20,
    "tpu_v5p": 16 * 2**20,
    "tpu_v6e": 32 * 2**20,
    "h100": 232_448,
    "h200": 232_448,
    "b200": 232_448,
    "mi300x": 65_536,
    "mi355x": 163_840,
    "rdna3": 65_536,
    "rdna4": 65_536,
}


@pytest.mark.parametrize("family", list(FAMILY_BYTES))
def test_each_family_fits_just_under_and_refuses_just_over(family):
    limit = FAMILY_BYTES[family]
    memory = {"t": "VMEM", "h": "shared memory", "b": "shared memory"}.get(family[0], "LDS")
    assert budgets.BUDGETS[family].bytes == limit and budgets.BUDGETS[family].memory == memory
    budgets.check(limit, family)
    budgets.check(limit - 1, family)
    with pytest.raises(NotImplementedError, match=rf"needs {limit + 1:,} B of {memory}; {family} has {limit:,} B$"):
        budgets.check(limit + 1, family)


def test_budget_tables_and_detection():
    assert {f: b.physical for f, b in budgets.BUDGETS.items() if f.startswith("tpu")} == {
        "tpu_v4": 16 * 2**20,
        "tpu_v5e": 128 * 2**20,
        "tpu_v5p": 64 * 2**20,
        "tpu_v6e": 128 * 2**20,
    }
    kinds = {
        "NVIDIA H100 80GB HBM3": "h100",
        "NVIDIA H200": "h200",
        "NVIDIA B200": "b200",
        "AMD Instinct MI300X": "mi300x",
        "AMD Instinct MI355X": "mi355x",
        "AMD Radeon RX 7900 XTX": "rdna3",
        "AMD Radeon RX 9070 XT": "rdna4",
        "TPU v4": "tpu_v4",
        "TPU v5 lite": "tpu_v5e",
        "TPU v5": "tpu_v5p",
        "TPU v6 lite": "tpu_v6e",
        "TPU v4 lite": None,
        "NVIDIA A100-SXM4-80GB": None,
        "cpu": None,
    }
    assert {kind: budgets.family_of(kind) for kind in kinds} == kinds
    assert budgets.detect() is None  # the test machine's CPU: no check
    with pytest.raises(NotImplementedError, match="needs 65,792 B of LDS; rdna4 has 65,536 B"):
        budgets.check(65_792, "rdna4")  # vLLM's RDNA4 unified attention
    with pytest.raises(ValueError, match="device_family = 'a100'; allowed"):
        budgets.check(1, "a100")


def test_triton_tile_bytes_by_hand():
    """The formula of `budgets.triton_attention_bytes`, term by term, on configurations worked out by hand."""
    # R = 16, D = 128, bs = 16, bf16 (K + V: 2 x 128 x 2 = 512 B per token and head):
    # query 8,192 + accumulators 8,192 + 128 + scores 1,024 + block 8,192 + decoded groups 4,096
    assert budgets.triton_attention_bytes(rows=16, head_dim=128, block_size=16, kv_bytes_per_token=512) == 29_824
    assert attention_kernel.shared_memory_bytes(BF16, tile=1, groups=1, head_dim=128, block_size=16) == 29_824
    # fp4 at D = 128: 64 code bytes + 4 UE8M0 scales for K and for V = 136 B per token and head
    assert FP4.bytes_per_token(1, 128) == 136
    assert attention_kernel.shared_memory_bytes(FP4, tile=16, groups=1, head_dim=128, block_size=16) == (
        8_192 + 8_320 + 1_024 + 16 * 136 + 4_096
    )
    # decode of 32 heads per KV head at D = 256: rows 32 at tile 1
    assert attention_kernel.shared_memory_bytes(BF16, tile=1, groups=32, head_dim=256, block_size=16) == (
        32 * 256 * 4 + 32 * 256 * 4 + 2 * 32 * 4 + 32 * 16 * 4 + 16 * 1_024 + 2 * 16 * 32 * 4
    )
    assert BIG_DECODE_BYTES == 88_320
    with pytest.raises(ValueError, match="block_size = 0; must be >= 1"):
        budgets.triton_attention_bytes(rows=16, head_dim=64, block_size=0, kv_bytes_per_token=1)


def test_the_query_tile_shrinks_to_fit():
    """GQA 8, D = 128, bf16 prefill: tile 16 (rows 128) needs 152,576 B, fits an H100 but not RDNA4; tile 8 (rows
    64) needs 82,432 B, still over; tile 4 (rows 32) needs 47,360 B and fits. A given tile is only checked."""
    fit = lambda device, **kw: attention_kernel.fit_tile(  # noqa: E731
        BF16, groups=8, head_dim=128, block_size=16, device=device, **kw
    )
    assert 32 * 128 * 4 * 2 + 2 * 32 * 4 + 32 * 16 * 4 + 16 * 512 + 4_096 == 47_360
    assert fit("h100", tile=16) == 16
    assert fit("rdna4", tile=16) == 4
    assert fit("mi355x", tile=16) == 16
    with pytest.raises(
        NotImplementedError, match="query tile 16, D = 128.* needs 152,576 B of LDS; rdna4 has 65,536 B"
    ):
        fit("rdna4", tile=16, shrink=False)
    # D = 512 at tile 1 (rows 16): 32,768 + 32,768 + 128 + 1,024 + 16 x 2,048 + 4,096 = 103,552 B: no tile fits
    with pytest.raises(NotImplementedError, match="query tile 1, D = 512.* needs 103,552 B of LDS; rdna4 has 65,536"):
        attention_kernel.fit_tile(BF16, tile=16, groups=1, head_dim=512, block_size=16, device="rdna4")


def test_a_shrunk_tile_runs_and_equals_the_reference():
    """The Triton kernel (interpreted) on RDNA4's budget: GQA 8 at D = 64 needs 82,944 B at tile 16, so it runs at
    tile 8 (45,568 B); the output equals the reference's."""
    assert attention_kernel.fit_tile(BF16, tile=16, groups=8, head_dim=64, block_size=16, device="rdna4") == 8
    q, _qd, fields, tables, seq_lens, qsl = make_case(BF16, [20, 7], [12, 7], num_kv=1, groups=8, head_dim=64)
    out = _unified(
        q, fields, tables, seq_lens, qsl, fmt=BF16, implementation="pallas", max_query_len=12, device="rdna4"
    )
    ref = _ref_unified(q, fields, tables, seq_lens, qsl, fmt=BF16, max_query_len=12)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
