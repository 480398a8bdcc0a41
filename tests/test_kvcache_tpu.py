"""The Mosaic TPU paged-attention kernels (kvcache.kernels.tpu_attention) against the XLA reference, run on this
CPU in TPU interpret mode with the race detector on and uninitialised memory (the VMEM scratch) filled with NaN
(`interpret=None`: on a TPU backend the same tests run the kernels compiled, with no race detector).

Every case checks four properties at once, on one compiled program: the kernel equals `kvcache.reference` within
float32 rounding; the same pool with NaN / Inf in every slot no sequence owns (unused blocks, the tails of last
blocks, the blocks behind padding columns of the block table) gives a bit-identical output (masking by selection);
the output is finite; the interpreter's happens-before race detector found no race in the double-buffered DMAs.
A deliberately racy kernel shows the detector is live, so "no race" means something.

The ragged batch (block size bs): lengths 1, bs - 3 (ends mid-block), 3 bs (fills the whole block table) and
bs + 5; for the unified kernel, query chunks of 1 (decode), 3, 2 bs and bs + 5 tokens (a whole-sequence prefill).
Pools are written by kvcache's own quantise-on-write (`kvcache.reference.write`) into shuffled blocks.

The quantise-on-write kernel (kvcache.kernels.tpu_write) must store exactly `kvcache.reference.write`'s bytes into
a pool of random bytes (slots it is not given stay unchanged), with no race.

Interpreted TPU kernels compile and run slowly (seconds per shape), so by default: the decode kernel for every
format in `formats.NAMES` (head dims 64 and 128, block sizes 16 and 32, GQA 1 to 8, one and two partitions spread
over them), the unified kernel for two, the write kernel for every format at D = 128, the race-detector check and
the TPU lowering of every format at D = 128. The full matrix (every format x head dims 64, 128, 256 x block sizes
16, 32, decode and unified, and the fp4 variants; the write kernel at head dims 64, 256, 80, 96) is marked `slow`
(`pytest -m slow tests/test_kvcache_tpu.py`).
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
from test_kvcache_attention import poison

from kvcache import PagedPool, formats, reference
from kvcache import attention as kv_attention
from kvcache.kernels import tpu_attention, tpu_write

_write = jax.jit(reference.write, static_argnames=("fmt",))
_ref_decode = jax.jit(reference.decode_attention, static_argnames=("fmt",))
_ref_unified = jax.jit(reference.unified_attention, static_argnames=("fmt", "max_query_len"))
_decode = jax.jit(tpu_attention.decode_attention, static_argnames=("fmt", "partitions", "interpret"))
_unified = jax.jit(tpu_attention.unified_attention, static_argnames=("fmt", "max_query_len", "partitions", "interpret"))
_tpu_write = jax.jit(tpu_write.write, static_argnames=("fmt", "interpret"))


def races_found() -> bool:
    """Whether the TPU interpreter's race detector flagged a race in the last interpreted kernel (its state is
    reset when a kernel starts; jax exposes it only as module state of the interpreter). On a TPU backend the
    kernels run compiled (interpret=None), with no detector: False."""
    if jax.default_backend() == "tpu":
        return False
    state = importlib.import_module("jax._src.pallas.mosaic.interpret.interpret_pallas_call").races
    assert state is not None, "no TPU-interpreted kernel ran"
    return bool(state.races_found)


def seq_lens_for(bs):
    """Lengths 1, bs - 3 (mid-block), 3 bs (a full block table) and bs + 5."""
    return [1, bs - 3, 3 * bs, bs + 5]


def q_lens_for(bs):
    """Query chunks of the unified batch: decode, 3 tokens, 2 bs tokens, a whole-sequence prefill."""
    return [1, 3, 2 * bs, bs + 5]


def make_case(fmt, seq_lens, q_lens, *, num_kv, groups, head_dim, bs, seed=0):
    """(q [T, H, D], fields [NB, K, bs, ...], block tables [B, MB], seq_lens [B], query_start_loc [B + 1]): every
    sequence's random K/V written by `reference.write` into shuffled blocks; MB = the longest sequence's blocks (its
    table is full), shorter tables padded with blocks no sequence owns; unowned slots zero."""
    rng = np.random.default_rng(seed)
    per_seq = [-(-s // bs) for s in seq_lens]
    max_blocks, spare = max(per_seq), 2
    order = rng.permutation(sum(per_seq) + spare)
    tables = np.zeros((len(seq_lens), max_blocks), np.int32)
    slots, c = [], 0
    for b, (s, n) in enumerate(zip(seq_lens, per_seq)):
        tables[b, :n] = order[c : c + n]
        tables[b, n:] = order[-1 - b % spare]
        c += n
        pos = np.arange(s)
        slots.append(tables[b, pos // bs] * bs + pos % bs)
    tokens = sum(seq_lens)
    k = rng.normal(size=(tokens, num_kv, head_dim)) * rng.uniform(0.5, 3.0, size=(tokens, num_kv, 1))
    v = rng.normal(size=(tokens, num_kv, head_dim))
    pool = PagedPool.create(
        fmt, num_layers=1, num_kv_heads=num_kv, head_dim=head_dim, block_size=bs, num_blocks=len(order)
    )
    fields = _write(
        pool.layer(0),
        jnp.asarray(k, jnp.float32),
        jnp.asarray(v, jnp.float32),
        jnp.asarray(np.concatenate(slots)),
        fmt=fmt,
    )
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.normal(size=(qsl[-1], num_kv * groups, head_dim)).astype(np.float32)
    return jnp.asarray(q), fields, jnp.asarray(tables), jnp.asarray(np.array(seq_lens, np.int32)), jnp.asarray(qsl)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def check(run, fields, tables, seq_lens, ref, seed):
    """run(fields) on the clean pool matches `ref` with no race; on the poisoned pool it is bit-identical."""
    clean = np.asarray(run(fields))
    assert not races_found()
    assert np.isfinite(clean).all()
    np.testing.assert_allclose(clean, np.asarray(ref), rtol=1e-5, atol=1e-5)
    poisoned = np.asarray(run(poison(fields, tables, seq_lens, seed=seed)))
    assert not races_found()
    np.testing.assert_array_equal(_bits(poisoned), _bits(clean))


def run_decode(fmt, head_dim, bs, groups, num_kv, partitions, seed=0):
    q, fields, tables, seq_lens, _ = make_case(
        fmt, seq_lens_for(bs), [1] * 4, num_kv=num_kv, groups=groups, head_dim=head_dim, bs=bs, seed=seed
    )
    ref = _ref_decode(q, fields, tables, seq_lens, fmt=fmt)
    run = lambda f: _decode(q, f, tables, seq_lens, fmt=fmt, partitions=partitions, interpret=None)  # noqa: E731
    check(run, fields, tables, seq_lens, ref, seed)


def run_unified(fmt, head_dim, bs, groups, num_kv, partitions, seed=0):
    q_lens = q_lens_for(bs)
    q, fields, tables, seq_lens, qsl = make_case(
        fmt, seq_lens_for(bs), q_lens, num_kv=num_kv, groups=groups, head_dim=head_dim, bs=bs, seed=seed
    )
    ref = _ref_unified(q, fields, tables, seq_lens, qsl, fmt=fmt, max_query_len=max(q_lens))
    kw = dict(fmt=fmt, max_query_len=max(q_lens), partitions=partitions, interpret=None)
    run = lambda f: _unified(q, f, tables, seq_lens, qsl, **kw)  # noqa: E731
    check(run, fields, tables, seq_lens, ref, seed)


# Default decode cases, one per format: (head dim, block size, GQA group size, KV heads, partitions).
DECODE_CASES = {
    "bf16": (64, 16, 1, 2, 1),  # GQA 1: one query head padded to 8 rows
    "fp8": (64, 32, 4, 1, 2),  # per-token scales, block size 32, two partitions (the short sequences' 2nd empty)
    "fp4": (128, 16, 2, 2, 2),  # two packed 32-byte chunks per row, UE8M0 group scales
    "nvfp4": (64, 16, 8, 1, 1),  # E4M3 scales per 16, GQA 8 (no padded rows)
    "k8v4": (128, 32, 2, 1, 1),  # per-token K scales, per-group V scales
}
UNIFIED_CASES = {"fp4": (128, 16, 2, 1, 2), "k8v4": (64, 32, 1, 2, 1)}
VARIANTS = {
    "fp4-mx-norot": formats.get("fp4", scale_rule="mx", rotate_k=False),
    "fp4-symmetric": formats.get("fp4", rotate_v=True),
    "fp4-e1m2": formats.get("fp4", grid="e1m2"),
    "nvfp4-4over6": formats.get("nvfp4", select="4over6"),
}
FULL = [
    (name, d, bs, (1, 2, 4)[(i + j) % 3], 1 + (i + j) % 2)
    for i, name in enumerate(formats.NAMES)
    for j, (d, bs) in enumerate((d, bs) for d in (64, 128, 256) for bs in (16, 32))
]


def test_names_cover_the_registry():
    assert sorted(DECODE_CASES) == sorted(formats.NAMES)


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_matches_reference(name):
    """Decode (one query per sequence) over the ragged batch: equals the reference, ignores poisoned slots bit for
    bit, no race."""
    run_decode(formats.get(name), *DECODE_CASES[name])


@pytest.mark.parametrize("name", list(UNIFIED_CASES))
def test_unified_matches_reference(name):
    """Unified attention (decode tokens, prefill chunks, causal inside each) over the ragged batch: equals the
    reference, ignores poisoned slots bit for bit, no race."""
    run_unified(formats.get(name), *UNIFIED_CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name,head_dim,bs,groups,partitions", FULL)
def test_decode_full_matrix(name, head_dim, bs, groups, partitions):
    run_decode(formats.get(name), head_dim, bs, groups, 2, partitions, seed=head_dim + bs)


@pytest.mark.slow
@pytest.mark.parametrize("name,head_dim,bs,groups,partitions", FULL)
def test_unified_full_matrix(name, head_dim, bs, groups, partitions):
    run_unified(formats.get(name), head_dim, bs, groups, 2, partitions, seed=head_dim + bs)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_format_variants(name):
    """The fp4 / nvfp4 options: scale rule, unrotated K, rotated V (output rotated back), uniform grid, 4 over 6."""
    run_decode(VARIANTS[name], 64, 16, 4, 2, 2)
    run_unified(VARIANTS[name], 64, 16, 2, 2, 1)


def write_case(fmt, head_dim, *, num_kv=2, bs=16, num_blocks=6, seed=0):
    """(pool fields [NB, K, bs, ...] of random bytes (NaN patterns included), k, v [9, K, D], slots [9]): 9 tokens
    into shuffled blocks, mid-block and at both ends of a block, adjacent slots, one skipped (slot -1); one token's
    K head all zero (absmax 0)."""
    rng = np.random.default_rng(seed)
    fields = {}
    for n, (shape, dt) in fmt.fields(num_kv, head_dim).items():
        size = np.dtype(dt).itemsize
        raw = rng.integers(0, 256, size=(num_blocks, num_kv, bs, *shape[1:], size), dtype=np.uint8)
        fields[n] = jnp.asarray(raw.view(dt).reshape(num_blocks, num_kv, bs, *shape[1:]))
    b = rng.permutation(num_blocks)
    slots = [b[0] * bs + 3, b[1] * bs, -1, b[0] * bs + bs - 1, b[2] * bs + 5, b[3] * bs + 1, b[4] * bs + 9]
    slots += [b[5] * bs + bs - 1, b[2] * bs + 6]  # distinct: the order of writes to one slot is unspecified
    k = rng.normal(size=(9, num_kv, head_dim)) * rng.uniform(0.1, 4.0, size=(9, num_kv, 1))
    k[4, 0] = 0.0
    v = rng.normal(size=(9, num_kv, head_dim))
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return fields, f32(k), f32(v), jnp.asarray(np.array(slots, np.int32))


def check_write(name, head_dim):
    """The interpreted TPU write kernel stores `reference.write`'s bytes in every field, with no race."""
    fmt = formats.get(name)
    fields, k, v, slots = write_case(fmt, head_dim, seed=head_dim)
    out = _tpu_write(fields, k, v, slots, fmt=fmt, interpret=None)
    jax.block_until_ready(out)
    assert not races_found()
    ref = _write(fields, k, v, slots, fmt=fmt)
    assert sorted(out) == sorted(ref)
    for n in ref:
        np.testing.assert_array_equal(np.asarray(out[n]).view(np.uint8), np.asarray(ref[n]).view(np.uint8), n)


