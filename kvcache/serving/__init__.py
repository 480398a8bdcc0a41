"""The serving runtime over the KV library: continuous batching with chunked prefill, a prefix cache, preemption and
on-device sampling (`core.sampling`), plus a cost-model twin for projections and the multi-round agent workload.

    from kvcache import formats
    from kvcache.serving import Engine, EngineConfig, SamplingParams
    config = EngineConfig.for_tokenizer(tok, eos_ids=(151645,), memory_bytes=2**30)   # + a generation config's ends
    engine = Engine(model, formats.get("fp4"), config)
    request = engine.submit(prompt_ids, 64, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=1))
    engine.run()                                   # request.output: the new token ids

Modules: config (EngineConfig, SamplingParams), scheduler (Request; Scheduler: admission, scheduling, metrics;
EngineCore: holds a Scheduler, steps schedule -> execute -> update_from_output), blocks (BlockManager: reference
counts, prefix cache, LRU eviction), engine (Engine: an EngineCore running the jitted step, and its warm-up),
simulate (an EngineCore on a cost model), workload (the agent workload and its driver).
"""

from kvcache.serving import simulate, workload
from kvcache.serving.blocks import BlockManager, block_hashes
from kvcache.serving.config import MAX_TOP_LOGPROBS, EngineConfig, SamplingParams
from kvcache.serving.engine import Engine
from kvcache.serving.scheduler import EngineCore, Request, Scheduler

__all__ = [
    "MAX_TOP_LOGPROBS",
    "BlockManager",
    "Engine",
    "EngineConfig",
    "EngineCore",
    "Request",
    "SamplingParams",
    "Scheduler",
    "block_hashes",
    "simulate",
    "workload",
]
