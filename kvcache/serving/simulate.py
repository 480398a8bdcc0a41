"""The serving engine's scheduler driven by a cost model instead of a model: projections at scales a CPU cannot run.

`SimulatedEngine` is an engine core holding the engine's `kvcache.serving.scheduler.Scheduler` (the same admission,
chunked prefill, prefix cache, eviction and preemption) on a virtual clock: each step advances it by `StepCost` of
the batch and yields a fixed token. With the capacity planner's pool size for a model and a KV budget
(`kvcache.capacity.num_blocks`), it projects hit rates, time to first token and throughput of a workload at the
published scale.

Step time (seconds) of a batch of sequences i with c_i tokens cached before the step and n_i new tokens:

    compute = [2 P_active sum_i n_i + 4 L_full H D sum_i n_i (c_i + (n_i + 1) / 2)] / (F * mfu)
    memory  = W / (B * eff) + sum_i (c_i + n_i) b_kv / (B * eff_fmt)
    step    = max(compute, memory) + overhead

P_active active parameters, W the weight bytes a step reads, L_full H D the full-attention layers, query heads and
head dim, b_kv the KV bytes per token (`capacity.kv_bytes_per_token`), F and B the GPU's dense bf16 FLOP/s and
memory bandwidth, eff_fmt the fraction of B the decode kernel reaches for the format. Every number is a parameter;
`H200` and `SPEC_MODEL_SERVING` hold the defaults the projection uses, with their sources.
"""

from __future__ import annotations

import dataclasses

from kvcache import capacity
from kvcache.formats import Format
from kvcache.serving.config import EngineConfig
from kvcache.serving.scheduler import EngineCore, Scheduler

__all__ = ["H200", "SPEC_MODEL_SERVING", "Hardware", "ServedModel", "SimulatedEngine", "StepCost"]


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # dense bf16 FLOP/s
    bandwidth: float  # bytes/s
    memory: float  # bytes
    mfu: float = 0.5  # fraction of `flops` prefill GEMMs reach
    bandwidth_efficiency: float = 0.8  # fraction of `bandwidth` weight streaming reaches


H200 = Hardware("H200", flops=989e12, bandwidth=4.8e12, memory=141e9)
"""NVIDIA H200 SXM: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e, 141 GB (datasheet); mfu and efficiency assumed."""


@dataclasses.dataclass(frozen=True)
class ServedModel:
    shape: capacity.ModelShape  # full-attention layers, KV heads, head dim
    num_heads: int
    active_params: float
    weight_bytes: float  # bytes read per step (all weights: a batch of agents touches nearly every expert)


SPEC_MODEL_SERVING = ServedModel(capacity.SPEC_MODEL, num_heads=16, active_params=3e9, weight_bytes=35e9 * 2)
"""The spec's model (Qwen3.6-35B-A3B: 10 full-attention layers, 2 KV heads, head dim 256; 16 query heads, about 3B
active of 35B parameters, bf16 weights)."""


@dataclasses.dataclass(frozen=True)
class StepCost:
    model: ServedModel
    hardware: Hardware
    kv_bytes_per_token: int
    kernel_efficiency: float  # eff_fmt: fraction of the bandwidth the decode kernel reaches for this format
    overhead: float = 2e-3  # scheduling, sampling, launches (s)

    def __call__(self, batch: list[tuple[int, int]]) -> float:
        """Seconds for a batch of (cached tokens before the step, new tokens) per sequence."""
        m, hw = self.model, self.hardware
        new = sum(n for _, n in batch)
        attention = sum(n * (c + (n + 1) / 2) for c, n in batch)
        s = m.shape
        compute = 2 * m.active_params * new + 4 * s.full_attention_layers * m.num_heads * s.head_dim * attention
        compute /= hw.flops * hw.mfu
        memory = m.weight_bytes / (hw.bandwidth * hw.bandwidth_efficiency)
        memory += sum(c + n for c, n in batch) * self.kv_bytes_per_token / (hw.bandwidth * self.kernel_efficiency)
        return max(compute, memory) + self.overhead


class SimulatedEngine(EngineCore):
    """The engine's scheduler on a virtual clock (`now`, seconds from 0): every step takes `cost(batch)` seconds and
    emits token 65 ("A")."""

    def __init__(self, fmt: Format, config: EngineConfig, model: ServedModel, cost: StepCost):
        blocks = capacity.num_blocks(int(config.memory_bytes), model.shape, fmt, block_size=config.block_size)
        self.cost, self.now = cost, 0.0
        super().__init__(Scheduler(config, fmt, blocks, clock=lambda: self.now))

    def _execute(self, batch):
        self.now += self.cost([(r.num_computed, n) for r, n in batch])
        return [65 if r.num_computed + n == len(r.tokens) else None for r, n in batch]