@pytest.mark.parametrize("name", formats.NAMES)
def test_write_matches_reference(name):
    check_write(name, 128)


@pytest.mark.slow
@pytest.mark.parametrize("name", formats.NAMES)
@pytest.mark.parametrize("head_dim", [64, 256, 80, 96])
def test_write_full_matrix(name, head_dim):
    """Other head dims: 64, 256, and 80 / 96 (stored padded: 96 for bf16 / fp8, 128 for the 4-bit formats)."""
    check_write(name, head_dim)


def test_write_through_the_registry():
    """`kvcache.attention.write` with implementation="pallas_tpu" runs the TPU write kernel (interpreted here)."""
    fmt = formats.get("k8v4")
    fields, k, v, slots = write_case(fmt, 64, num_kv=1, seed=1)
    out = kv_attention.write(fields, k, v, slots, fmt=fmt, implementation="pallas_tpu", interpret=None)
    assert not races_found()
    ref = _write(fields, k, v, slots, fmt=fmt)
    for n in ref:
        np.testing.assert_array_equal(np.asarray(out[n]).view(np.uint8), np.asarray(ref[n]).view(np.uint8), n)


def test_race_detector_is_live():
    """A kernel that reads its DMA destination before waiting on the copy is flagged as a race, so the zero-race
    assertions above are meaningful."""

    def racy(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        o_ref[...] = buf[...]  # read while the DMA may still write
        copy.wait()

    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    pl.pallas_call(
        racy,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA(())],
        interpret=tpu_attention.interpret_params(True),
    )(x).block_until_ready()
    assert races_found()


