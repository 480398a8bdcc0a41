"""The cost model and the simulated engine (the real scheduler on a virtual clock)."""

import pytest

from core.byte_tokenizer import ByteTokenizer
from kvcache import capacity, formats
from kvcache.serving import EngineConfig
from kvcache.serving import workload as workload_lib
from kvcache.serving.simulate import H200, SPEC_MODEL_SERVING, Hardware, ServedModel, SimulatedEngine, StepCost

TINY = ServedModel(capacity.ModelShape(2, 1, 64), num_heads=2, active_params=1e6, weight_bytes=1e6)
SLOW = Hardware("slow", flops=1e12, bandwidth=1e9, memory=1e9, mfu=0.5, bandwidth_efficiency=0.5)


def test_step_cost_formula():
    """Hand-computed: compute = (2 P n + 4 L H D sum n (c + (n + 1) / 2)) / (F mfu), memory = W / (B eff) +
    sum (c + n) b / (B eff_fmt); step = max + overhead."""
    cost = StepCost(TINY, SLOW, kv_bytes_per_token=256, kernel_efficiency=0.25, overhead=1e-3)
    batch = [(100, 1), (0, 50)]
    compute = (2e6 * 51 + 4 * 2 * 2 * 64 * (1 * 101 + 50 * 25.5)) / 0.5e12
    memory = 1e6 / 0.5e9 + (101 + 50) * 256 / 0.25e9
    assert cost(batch) == pytest.approx(max(compute, memory) + 1e-3)
    assert memory > compute  # this tiny model is bandwidth-bound


def _simulate(name, memory_bytes, workload):
    fmt = formats.get(name)
    cost = StepCost(SPEC_MODEL_SERVING, H200, capacity.kv_bytes_per_token(SPEC_MODEL_SERVING.shape, fmt), 0.8)
    engine = SimulatedEngine(
        fmt,
        EngineConfig.for_tokenizer(
            ByteTokenizer(), memory_bytes=memory_bytes, max_num_seqs=4, max_num_batched_tokens=512, max_model_len=8192
        ),
        SPEC_MODEL_SERVING,
        cost,
    )
    return engine, workload_lib.run(engine, workload)


def test_simulated_engine_keeps_a_virtual_clock_and_the_cache_decides():
    """Pool sizes follow the capacity planner; with room for the working set the later rounds hit the cache and
    their first tokens come sooner than with a pool for about one conversation; fp4 holds 3.76x bf16's tokens."""
    wl = workload_lib.AgentWorkload(
        conversations=6,
        concurrency=4,
        rounds=3,
        system_prefix=64,
        conversation_prefix=1024,
        new_input=(100, 200),
        output_tokens=8,
    )
    per_token = capacity.kv_bytes_per_token(SPEC_MODEL_SERVING.shape, "bf16")
    small, roomy = 3000 * per_token, 20000 * per_token
    eng_small, tight = _simulate("bf16", small, wl)
    eng_roomy, loose = _simulate("bf16", roomy, wl)
    assert eng_small.capacity_tokens == capacity.pool_tokens(small, SPEC_MODEL_SERVING.shape, "bf16")
    assert loose["rounds"][2]["hit_rate"] > 0.8 > tight["rounds"][2]["hit_rate"]
    assert loose["rounds"][2]["ttft_p50"] < tight["rounds"][2]["ttft_p50"]
    assert len(loose["records"]) == 18 and eng_roomy.now == pytest.approx(loose["seconds"])
    fp4, _ = _simulate("fp4", small, wl)
    assert fp4.capacity_tokens / eng_small.capacity_tokens == pytest.approx(512 / 136, rel=0.01)
