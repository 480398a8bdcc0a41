"""KV capacity planner: bytes per token, pool size and concurrency against independent arithmetic and the spec."""

import random

import pytest

from kvcache import capacity, formats


def _per_head_per_layer(name, d):
    """Bytes of K and V (codes and scales) for one token, head and layer, from the spec's layouts."""
    return {
        "bf16": 2 * 2 * d,  # K and V, 2 bytes each
        "fp8": 2 * (d + 4),  # K and V: one byte per element and one float32 scale
        "fp4": 2 * (d // 2 + d // 32),
    }[name]  # K and V: two codes per byte, one scale byte per 32 elements


def test_spec_model_holds_20_kib_of_bf16_per_token():
    assert capacity.kv_bytes_per_token(capacity.SPEC_MODEL, "bf16") == 10 * 2 * 256 * 2 * 2 == 20 * 1024


@pytest.mark.parametrize("name", formats.NAMES)
@pytest.mark.parametrize("layers, heads, d", [(1, 1, 128), (10, 2, 256), (3, 8, 64)])
def test_bytes_per_token_matches_the_layouts(name, layers, heads, d):
    shape = capacity.ModelShape(layers, heads, d)
    expected = layers * heads * _per_head_per_layer(name, d)
    assert capacity.kv_bytes_per_token(shape, name) == expected
    assert capacity.kv_bytes_per_token(shape, formats.get(name)) == expected


def test_fp4_is_136_bytes_at_d128_and_3_76x_denser_than_bf16():
    one = capacity.ModelShape(1, 1, 128)
    assert capacity.kv_bytes_per_token(one, "fp4") == 64 + 4 + 64 + 4 == 136
    assert capacity.kv_bytes_per_token(one, "bf16") == 512
    assert round(512 / 136, 2) == 3.76
    rows = {r["format"]: r for r in capacity.plan(capacity.SPEC_BUDGET_BYTES, capacity.SPEC_MODEL)}
    assert round(rows["fp4 (mse)"]["vs_bf16"], 2) == 3.76
    assert rows["bf16"]["vs_bf16"] == 1.0


def _brute_force_pool_tokens(memory, block_size, bytes_per_token):
    blocks = 0
    while (blocks + 1) * block_size * bytes_per_token <= memory:
        blocks += 1
    return blocks * block_size


def test_pool_tokens_matches_adding_blocks_until_memory_runs_out():
    rng = random.Random(0)
    for _ in range(60):
        shape = capacity.ModelShape(rng.randint(1, 4), rng.randint(1, 4), rng.choice([64, 128, 256]))
        name, block_size = rng.choice(formats.NAMES), rng.choice([1, 3, 16, 32])
        block_bytes = block_size * capacity.kv_bytes_per_token(shape, name)
        memory = rng.randint(0, 300 * block_bytes)
        memory = rng.choice([memory, memory - memory % block_bytes, max(0, memory - memory % block_bytes - 1)])
        expected = _brute_force_pool_tokens(
            memory,
            block_size,
            _per_head_per_layer(name, shape.head_dim) * shape.full_attention_layers * shape.num_kv_heads,
        )
        assert capacity.pool_tokens(memory, shape, name, block_size=block_size) == expected


def test_spec_budget_gives_the_reported_concurrency():
    assert int(14.5 * 2**30) == capacity.SPEC_BUDGET_BYTES
    tokens = capacity.pool_tokens(capacity.SPEC_BUDGET_BYTES, capacity.SPEC_MODEL, "bf16")
    assert capacity.concurrency(tokens, 262_144) == pytest.approx(2.9, abs=0.01)


@pytest.mark.parametrize("name", formats.NAMES)
@pytest.mark.parametrize("block_size", [1, 16, 48])
def test_memory_for_is_the_least_whole_block_memory_holding_n_tokens(name, block_size):
    shape = capacity.ModelShape(2, 4, 128)
    per_token = capacity.kv_bytes_per_token(shape, name)
    rng = random.Random(block_size)
    for n in [0, 1, block_size - 1, block_size, block_size + 1] + [rng.randint(0, 10**6) for _ in range(20)]:
        memory = capacity.memory_for(n, shape, name, block_size=block_size)
        assert memory % (block_size * per_token) == 0
        assert capacity.pool_tokens(memory, shape, name, block_size=block_size) >= n
        assert memory - block_size * per_token < n * per_token


def test_plan_and_markdown_have_one_row_per_format():
    rows = capacity.plan(capacity.SPEC_BUDGET_BYTES, capacity.SPEC_MODEL, ("bf16", formats.get("fp4", scale_rule="mx")))
    assert [r["format"] for r in rows] == ["bf16", "fp4 (mx)"]
    assert rows[0]["pool_tokens"] == capacity.SPEC_BUDGET_BYTES // (16 * 20480) * 16
    assert rows[1]["concurrency"] == rows[1]["pool_tokens"] / capacity.SPEC_MAX_MODEL_LEN
    table = capacity.markdown(
        rows,
        title="KV",
        memory_bytes=capacity.SPEC_BUDGET_BYTES,
        shape=capacity.SPEC_MODEL,
        max_model_len=capacity.SPEC_MAX_MODEL_LEN,
    )
    assert table.startswith("### KV") and "14.50 GiB" in table
    assert [line.split("|")[1].strip() for line in table.splitlines()[-2:]] == ["bf16", "fp4 (mx)"]


_SHAPE = capacity.SPEC_MODEL


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: capacity.ModelShape(0, 2, 256), r"full_attention_layers = 0.*>= 1"),
        (lambda: capacity.ModelShape(10, 2.0, 256), r"num_kv_heads = 2\.0.*int"),
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