def test_interpret_params():
    params = tpu_attention.interpret_params(None)  # this CPU is not a TPU
    assert isinstance(params, pltpu.InterpretParams)
    assert params.detect_races and params.uninitialized_memory == "nan"
    assert tpu_attention.interpret_params(True) == params
    assert tpu_attention.interpret_params(False) is False


def test_bad_input_is_named():
    fmt = formats.get("fp4")
    q, fields, tables, seq_lens, _ = make_case(fmt, [20], [1], num_kv=2, groups=2, head_dim=64, bs=16)
    with pytest.raises(ValueError, match="partitions = 3; allowed: 1 .. block-table width 2"):
        tpu_attention.decode_attention(q, fields, tables, seq_lens, fmt=fmt, partitions=3)
    with pytest.raises(ValueError, match=r"q.shape = \(1, 3, 64\); allowed: .* multiple of its 2 KV heads"):
        tpu_attention.decode_attention(q[:, :3], fields, tables, seq_lens, fmt=fmt)
    with pytest.raises(ValueError, match="fields = .*; format bf16 stores its keys in 'k'"):
        tpu_attention.decode_attention(q, fields, tables, seq_lens, fmt=formats.get("bf16"))
    with pytest.raises(ValueError, match=r"block_tables \(2,\) / seq_lens \(1,\); allowed: \[B, MB\] / \[B\]"):
        tpu_attention.decode_attention(q, fields, tables[0], seq_lens, fmt=fmt)


