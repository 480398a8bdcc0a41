"""KV capacity planner against independent references: the spec's slot layouts (bytes per token and head), the bytes
a format's quantiser and a paged pool actually store, counting whole blocks one at a time, and the spec's published
figures (20 KiB of bf16 KV per token, 262,144 tokens x ~2.9 concurrency ~ 14.5 GiB, fp4 3.76x denser than bf16)."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvcache import PagedPool, capacity, formats


def _per_head_per_layer(name, d):
    """Bytes of K and V (codes and scales) for one token, head and layer, from the spec's layouts."""
    return {
        "bf16": 2 * 2 * d,  # K and V, 2 bytes each
        "fp8": 2 * (d + 4),  # K and V: one byte per element and one float32 scale
        "fp4": 2 * (d // 2 + d // 32),  # K and V: two codes per byte, one scale byte per 32 elements
        "nvfp4": 2 * (d // 2 + d // 16),  # K and V: two codes per byte, one E4M3 scale byte per 16 elements
        "k8v4": (d + 4) + (d // 2 + d // 32),  # K as fp8's, V as fp4's
    }[name]


def _brute_force_pool_tokens(memory, block_size, bytes_per_token):
    """Whole blocks added one at a time while they fit in `memory`."""
    blocks = 0
    while (blocks + 1) * block_size * bytes_per_token <= memory:
        blocks += 1
    return blocks * block_size


def test_spec_model_holds_20_kib_of_bf16_per_token():
    """The spec's model (10 full-attention layers, 2 KV heads, head dim 256) holds the published 20 KiB of bf16 KV
    per token, and a paged pool of it allocates exactly that per token slot."""
    shape = capacity.SPEC_MODEL
    assert shape == capacity.ModelShape(full_attention_layers=10, num_kv_heads=2, head_dim=256)
    assert capacity.kv_bytes_per_token(shape, "bf16") == 20 * 1024
    pool = PagedPool.create(formats.get("bf16"), num_layers=10, num_kv_heads=2, head_dim=256, num_blocks=1)
    assert pool.nbytes == 20 * 1024 * pool.block_size


@pytest.mark.parametrize("name", formats.NAMES)
@pytest.mark.parametrize("layers, heads, d", [(1, 1, 128), (10, 2, 256), (3, 8, 64)])
def test_bytes_per_token_matches_the_layouts(name, layers, heads, d):
    """kv_bytes_per_token = layers x heads x the spec's slot bytes, = layers x the bytes `Format.quantize` returns
    for one token (what a write stores), for a format given by name or as a Format."""
    shape = capacity.ModelShape(layers, heads, d)
    expected = layers * heads * _per_head_per_layer(name, d)
    assert capacity.kv_bytes_per_token(shape, name) == expected
    assert capacity.kv_bytes_per_token(shape, formats.get(name)) == expected
    kv = jax.ShapeDtypeStruct((1, heads, d), jnp.float32)  # one token: the shapes and dtypes quantize returns
    stored = jax.eval_shape(formats.get(name).quantize, kv, kv)
    assert layers * sum(np.prod(x.shape) * x.dtype.itemsize for x in stored.values()) == expected


def test_fp4_is_136_bytes_at_d128_and_3_76x_denser_than_bf16():
    """The spec's figures: 136 B (fp4) against 512 B (bf16) per token, head and layer at D = 128, so 3.76x the
    tokens in the same memory; at the spec's budget and model the planned pools keep that ratio within a block."""
    one = capacity.ModelShape(1, 1, 128)
    assert capacity.kv_bytes_per_token(one, "fp4") == 136
    assert capacity.kv_bytes_per_token(one, "bf16") == 512
    rows = {r["format"]: r for r in capacity.plan(capacity.SPEC_BUDGET_BYTES, capacity.SPEC_MODEL)}
    assert rows["fp4 (mse)"]["vs_bf16"] == pytest.approx(512 / 136, rel=1e-4)


def test_pool_tokens_matches_adding_blocks_until_memory_runs_out():
    rng = random.Random(0)
    for _ in range(60):
        shape = capacity.ModelShape(rng.randint(1, 4), rng.randint(1, 4), rng.choice([64, 128, 256]))
        name, block_size = rng.choice(formats.NAMES), rng.choice([1, 3, 16, 32])
        per_token = _per_head_per_layer(name, shape.head_dim) * shape.full_attention_layers * shape.num_kv_heads
        block_bytes = block_size * per_token
        memory = rng.randint(0, 300 * block_bytes)
        memory = rng.choice([memory, memory - memory % block_bytes, max(0, memory - memory % block_bytes - 1)])
        expected = _brute_force_pool_tokens(memory, block_size, per_token)
        assert capacity.pool_tokens(memory, shape, name, block_size=block_size) == expected


def test_spec_budget_gives_the_reported_concurrency():
    """The spec's three figures agree through the planner: its budget is 14.5 GiB, holds ~2.9 requests of 262,144
    tokens at 20 KiB per token, and 2.9 x 262,144 tokens need 14.5 GiB in whole blocks."""
    budget = capacity.SPEC_BUDGET_BYTES
    assert budget == pytest.approx(14.5 * 2**30, abs=1)
    tokens = capacity.pool_tokens(budget, capacity.SPEC_MODEL, "bf16")
    assert capacity.concurrency(tokens, 262_144) == pytest.approx(2.9, abs=1e-3)
    need = capacity.memory_for(int(2.9 * 262_144), capacity.SPEC_MODEL, "bf16")
    assert need == pytest.approx(14.5 * 2**30, abs=16 * 20 * 1024)


@pytest.mark.parametrize("name", formats.NAMES)
@pytest.mark.parametrize("block_size", [1, 16, 48])
def test_memory_for_is_the_least_whole_block_memory_holding_n_tokens(name, block_size):
    shape = capacity.ModelShape(2, 4, 128)
    per_token = 2 * 4 * _per_head_per_layer(name, 128)
    rng = random.Random(block_size)
    for n in [0, 1, block_size - 1, block_size, block_size + 1] + [rng.randint(0, 10**6) for _ in range(20)]:
        memory = capacity.memory_for(n, shape, name, block_size=block_size)
        assert memory % (block_size * per_token) == 0
        assert capacity.pool_tokens(memory, shape, name, block_size=block_size) >= n
        assert memory - block_size * per_token < n * per_token


def test_plan_and_markdown_have_one_row_per_format():
    """Each row's numbers against brute-force block counts; the markdown table shows them; a budget below one bf16
    block but above one fp4 block has no bf16 ratio (NaN)."""
    shape, budget, max_len = capacity.SPEC_MODEL, capacity.SPEC_BUDGET_BYTES, capacity.SPEC_MAX_MODEL_LEN
    fmts = ("bf16", formats.get("fp4", scale_rule="mx"), "fp8")
    rows = capacity.plan(budget, shape, fmts)
    assert [r["format"] for r in rows] == ["bf16", "fp4 (mx)", "fp8"]
    per_token = {n: 10 * 2 * _per_head_per_layer(n, 256) for n in ("bf16", "fp4", "fp8")}
    bf16 = _brute_force_pool_tokens(budget, 16, per_token["bf16"])
    for row, name in zip(rows, ("bf16", "fp4", "fp8")):
        tokens = _brute_force_pool_tokens(budget, 16, per_token[name])
        assert row["bytes_per_token"] == per_token[name]
        assert row["pool_tokens"] == tokens
        assert row["concurrency"] == pytest.approx(tokens / max_len, rel=1e-12)
        assert row["vs_bf16"] == pytest.approx(tokens / bf16, rel=1e-12)
    table = capacity.markdown(rows, title="KV", memory_bytes=budget, shape=shape, max_model_len=max_len)
    assert table.startswith("### KV") and "14.50 GiB" in table
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()[-3:]]
    assert [c[0] for c in cells] == ["bf16", "fp4 (mx)", "fp8"]
    assert [int(c[2].replace(",", "")) for c in cells] == [r["pool_tokens"] for r in rows]

    small = 16 * per_token["fp4"]  # one fp4 block, a quarter of a bf16 block
    by_name = {r["format"]: r for r in capacity.plan(small, shape, ("bf16", "fp4"))}
    assert by_name["bf16"]["pool_tokens"] == 0 and by_name["fp4 (mse)"]["pool_tokens"] == 16
    assert np.isnan(by_name["fp4 (mse)"]["vs_bf16"])


_SHAPE = capacity.SPEC_MODEL


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: capacity.ModelShape(0, 2, 256), r"full_attention_layers = 0.*>= 1"),
        (lambda: capacity.ModelShape(10, 2.0, 256), r"num_kv_heads = 2\.0.*int"),  # type: ignore[arg-type]
        (lambda: capacity.ModelShape(10, 2, True), r"head_dim = True"),
        (lambda: capacity.pool_tokens(-1, _SHAPE, "bf16"), r"memory_bytes = -1.*>= 0"),
        (lambda: capacity.pool_tokens(2**30, _SHAPE, "bf16", block_size=0), r"block_size = 0.*>= 1"),
        (lambda: capacity.memory_for(10, _SHAPE, "fp8", block_size=-16), r"block_size = -16"),
        (lambda: capacity.memory_for(-5, _SHAPE, "fp8"), r"tokens = -5"),
        (lambda: capacity.kv_bytes_per_token(_SHAPE, "int4"), r"fmt = 'int4'.*bf16.*fp8.*fp4"),
        (lambda: capacity.concurrency(1000, 0), r"max_model_len = 0.*>= 1"),
        (lambda: capacity.concurrency(-1, 10), r"pool_tokens = -1"),
        (lambda: capacity.plan(2**30, _SHAPE, ()), r"formats = \(\)"),
        (lambda: capacity.plan(2**30, _SHAPE, "fp4"), r"formats = 'fp4'.*sequence"),
        (lambda: capacity.plan(2**30, _SHAPE, ("fp4", "nf4")), r"fmt = 'nf4'"),
        (lambda: capacity.plan(2**30, _SHAPE, max_model_len=0), r"max_model_len = 0"),
    ],
)
def test_bad_inputs_name_the_argument_and_the_rule(call, match):
    with pytest.raises(ValueError, match=match):
        call()
