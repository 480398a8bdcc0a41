"""The multi-round agent workload and its driver."""

import pytest
from flax import nnx

from core.byte_tokenizer import ByteTokenizer
from core.model import Transformer, TransformerConfig
from kvcache import formats
from kvcache.serving import Engine, EngineConfig
from kvcache.serving import workload as workload_lib

CFG = TransformerConfig(vocab_size=264, d_model=128, num_layers=2, num_heads=2, num_kv_heads=1, d_ff=96)
SMALL = workload_lib.AgentWorkload(
    conversations=3,
    concurrency=2,
    rounds=3,
    system_prefix=20,
    conversation_prefix=40,
    new_input=(5, 9),
    output_tokens=4,
    seed=1,
)


def test_conversations_share_the_system_prefix_and_are_reproducible():
    a, b = workload_lib.conversations(SMALL), workload_lib.conversations(SMALL)
    assert [c.history for c in a] == [c.history for c in b] and [c.inputs for c in a] == [c.inputs for c in b]
    assert all(c.history[:20] == a[0].history[:20] for c in a) and a[0].history[20:] != a[1].history[20:]
    assert all(len(c.history) == 60 and all(5 <= len(i) <= 9 for i in c.inputs) for c in a)
    assert SMALL.max_tokens == 60 + 3 * (9 + 4)


def test_driver_runs_every_round_and_the_history_hits_the_cache():
    """Each conversation's rounds run in order with the full history as prompt; with memory for everything, round
    r + 1 finds the full blocks of round r's prompt in the prefix cache."""
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    config = EngineConfig.for_tokenizer(
        ByteTokenizer(), memory_bytes=1 << 20, max_num_batched_tokens=32, max_model_len=128
    )
    engine = Engine(model, formats.get("fp4"), config)
    seen = []
    result = workload_lib.run(engine, SMALL, progress=lambda done, total: seen.append((done, total)))
    records = result["records"]
    assert len(records) == 9 and seen[-1] == (9, 9)
    inputs = {c.id: c.inputs for c in workload_lib.conversations(SMALL)}
    for conv in range(3):
        rs = sorted((r for r in records if r["conversation"] == conv), key=lambda r: r["round"])
        assert [r["round"] for r in rs] == [0, 1, 2]
        lengths = [r["prompt_tokens"] for r in rs]
        assert lengths[0] == 60 + len(inputs[conv][0])
        for r in (1, 2):  # history + previous output (4 tokens, EOS ignored) + this round's input
            assert lengths[r] == lengths[r - 1] + 4 + len(inputs[conv][r])
            assert rs[r]["cached_tokens"] >= (lengths[r - 1] // 16) * 16 - 16
    assert result["rounds"][0]["hit_rate"] < result["rounds"][2]["hit_rate"]
    assert result["output_tokens"] == 9 * 4 and result["output_throughput"] > 0


def test_bad_workload_is_named():
    with pytest.raises(ValueError, match="concurrency = 0"):
        workload_lib.AgentWorkload(concurrency=0)
    with pytest.raises(ValueError, match="new_input = \\(9, 5\\)"):
        workload_lib.AgentWorkload(new_input=(9, 5))
