"""Lowering for the accelerators on every commit, on this CPU (no GPU or TPU needed): each Pallas kernel of
kvcache.kernels compiled (interpret=False) for "cuda" and "rocm", every KV format x head dims 64, 128, 256; the
model's jitted train step (dense, and MoE with expert parallelism over 8 devices) and the serving engine's step for
"cuda", "rocm" and "tpu". A failure's test id names the program, the format, the head dim and the platform.

Lowering stops at StableHLO with the Triton kernels embedded as their IR (custom call "xla.gpu.triton"): it catches
a primitive, layout or kernel-construction error before a GPU or TPU run meets it, not what only the device's
compiler sees (Triton's PTX / AMDGPU code generation, shared-memory limits past the kernels' own budget check).

What is chosen by backend at trace time is chosen for the CPU that traces (`jax.default_backend()`): the KV
attention dispatcher interprets Pallas kernels on a CPU backend unless told interpret=False, as the engine's step is
here (lowered with the XLA attention and with the platform's kernels inside it), and the kernels are lowered directly
too; the MoE configs name grouped_matmul = "ragged_dot"
rather than "auto" (which picks the CPU's windowed loop). The full kernel matrix (90 lowerings, about 25 s) is
marked slow; the default run keeps every format, kernel, head dim and platform at least once (15)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core import train as train_lib
from core.byte_tokenizer import ByteTokenizer
from core.model import Transformer, TransformerConfig, split_params
from experiments import build
from kvcache import capacity, formats
from kvcache.kernels import attention as attention_kernel
from kvcache.kernels import write as write_kernel
from kvcache.serving import Engine, EngineConfig, programs

from helpers import make_tiny_config

GPU_PLATFORMS = ("cuda", "rocm")
HEAD_DIMS = (64, 128, 256)
KERNELS = ("unified_attention", "decode_attention", "write")
BUDGET_FAMILY = {"cuda": "h100", "rocm": "mi300x"}  # the on-chip budget the attention kernels' tiles are checked by
BS, KV = 16, 2

i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731


def lower_kernel(kernel: str, name: str, head_dim: int, platform: str) -> str:
    """StableHLO text of one kernel for one format, head dim and platform, over abstract arguments: 8 pool blocks of
    16 slots, 2 KV heads and 8 query heads; unified attention over 3 sequences of up to 3 queries (5 tokens) with 2
    KV partitions, decode over 3 sequences, write of 7 tokens."""
    fmt = formats.get(name)
    fields = {
        n: jax.ShapeDtypeStruct((8, KV, BS, *shape[1:]), dt) for n, (shape, dt) in fmt.fields(KV, head_dim).items()
    }
    device = BUDGET_FAMILY[platform]
    if kernel == "unified_attention":
        fn = jax.jit(
            lambda *a: attention_kernel.unified_attention(
                *a, fmt=fmt, max_query_len=3, partitions=2, interpret=False, device=device
            )
        )
        traced = fn.trace(f32(5, 8, head_dim), fields, i32(3, 4), i32(3), i32(4))
    elif kernel == "decode_attention":
        fn = jax.jit(
            lambda *a: attention_kernel.decode_attention(*a, fmt=fmt, partitions=2, interpret=False, device=device)
        )
        traced = fn.trace(f32(3, 8, head_dim), fields, i32(3, 4), i32(3))
    else:
        fn = jax.jit(lambda *a: write_kernel.write(*a, fmt=fmt, interpret=False))
        traced = fn.trace(fields, f32(7, KV, head_dim), f32(7, KV, head_dim), i32(7))
    return traced.lower(lowering_platforms=(platform,)).as_text()


def kernel_case(kernel, name, head_dim, platform, slow=False):
    marks = (pytest.mark.slow,) if slow else ()
    return pytest.param(kernel, name, head_dim, platform, id=f"{kernel}-{name}-d{head_dim}-{platform}", marks=marks)


# Default: each format once, at the next (platform, head dim) pair of a cycle through all six, all three kernels.
_PAIRS = [(platform, d) for d in HEAD_DIMS for platform in GPU_PLATFORMS]
_DEFAULT = {(name, _PAIRS[i % len(_PAIRS)][1], _PAIRS[i % len(_PAIRS)][0]) for i, name in enumerate(formats.NAMES)}
KERNEL_CASES = [
    kernel_case(kernel, name, d, platform, slow=(name, d, platform) not in _DEFAULT)
    for platform, name, d, kernel in itertools.product(GPU_PLATFORMS, formats.NAMES, HEAD_DIMS, KERNELS)
]


@pytest.mark.parametrize("kernel, name, head_dim, platform", KERNEL_CASES)
def test_kernel_lowers(kernel, name, head_dim, platform):
    text = lower_kernel(kernel, name, head_dim, platform)
    assert text.count("xla.gpu.triton") >= 1, f"{kernel} ({name}, D={head_dim}) lowered without its Triton kernel"


def tiny_config(moe: bool):
    """The tiny dense config of tests/helpers, or its MoE form: every block MoE, 8 experts top-2, experts sharded
    over the 8 CPU devices (expert parallelism's all-to-all) and multiplied by ragged_dot."""
    c = make_tiny_config()
    if moe:
        c.moe.every, c.moe.num_experts, c.moe.top_k, c.moe.expert_size = 1, 8, 2, 16
        c.moe.grouped_matmul = "ragged_dot"
        c.mesh.expert = 8
    return c


_TRACED: dict[bool, jax.stages.Traced] = {}


def traced_train_step(moe: bool) -> jax.stages.Traced:
    """The jitted core.train step of the tiny config, traced once per form (lowering it for several platforms
    reuses the trace)."""
    if moe not in _TRACED:
        c = tiny_config(moe)
        _, sharder = build.build_mesh(c)
        model = build.build_model_fn(c, sharder)(nnx.Rngs(0))
        graphdef, params, rest = split_params(model)
        optimizer = build.build_optimizer(c, params)
        state = train_lib.TrainState(jnp.zeros((), jnp.int32), params, rest, optimizer.init(params), jax.random.key(0))
        tokens = jnp.zeros((c.data.batch_size, c.data.seq_len + 1), jnp.int32)
        _TRACED[moe] = jax.jit(train_lib.train_step_fn(graphdef, optimizer)).trace(state, tokens)
    return _TRACED[moe]


@pytest.mark.parametrize(
    "moe, platform",
    [
        pytest.param(False, "cuda", id="dense-cuda"),
        pytest.param(False, "rocm", id="dense-rocm"),
        pytest.param(False, "tpu", id="dense-tpu"),
        pytest.param(True, "cuda", id="moe_ep8-cuda"),
        pytest.param(True, "rocm", id="moe_ep8-rocm", marks=pytest.mark.slow),
        pytest.param(True, "tpu", id="moe_ep8-tpu", marks=pytest.mark.slow),
    ],
)
def test_train_step_lowers(moe, platform):
    text = traced_train_step(moe).lower(lowering_platforms=(platform,)).as_text()
    assert "stablehlo.dot_general" in text
    if moe:  # the expert-parallel dispatch's exchange and the grouped expert products
        assert "all_to_all" in text and "ragged_dot" in text


ENGINE_CFG = TransformerConfig(vocab_size=264, d_model=128, num_layers=2, num_heads=2, num_kv_heads=1, d_ff=96)


@pytest.mark.parametrize(
    "platform, implementation",
    [("cuda", "xla"), ("cuda", "pallas_triton"), ("rocm", "pallas_triton"), ("tpu", "xla"), ("tpu", "pallas_tpu")],
)
def test_engine_step_lowers(platform, implementation):
    """kvcache.serving's step (model over a 16-token batch, KV writes to an fp4 pool, sampling), as the engine's
    warm-up calls it, with the XLA attention or the platform's Pallas kernels compiled (interpret=False) inside it."""
    fmt = formats.get("fp4")
    shape = capacity.ModelShape(ENGINE_CFG.num_layers, ENGINE_CFG.num_kv_heads, ENGINE_CFG.head_dim)
    config = EngineConfig.for_tokenizer(
        ByteTokenizer(),
        memory_bytes=16 * capacity.block_bytes(shape, fmt, block_size=BS),
        block_size=BS,
        max_model_len=128,
        max_num_batched_tokens=16,
        implementation=implementation,
    )
    engine = Engine(Transformer(ENGINE_CFG, rngs=nnx.Rngs(0)), fmt, config)
    n, rows = 16, config.max_num_seqs + 1
    query_start_loc, seq_lens = np.zeros(rows + 1, np.int32), np.ones(rows, np.int32)
    query_start_loc[-1] = seq_lens[-1] = n
    args = (
        engine.graphdef,
        engine.state,
        engine.pool,
        np.zeros(n, np.int32),
        np.arange(n, dtype=np.int32),
        np.zeros(n, np.int32),  # slots: every token written (to slot 0)
        np.zeros((rows, engine.max_blocks), np.int32),
        seq_lens,
        query_start_loc,
        np.zeros(rows, np.int32),
        *engine._sampling_rows([], rows)[:2],
        engine._allowed,
        None,
    )
    traced = programs.forward.trace(*args, max_query_len=n, implementation=implementation, interpret=False)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert "stablehlo.dot_general" in text  # the model
    kernel = {"xla": "scatter", "pallas_triton": "xla.gpu.triton", "pallas_tpu": "tpu_custom_call"}[implementation]
    assert kernel in text  # the KV write into the pool (and, for the kernels, the attention)
    if implementation != "xla":
        assert text.count(kernel) >= 2 * ENGINE_CFG.num_layers, (kernel, text.count(kernel))
    # the K-step decode program: the same step in a scan, one live sequence
    steps = programs.decode_steps.trace(
        *args[:5],
        np.ones(n, bool),
        *args[6:10],
        args[10],
        np.stack([args[11]] * 2),
        args[12],
        block_size=BS,
        implementation=implementation,
        interpret=False,
    )
    text = steps.lower(lowering_platforms=(platform,)).as_text()
    assert "stablehlo.while" in text and kernel in text
