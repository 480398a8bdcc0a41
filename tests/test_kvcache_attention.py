"""Paged attention: the XLA reference against float64 NumPy; the Pallas kernels (interpreted on a CPU, compiled on a
GPU) against the reference; the quantise-and-write kernel bit for bit; slots no query may see (unused blocks, block
tails, padding columns) holding NaN / Inf, and other sequences' blocks, never reach an output.

Interpreted Pallas compiles slowly (seconds per kernel shape), so by default the kernels run on representative
cases: each kernel path once, at the smallest size that shows it. Every format; the unified kernel (tile 16) and the
decode kernel (tile 1, query heads padded to 16 rows); one, two and three split-KV partitions (the shortest
sequences' later partitions empty); GQA 1, 2, 4 and 8; fp4 at D = 128 (two packed chunks per row); one ragged batch
of lengths 1, bs - 1, bs, bs + 1 and 5 bs + 3 mixing decode tokens, a 3-token chunk, a whole-sequence prefill and a
20-token chunk. Every call goes through a module-level `jax.jit`, so tests that share a shape share its compilation.

The full matrix is marked `slow` (`pytest -m slow tests/test_kvcache_attention.py` runs it; experiments/bench/gpu.sh
runs every case, compiled on a GPU): bf16, fp8 and fp4 at head dims 64, 128 and 256 with GQA 1, 4 and 8, the other
formats at one more head dim each, each at 1 and 3 partitions; split-KV decode of up to 19 blocks at 1, 2, 7 and the
automatic partition count (the kernel and the XLA
loop); every format through the decode kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from core import lowbit
from kvcache import PagedPool, decode_attention, formats, split, unified_attention, write
from kvcache.kernels import attention as attention_kernel

FORMATS = {
    "bf16": formats.get("bf16"),
    "fp8": formats.get("fp8"),
    "fp4": formats.get("fp4"),
    "fp4-mx-norot": formats.get("fp4", scale_rule="mx", rotate_k=False),
    "fp4-symmetric": formats.get("fp4", rotate_v=True),
    "fp4-e1m2": formats.get("fp4", grid="e1m2"),
    "nvfp4": formats.get("nvfp4"),
    "nvfp4-4over6": formats.get("nvfp4", select="4over6"),
    "k8v4": formats.get("k8v4"),
}
BS = 16
# Sequence lengths 1, bs - 1, bs, bs + 1 and many blocks in one batch; query chunks of decode (1) and prefill
# (3 tokens, a whole 16-token sequence, 20 of 83 tokens).
SEQ_LENS = [1, BS - 1, BS, BS + 1, 5 * BS + 3]
Q_LENS = [1, 3, BS, 1, 20]

# One kernel case per format: (head dim D, GQA group size G, KV heads K, partitions).
CASES = {
    "bf16": (64, 1, 2, 1),  # GQA 1, one partition
    "fp8": (64, 4, 1, 3),  # per-token scales, GQA 4, three partitions
    "fp4": (128, 2, 2, 2),  # two packed 32-byte chunks per row (groups c and c + 2), two partitions
    "fp4-mx-norot": (64, 8, 1, 1),  # the mx scale rule, K unrotated, GQA 8
    "fp4-symmetric": (64, 2, 2, 3),  # V rotated: the output is rotated back after the partition merge
    "fp4-e1m2": (64, 1, 2, 2),  # the uniform grid's arithmetic decode
    "nvfp4": (64, 4, 1, 1),  # E4M3 scales per 16 applied to the values
    "nvfp4-4over6": (128, 2, 2, 2),  # "4 over 6" selection, two packed chunks per row
    "k8v4": (64, 2, 2, 3),  # per-token K scales, per-group V scales
}
# The decode kernel (tile 1) for each way its K and V are decoded (plain, per-token scales, UE8M0 group scales,
# E4M3 block scales, mixed); the other fp4 variants differ from "fp4" only in the bytes written, the grid's decode
# arithmetic and the query / output rotations outside the kernel.
DECODE_FORMATS = ["bf16", "fp8", "fp4", "nvfp4-4over6", "k8v4"]
# The full matrix: every format at every head dim, GQA 1, 4 and 8 spread over them, at 1 and 3 partitions.
_FULL_CASES = [
    (n, d, g)
    for i, (n, d) in enumerate((n, d) for n in ("bf16", "fp8", "fp4") for d in (64, 128, 256))
    for g in [(1, 4, 8)[i % 3]]
] + [
    ("fp4-mx-norot", 64, 4),
    ("fp4-symmetric", 128, 2),
    ("fp4-e1m2", 256, 4),
    ("nvfp4", 256, 8),
    ("nvfp4-4over6", 64, 1),
    ("k8v4", 128, 8),
]
_CASE_ROWS = [(n, *c) for n, c in CASES.items()]
UNIFIED_CASES = _CASE_ROWS + [
    pytest.param(*case, marks=pytest.mark.slow)
    for case in dict.fromkeys((n, d, g, 2 if g < 8 else 1, p) for n, d, g in _FULL_CASES for p in (1, 3))
    if case not in _CASE_ROWS
]

_unified = jax.jit(unified_attention, static_argnames=("fmt", "implementation", "max_query_len", "partitions"))
_decode = jax.jit(decode_attention, static_argnames=("fmt", "implementation", "partitions"))
_write = jax.jit(write, static_argnames=("fmt", "implementation"))


# Every static argument passed explicitly: jit caches a passed and a defaulted keyword apart, and equal shapes
# should compile once per session.
def attend(q, fields, tables, seq_lens, qsl, *, fmt, implementation="xla", partitions=None, max_query_len=None):
    """Jitted `unified_attention` (max_query_len defaults to the batch's, max(Q_LENS))."""
    max_query_len = max(Q_LENS) if max_query_len is None else max_query_len
    return _unified(
        q,
        fields,
        tables,
        seq_lens,
        qsl,
        fmt=fmt,
        implementation=implementation,
        max_query_len=max_query_len,
        partitions=partitions,
    )


def attend_decode(q, fields, tables, seq_lens, *, fmt, implementation="xla", partitions=None):
    """Jitted `decode_attention`."""
    return _decode(q, fields, tables, seq_lens, fmt=fmt, implementation=implementation, partitions=partitions)


def store(fields, k, v, slots, *, fmt, implementation="xla"):
    """Jitted `write`."""
    return _write(fields, k, v, slots, fmt=fmt, implementation=implementation)


def make_case(fmt, seq_lens, q_lens, *, num_kv, groups, head_dim, seed=0, extra_blocks=3):
    """A pool holding every sequence's tokens in shuffled blocks (written through `write`), the block tables (one
    padding column at least, pointing at blocks no sequence owns), queries, and the float32 K/V that were written.
    The slots no sequence owns are zeros."""
    rng = np.random.default_rng(seed)
    blocks_per_seq = [-(-s // BS) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    max_blocks = max(blocks_per_seq) + 1
    order = rng.permutation(num_blocks)
    spare = order[sum(blocks_per_seq) :]
    tables = np.zeros((len(seq_lens), max_blocks), np.int32)
    kvs, slots, c = [], [], 0
    for b, (s, n) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[b, :n] = order[c : c + n]
        tables[b, n:] = spare[b % len(spare)]
        c += n
        pos = np.arange(s)
        slots.append(tables[b, pos // BS] * BS + pos % BS)
        kvs.append(
            (rng.normal(size=(s, num_kv, head_dim)) * rng.uniform(0.5, 3.0), rng.normal(size=(s, num_kv, head_dim)))
        )
    pool = PagedPool.create(
        fmt, num_layers=1, num_kv_heads=num_kv, head_dim=head_dim, block_size=BS, num_blocks=num_blocks
    )
    k = np.concatenate([a for a, _ in kvs]).astype(np.float32)
    v = np.concatenate([b for _, b in kvs]).astype(np.float32)
    fields = store(pool.layer(0), jnp.asarray(k), jnp.asarray(v), jnp.asarray(np.concatenate(slots)), fmt=fmt)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.normal(size=(qsl[-1], num_kv * groups, head_dim)).astype(np.float32)
    return (
        jnp.asarray(q),
        fields,
        jnp.asarray(tables),
        jnp.asarray(np.array(seq_lens, np.int32)),
        jnp.asarray(qsl),
        kvs,
    )


def kernel_case(name, seed=0):
    """make_case over the ragged batch with the format's kernel case (D, G, K); also the decode queries (one per
    sequence, the first of its chunk's queries: attention then sees the positions up to seq_len - 1)."""
    head_dim, groups, num_kv, _ = CASES[name]
    case = make_case(FORMATS[name], SEQ_LENS, Q_LENS, num_kv=num_kv, groups=groups, head_dim=head_dim, seed=seed)
    return case, case[0][np.asarray(case[4][:-1])]


def numpy_attention(q, k, v, q_pos, groups):
    """float64 softmax attention of queries q [n, H, D] at positions q_pos over keys/values [S, K, D]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    s = np.einsum("nhd,shd->nhs", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.arange(k.shape[0])[None, None] <= np.asarray(q_pos)[:, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("nhs,shd->nhd", p / p.sum(-1, keepdims=True), v)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("name", list(FORMATS))
def test_reference_matches_numpy(name):
    """The XLA reference equals float64 attention over the format's dequantised K/V (with the prepared query, in
    the stored basis), per sequence, causal inside each chunk."""
    fmt = FORMATS[name]
    groups = CASES[name][1]
    (q, fields, tables, seq_lens, qsl, kvs), _ = kernel_case(name)
    out = np.asarray(attend(q, fields, tables, seq_lens, qsl, fmt=fmt))
    k_all, v_all = (jnp.asarray(np.concatenate([kv[i] for kv in kvs]), jnp.float32) for i in (0, 1))
    # Jitted: compiling the round trip once is faster than dispatching its operations one by one.
    q_prep, k_hat_all, v_hat_all = jax.jit(
        lambda q, k, v: (fmt.prepare_query(q), *fmt.dequantize(fmt.quantize(k, v), rotated=True))
    )(q, k_all, v_all)
    q_prep, k_hat_all, v_hat_all = np.asarray(q_prep), np.asarray(k_hat_all), np.asarray(v_hat_all)
    starts = np.cumsum([0] + [len(k) for k, _ in kvs])
    for b in range(len(kvs)):
        k_hat, v_hat = k_hat_all[starts[b] : starts[b + 1]], v_hat_all[starts[b] : starts[b + 1]]
        lo, hi = int(qsl[b]), int(qsl[b + 1])
        pos = SEQ_LENS[b] - (hi - lo) + np.arange(hi - lo)
        want = numpy_attention(q_prep[lo:hi], k_hat, v_hat, pos, groups)
        if fmt.value_rotation(want.shape[-1]) is not None:  # the output of rotated values, rotated back
            want = want @ formats.hadamard(want.shape[-1]).astype(np.float64)
        np.testing.assert_allclose(out[lo:hi], want, rtol=2e-5, atol=2e-5)
    if name == "bf16":  # and against the unquantised keys: bf16 rounding only
        for b, (k, v) in enumerate(kvs):
            lo, hi = int(qsl[b]), int(qsl[b + 1])
            pos = SEQ_LENS[b] - (hi - lo) + np.arange(hi - lo)
            np.testing.assert_allclose(out[lo:hi], numpy_attention(q[lo:hi], k, v, pos, groups), atol=3e-2)


@pytest.mark.parametrize("name,head_dim,groups,num_kv,partitions", UNIFIED_CASES)
def test_unified_kernel_matches_reference(name, head_dim, groups, num_kv, partitions):
    """The unified kernel over the ragged batch (decode tokens and prefill chunks, lengths 1, bs-1, bs, bs+1 and
    5 bs + 3) with `partitions` split-KV partitions equals the reference."""
    fmt = FORMATS[name]
    q, fields, tables, seq_lens, qsl, _ = make_case(
        fmt, SEQ_LENS, Q_LENS, num_kv=num_kv, groups=groups, head_dim=head_dim, seed=head_dim + groups
    )
    ref = np.asarray(attend(q, fields, tables, seq_lens, qsl, fmt=fmt))
    out = attend(q, fields, tables, seq_lens, qsl, fmt=fmt, implementation="pallas", partitions=partitions)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def _decode_partitions(name, implementation):
    """The kernel at the format's case; xla_split at 3 partitions of 3 of the 7 table columns (the third starts
    past the longest sequence and is skipped, the table is padded to 9 columns)."""
    return {"xla": None, "xla_split": 3, "pallas": CASES[name][3]}[implementation]


@pytest.mark.parametrize(
    "name,implementation",
    [(n, "pallas") for n in DECODE_FORMATS]
    + [(n, "xla_split") for n in FORMATS]
    + [pytest.param(n, "pallas", marks=pytest.mark.slow) for n in FORMATS if n not in DECODE_FORMATS],
)
def test_decode_matches_reference(name, implementation):
    """Split-KV decode (one query per sequence) over the ragged batch equals the reference: the decode kernel (tile
    1) at the format's case (GQA 1 with one partition, GQA 4 with three, fp4 at D = 128 with two), and the
    algorithm as an XLA loop at three partitions for every format."""
    fmt = FORMATS[name]
    (_, fields, tables, seq_lens, _, _), qd = kernel_case(name, seed=11)
    ref = np.asarray(attend_decode(qd, fields, tables, seq_lens, fmt=fmt))
    parts = _decode_partitions(name, implementation)
    out = attend_decode(qd, fields, tables, seq_lens, fmt=fmt, implementation=implementation, partitions=parts)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["pallas", "xla_split"])
@pytest.mark.parametrize("name", ["bf16", "fp4-symmetric"])
def test_split_decode_matches_reference(name, implementation):
    """Split-KV decode over a ragged batch up to 19 blocks (lengths 1, 300, bs + 1, 129) equals the reference at
    partitions 1, 2, 7 (the last one short) and the automatic count."""
    fmt = FORMATS[name]
    lens = [1, 300, BS + 1, 129]
    q, fields, tables, seq_lens, _, _ = make_case(fmt, lens, [1] * 4, num_kv=2, groups=4, head_dim=64, seed=7)
    ref = np.asarray(attend_decode(q, fields, tables, seq_lens, fmt=fmt))
    for parts in (1, 2, 7, None):
        out = attend_decode(q, fields, tables, seq_lens, fmt=fmt, implementation=implementation, partitions=parts)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5, err_msg=f"partitions={parts}")


# The 4-bit sides of the split-KV loop (half-width tiles): every grid, both scale kinds, mixed with a plain side.
HALF_TILE_FORMATS = ["fp4", "fp4-e1m2", "fp4-symmetric", "nvfp4", "k8v4"]
_split = jax.jit(split.decode_attention, static_argnames=("fmt", "blocks_per_partition"))


def test_split_tile_decode_is_exact():
    """The split loop's decode of 4-bit codes is the codecs' bit for bit: E2M1 levels of all 16 codes through
    float16, UE8M0 values of all 256 bytes from their bits (0 the subnormal 2^-127, 255 nan)."""
    codes = jnp.arange(16, dtype=jnp.uint8)
    np.testing.assert_array_equal(_bits(jax.jit(split._e2m1_levels)(codes)), _bits(lowbit.decode_e2m1(codes)))
    scales = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8)
    np.testing.assert_array_equal(_bits(jax.jit(split._ue8m0)(scales)), _bits(lowbit.ue8m0_value(scales)))


@pytest.mark.parametrize("name", HALF_TILE_FORMATS)
def test_split_half_tiles_are_the_dequantised_rows(name):
    """`_tiles` of random stored bytes (every code, every scale byte including nan ones) side by side equal
    `fmt.dequantize(rotated=True)` bit for bit (nan where it is nan): the loop changes no element, only the order
    in which a score's products are added."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(3)
    fields = {}
    for field, (shape, dtype) in fmt.fields(2, 128).items():
        raw = rng.integers(0, 256, (1, 24, *shape), dtype=np.uint8)
        if np.dtype(dtype).itemsize == 1:
            fields[field] = jax.lax.bitcast_convert_type(jnp.asarray(raw), dtype)
        else:  # fp8 side's float32 scales: finite, positive
            fields[field] = jnp.asarray(rng.uniform(0.01, 2.0, (1, 24, *shape)), dtype)
    kv = {n: jnp.moveaxis(x, 2, 1) for n, x in fields.items()}  # [B, K, L, ...]
    keys, values = fmt.dequantize(kv, rotated=True)
    for prefix, want in (("k", keys), ("v", values)):
        tiles = jax.jit(lambda kv, p=prefix: split._tiles(fmt, kv, p, None))(kv)
        np.testing.assert_array_equal(np.concatenate([np.asarray(t) for t in tiles], axis=-1), np.asarray(want))


@pytest.mark.parametrize(
    "name,head_dim,groups,num_kv",
    [(name, *[(64, 4, 1), (128, 2, 2)][i % 2]) for i, name in enumerate(HALF_TILE_FORMATS)],
)
def test_split_half_tiles_match_float64(name, head_dim, groups, num_kv):
    """Split-KV decode with 4-bit sides over a ragged batch (lengths 1, bs - 1, bs + 1, 5 bs + 3) at 2 blocks per
    partition and at the default (`partition_blocks`, here one partition) equals float64 attention over the
    format's dequantised K/V with the prepared query (V rotated back where the format rotates it). Tolerance 2e-5,
    as the reference's against float64: both compute in float32 from the same dequantised elements; scores and
    outputs of unit-scale inputs are sums of at most Dp = 128 and 83 terms, each rounding adding ~2^-24 relative."""
    fmt = FORMATS[name]
    lens = [1, BS - 1, BS + 1, 5 * BS + 3]
    q, fields, tables, seq_lens, _, kvs = make_case(
        fmt, lens, [1] * len(lens), num_kv=num_kv, groups=groups, head_dim=head_dim, seed=head_dim + groups
    )
    q_prep = np.asarray(fmt.prepare_query(q))
    for per in (2, None):
        out = np.asarray(_split(q, fields, tables, seq_lens, fmt=fmt, blocks_per_partition=per))
        for b, (k, v) in enumerate(kvs):
            k_hat, v_hat = (
                np.asarray(x) for x in fmt.dequantize(fmt.quantize(jnp.asarray(k), jnp.asarray(v)), rotated=True)
            )
            want = numpy_attention(q_prep[b : b + 1], k_hat, v_hat, [lens[b] - 1], groups)
            if fmt.value_rotation(want.shape[-1]) is not None:
                want = want @ formats.hadamard(want.shape[-1]).astype(np.float64)
            np.testing.assert_allclose(
                out[b : b + 1], want, rtol=2e-5, atol=2e-5, err_msg=f"blocks_per_partition={per}"
            )


def test_partition_blocks():
    """Twice the full-width partition when both sides are 4-bit (half-width tiles), else the full-width one."""
    assert split.partition_blocks(FORMATS["fp4"], 256) == 2 * split.FULL_TILE_BLOCKS
    assert split.partition_blocks(FORMATS["nvfp4"], 128) == 2 * split.FULL_TILE_BLOCKS
    for name in ("bf16", "fp8", "k8v4"):
        assert split.partition_blocks(FORMATS[name], 128) == split.FULL_TILE_BLOCKS
    with pytest.raises(ValueError, match="head_dim = 48"):
        split.partition_blocks(FORMATS["fp4"], 48)


def poison(fields, tables, seq_lens, seed):
    """Every slot no live sequence owns (unused blocks, the tail of each sequence's last block, the blocks padding
    columns point at) overwritten with bytes that decode to NaN or +-Inf: bf16 NaN/+-Inf; fp8 NaN codes (E4M3 has
    no Inf) and NaN/+-Inf float32 scales; fp4 random codes (all finite) under scale byte 0xFF = 2^128 = +Inf."""
    tables, seq_lens = np.asarray(tables), np.asarray(seq_lens)
    nb, _, bs = next(iter(fields.values())).shape[:3]
    owned = np.zeros((nb, bs), bool)
    for b, n in enumerate(seq_lens):
        pos = np.arange(n)
        owned[tables[b, pos // bs], pos % bs] = True
    rng = np.random.default_rng(seed)
    out = {}
    for name, field in fields.items():
        x = np.asarray(field)
        if x.dtype == np.uint8:  # fp4: codes random, scales 0xFF
            bad = rng.integers(0, 256, x.shape).astype(np.uint8) if name.endswith("codes") else np.full_like(x, 255)
        elif x.dtype.itemsize == 1:  # fp8 codes: mostly NaN (0x7F, 0xFF), some random bytes
            nan = np.where(rng.random(x.shape) < 0.5, 0x7F, 0xFF)
            bad = np.where(rng.random(x.shape) < 0.7, nan, rng.integers(0, 256, x.shape)).astype(np.uint8)
            bad = bad.view(x.dtype)
        else:  # bf16 values, fp8 float32 scales
            bad = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), x.shape).astype(x.dtype)
        dead = ~owned[:, None, :].reshape(nb, 1, bs, *[1] * (x.ndim - 3))
        out[name] = jnp.asarray(np.where(dead, bad, x))
    return out


@pytest.mark.parametrize("implementation", ["xla", "xla_split", "pallas"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_masked_slots_never_reach_the_output(name, implementation):
    """NaN / Inf in every slot no query may see (unused blocks, block tails, the blocks behind padding columns of
    the block table) leave decode and unified attention bit-identical to the same pool with zeros there: masked
    positions are excluded by selection, not multiplied by a zero probability. The ragged batch of the kernel
    cases (lengths 1, bs - 1, bs, bs + 1, 5 bs + 3: exact multiples of the block size and not; decode tokens, a
    3-token chunk, a whole-sequence prefill, a 20-token chunk), split into several partitions where the
    implementation splits."""
    fmt = FORMATS[name]
    (q, fields, tables, seq_lens, qsl, _), qd = kernel_case(name, seed=5)
    bad = poison(fields, tables, seq_lens, seed=1)
    outs = {}
    if implementation != "xla_split":
        kw = dict(
            fmt=fmt, implementation=implementation, partitions=None if implementation == "xla" else CASES[name][3]
        )
        outs["unified"] = [attend(q, f, tables, seq_lens, qsl, **kw) for f in (fields, bad)]
    if implementation != "pallas" or name in DECODE_FORMATS:
        kw = dict(fmt=fmt, implementation=implementation, partitions=_decode_partitions(name, implementation))
        outs["decode"] = [attend_decode(qd, f, tables, seq_lens, **kw) for f in (fields, bad)]
    for entry, (clean, poisoned) in outs.items():
        assert np.isfinite(np.asarray(clean)).all(), entry
        np.testing.assert_array_equal(_bits(poisoned), _bits(clean), err_msg=entry)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_no_leak_between_sequences(implementation):
    """The longest sequence's outputs (a 20-token chunk of 83 tokens) do not change when every block it does not
    own is overwritten with random bytes, while the other sequences' outputs do."""
    name = "fp4"
    fmt = FORMATS[name]
    (q, fields, tables, seq_lens, qsl, _), _ = kernel_case(name, seed=3)
    parts = CASES[name][3] if implementation == "pallas" else None
    kw = dict(fmt=fmt, implementation=implementation, partitions=parts)
    out = np.asarray(attend(q, fields, tables, seq_lens, qsl, **kw))
    owned = set(np.asarray(tables[-1, : -(-SEQ_LENS[-1] // BS)]).tolist())
    others = np.array([b for b in range(fields["k_codes"].shape[0]) if b not in owned])
    rng = np.random.default_rng(0)
    garbage = {
        n: x.at[others].set(jnp.asarray(rng.integers(0, 256, x[others].shape), x.dtype)) for n, x in fields.items()
    }
    changed = np.asarray(attend(q, garbage, tables, seq_lens, qsl, **kw))
    mine = slice(int(qsl[-2]), int(qsl[-1]))
    np.testing.assert_array_equal(_bits(changed[mine]), _bits(out[mine]))
    assert not np.allclose(changed[: mine.start], out[: mine.start])  # the garbage did reach the others


def test_num_partitions():
    """Enough programs for the target, never fewer than min_blocks blocks per partition, within 1..max_blocks."""
    assert attention_kernel.num_partitions(8192, 16, target=512, min_blocks=8) == 32  # 128K tokens, 16 programs
    assert attention_kernel.num_partitions(8192, 512, target=512, min_blocks=8) == 1  # enough programs already
    assert attention_kernel.num_partitions(20, 1, target=512, min_blocks=8) == 2  # short: 8+ blocks each
    assert attention_kernel.num_partitions(3, 1, target=512, min_blocks=8) == 1


@pytest.mark.parametrize("name", list(FORMATS))
def test_write_kernel_matches_reference_bit_for_bit(name):
    """Quantise-and-write: the kernel stores the same bytes as the XLA write (including skipped slots, zeros,
    a negative zero and magnitudes over four decades), and leaves every other slot untouched."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(1)
    t, num_kv, d = 9, 2, 128
    k = rng.normal(size=(t, num_kv, d)) * 10.0 ** rng.uniform(-2, 2, size=(t, 1, 1))
    k[0, 0, :32], k[1, 0, 5] = 0.0, -0.0
    v = rng.normal(size=(t, num_kv, d))
    pool = PagedPool.create(fmt, num_layers=1, num_kv_heads=num_kv, head_dim=d, block_size=BS, num_blocks=6)
    before = {
        n: jnp.asarray(rng.integers(0, 255, x.shape, np.uint8)).view(x.dtype)
        if x.dtype.itemsize == 1
        else jnp.asarray(rng.normal(size=x.shape)).astype(x.dtype)
        for n, x in pool.layer(0).items()
    }
    slots = jnp.asarray(np.array([3, 17, -1, 40, 95, 0, 50, 51, 52], np.int32))
    args = (before, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), slots)
    ref = store(*args, fmt=fmt)
    out = store(*args, fmt=fmt, implementation="pallas")
    written = np.zeros(6 * BS, bool)
    written[np.asarray(slots)[np.asarray(slots) >= 0]] = True
    for n in ref:
        r, o, b = (np.asarray(x)[..., None].view(np.uint8) for x in (ref[n], out[n], before[n]))
        np.testing.assert_array_equal(o, r, err_msg=n)
        untouched = ~written.reshape(6, BS)
        np.testing.assert_array_equal(
            o.transpose(0, 2, 1, *range(3, o.ndim))[untouched],
            b.transpose(0, 2, 1, *range(3, b.ndim))[untouched],
            err_msg=n,
        )


@pytest.mark.parametrize("name", list(FORMATS))
def test_write_stores_each_slot_as_numpy_assignment_does(name):
    """The XLA write (a scatter of each field's bits) equals NumPy's assignment of the quantised values to each
    non-negative slot, byte for byte, with a negative slot skipped and every other slot untouched."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(2)
    t, num_kv, d, blocks = 5, 2, 128, 3
    k, v = (jnp.asarray(rng.normal(size=(t, num_kv, d)), jnp.float32) for _ in range(2))
    pool = PagedPool.create(fmt, num_layers=1, num_kv_heads=num_kv, head_dim=d, block_size=BS, num_blocks=blocks)
    before = {
        n: jnp.asarray(rng.integers(0, 255, x.shape, np.uint8)).view(x.dtype)
        if x.dtype.itemsize == 1
        else jnp.asarray(rng.normal(size=x.shape)).astype(x.dtype)
        for n, x in pool.layer(0).items()
    }
    slots = np.array([7, -1, 16, 40, 2], np.int32)
    out = store(before, k, v, jnp.asarray(slots), fmt=fmt)
    new = fmt.quantize(k, v)
    for n, x in before.items():
        want = np.array(x)
        for i, slot in enumerate(slots):
            if slot >= 0:
                want[slot // BS, :, slot % BS] = np.asarray(new[n][i]).astype(x.dtype)
        np.testing.assert_array_equal(np.asarray(out[n])[..., None].view(np.uint8), want[..., None].view(np.uint8))


def test_pool_sized_in_bytes():
    """One byte budget holds 512 / 136 = 3.76x as many fp4 tokens as bf16 tokens (D = 128), in whole blocks."""
    budget = 40 * 1024 * 1024
    tokens = {}
    for name in ("bf16", "fp4"):
        pool = PagedPool.create(formats.get(name), num_layers=2, num_kv_heads=2, head_dim=128, memory_bytes=budget)
        assert pool.nbytes <= budget < pool.nbytes + 2 * BS * formats.get(name).bytes_per_token(2, 128)
        tokens[name] = pool.num_blocks * BS
    assert abs(tokens["fp4"] / tokens["bf16"] - 512 / 136) < 0.01
    with pytest.raises(ValueError, match="holds no block"):
        PagedPool.create(formats.get("bf16"), num_layers=2, num_kv_heads=2, head_dim=128, memory_bytes=1000)


def test_bad_input_is_named():
    fmt = FORMATS["fp4"]
    q, fields, tables, seq_lens, _qsl, _ = make_case(fmt, [20], [1], num_kv=2, groups=2, head_dim=64)
    with pytest.raises(ValueError, match="implementation = 'cuda'"):
        decode_attention(q, fields, tables, seq_lens, fmt=fmt, implementation="cuda")
    with pytest.raises(ValueError, match="do not match format"):
        decode_attention(q, fields, tables, seq_lens, fmt=FORMATS["bf16"])
    with pytest.raises(ValueError, match="multiple of the cache's 2 KV heads"):
        decode_attention(q[:, :3], fields, tables, seq_lens, fmt=fmt)
    with pytest.raises(ValueError, match="partitions = 9"):
        decode_attention(q, fields, tables, seq_lens, fmt=fmt, implementation="pallas", partitions=9)
    with pytest.raises(ValueError, match="partitions applies to implementation="):
        decode_attention(q, fields, tables, seq_lens, fmt=fmt, implementation="xla", partitions=2)
    # shapes and dtypes through chex, each message naming the argument and what it must be
    with pytest.raises(AssertionError, match=r"rank 2 .* expected 3.*q: \[tokens or sequences, heads, head_dim\]"):
        decode_attention(q[0], fields, tables, seq_lens, fmt=fmt)
    with pytest.raises(AssertionError, match="float32 but expected <class 'int'>.*block_tables and seq_lens"):
        decode_attention(q, fields, tables.astype(jnp.float32), seq_lens, fmt=fmt)
    with pytest.raises(AssertionError, match="int32 but expected <class 'float'>.*q: a floating-point query"):
        decode_attention(q.astype(jnp.int32), fields, tables, seq_lens, fmt=fmt)
    with pytest.raises(AssertionError, match="slot_mapping: integer slots"):
        write(fields, q[:, :2], q[:, :2], jnp.arange(q.shape[0], dtype=jnp.float32), fmt=fmt)


@pytest.mark.parametrize("name", list(FORMATS))
def test_kernels_lower_to_triton(name):
    """The unified, decode and write kernels lower to Triton IR for CUDA (no GPU needed: lowering stops before
    PTX), so a GPU run does not meet an unsupported primitive first."""
    fmt = FORMATS[name]
    kv, d = 2, 128
    fields = {n: jax.ShapeDtypeStruct((8, kv, BS, *shape[1:]), dt) for n, (shape, dt) in fmt.fields(kv, d).items()}
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    attend = jax.jit(lambda *a: attention_kernel.unified_attention(*a, fmt=fmt, max_query_len=3, partitions=2))
    text = attend.trace(f32(5, 8, d), fields, i32(3, 4), i32(3), i32(4)).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text
    decode = jax.jit(lambda *a: attention_kernel.decode_attention(*a, fmt=fmt, partitions=2))
    text = decode.trace(f32(3, 8, d), fields, i32(3, 4), i32(3)).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text
    from kvcache.kernels import write as write_kernel

    store = jax.jit(lambda *a: write_kernel.write(*a, fmt=fmt))
    text = store.trace(fields, f32(7, kv, d), f32(7, kv, d), i32(7)).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text