def test_vmem_model():
    """The VMEM model: its docstring's example, the pages term from the format's bytes per token, monotone."""
    fp4 = formats.get("fp4")
    assert tpu_attention.vmem_bytes(fp4, rows=8, head_dim=128, block_size=16) == 37_696
    base = dict(rows=8, head_dim=128, block_size=16)
    for name in formats.NAMES:
        fmt = formats.get(name)
        at = tpu_attention.vmem_bytes(fmt, **base)
        assert at - tpu_attention.vmem_bytes(formats.get("fp4"), **base) == 32 * (fmt.bytes_per_token(1, 128) - 136)
        for key in base:
            assert tpu_attention.vmem_bytes(fmt, **{**base, key: 2 * base[key]}) > at
    with pytest.raises(ValueError, match="block_size = 0; must be >= 1"):
        tpu_attention.vmem_bytes(fp4, rows=8, head_dim=128, block_size=0)


@pytest.mark.parametrize("name", formats.NAMES)
def test_compiled_kernels_lower_for_tpu(name):
    """The compiled (interpret=False) decode, unified and write kernels lower to a Mosaic `tpu_custom_call` on this
    CPU at D = 128 (lowering stops before Mosaic compiles), so a TPU run does not meet an unlowerable primitive
    first."""
    fmt, kv, d, bs = formats.get(name), 2, 128, 16
    fields = {n: jax.ShapeDtypeStruct((8, kv, bs, *shape[1:]), dt) for n, (shape, dt) in fmt.fields(kv, d).items()}
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    decode = jax.jit(lambda *a: tpu_attention.decode_attention(*a, fmt=fmt, partitions=2, interpret=False))
    text = decode.trace(f32(3, 8, d), fields, i32(3, 4), i32(3)).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    unified = jax.jit(
        lambda *a: tpu_attention.unified_attention(*a, fmt=fmt, max_query_len=3, partitions=2, interpret=False)
    )
    text = unified.trace(f32(5, 8, d), fields, i32(3, 4), i32(3), i32(4)).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    # The write kernel's jnp.sign (nvfp4's level rounding) lowers by the TPU generation: name a chip (v5e).
    chip = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    write = jax.jit(lambda *a: tpu_write.write(*a, fmt=fmt, interpret=False))
    with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=chip)):
        text = write.trace(fields, f32(7, kv, d), f32(7, kv, d), i32(7)).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


def test_vmem_budget_picks_the_tile_and_the_limit():
    """bf16 at D = 256 against each TPU's VMEM (`vmem_bytes`, the model checked above): GQA 32 with 4,096-token
    pages needs 20,975,616 B at tile 16, over v5e's 16 MiB scoped default, so the tile halves to 8 (15,206,400 B); a
    v6e (32 MiB) keeps 16. Decode over 8,192-token pages needs 19,185,728 B at tile 1: a v5e compiles with its
    physical 128 MiB as the limit (the lowered program differs), a v4 (16 MiB in all) refuses with the numbers, and
    so does the kernel call before anything compiles; a GPU family is refused."""
    fmt = formats.get("bf16")
    need = lambda rows, bs: tpu_attention.vmem_bytes(fmt, rows=rows, head_dim=256, block_size=bs)  # noqa: E731
    assert (need(512, 4096), need(256, 4096), need(8, 8192)) == (20_975_616, 15_206_400, 19_185_728)
    fit = lambda device, bs, groups, **kw: tpu_attention.fit_tile(  # noqa: E731
        fmt, tile=16, groups=groups, head_dim=256, block_size=bs, device=device, **kw
    )
    assert fit("tpu_v5e", 4096, 32) == (8, None)
    assert fit("tpu_v6e", 4096, 32) == (16, None)
    assert fit("tpu_v5e", 8192, 1) == (1, 128 * 2**20)
    with pytest.raises(NotImplementedError, match="query tile 1, D = 256.* needs 19,185,728 B of VMEM; tpu_v4 has"):
        fit("tpu_v4", 8192, 1)
    with pytest.raises(NotImplementedError, match="runs on a TPU: device = 'h100'"):
        fit("h100", 256, 1)

    fields = {n: jax.ShapeDtypeStruct((4, 1, 8192, *s[1:]), dt) for n, (s, dt) in fmt.fields(1, 256).items()}
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    args = (jax.ShapeDtypeStruct((2, 1, 256), jnp.float32), fields, i32(2, 2), i32(2))

    def lowered(device):
        fn = jax.jit(lambda *a: tpu_attention.decode_attention(*a, fmt=fmt, interpret=False, device=device))
        return fn.trace(*args).lower(lowering_platforms=("tpu",)).as_text()

    assert lowered("tpu_v5e") != lowered("tpu_v6e")  # the raised VMEM limit reaches the Mosaic call
    with pytest.raises(NotImplementedError, match="tpu_v4 has 16,777,216 B"):
        lowered("tpu_v4")
