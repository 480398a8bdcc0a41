"""A multi-round agent workload (the spec's UltraQuant serving benchmark, scaled down) and its driver.

Each conversation is a shared system prefix, its own prefix (the document or repository an agent works on), then
rounds: every round appends new input tokens (tool results, the user's next turn) to the whole history so far and
generates output tokens, which join the history. A round is submitted when the conversation's previous round
finished (an agent without think time); at most `concurrency` conversations are active, the next one starts when
one ends. With prefix caching, round r + 1 finds round r's history in the cache unless it was evicted: the KV
memory decides the hit rate, and misses are recomputed (prefill) before the first token.

The spec's workload: 100 conversations, 32 concurrent, 6 rounds, 2K shared + ~25K per-conversation prefix, 2-3K
new input and 200 output tokens per round. `AgentWorkload()` defaults to a CPU-sized version.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from core.byte_tokenizer import NUM_BYTES

__all__ = ["AgentWorkload", "Conversation", "conversations", "run"]


@dataclasses.dataclass(frozen=True)
class AgentWorkload:
    conversations: int = 24
    concurrency: int = 8
    rounds: int = 4
    system_prefix: int = 64
    conversation_prefix: int = 768
    new_input: tuple[int, int] = (64, 96)  # uniform in [lo, hi] per round
    output_tokens: int = 16
    seed: int = 0

    def __post_init__(self):
        for name in ("conversations", "concurrency", "rounds", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentWorkload.{name} = {getattr(self, name)}; must be >= 1")
        lo, hi = self.new_input
        if not 1 <= lo <= hi or self.system_prefix < 0 or self.conversation_prefix < 0:
            raise ValueError(
                f"AgentWorkload: new_input = {self.new_input} must satisfy 1 <= lo <= hi; prefixes "
                f"({self.system_prefix}, {self.conversation_prefix}) must be >= 0"
            )

    @property
    def max_tokens(self) -> int:
        """The longest a conversation gets: every prefix, input and output of all its rounds."""
        return self.system_prefix + self.conversation_prefix + self.rounds * (self.new_input[1] + self.output_tokens)


@dataclasses.dataclass
class Conversation:
    id: int
    history: list[int]
    inputs: list[list[int]]  # new input tokens of each round
    round: int = 0


def conversations(workload: AgentWorkload) -> list[Conversation]:
    """The workload's conversations with their random byte tokens (a pure function of `workload.seed`)."""
    rng = np.random.default_rng(workload.seed)
    system = rng.integers(0, NUM_BYTES, workload.system_prefix).tolist()
    out = []
    for i in range(workload.conversations):
        prefix = rng.integers(0, NUM_BYTES, workload.conversation_prefix).tolist()
        inputs = [
            rng.integers(0, NUM_BYTES, rng.integers(workload.new_input[0], workload.new_input[1] + 1)).tolist()
            for _ in range(workload.rounds)
        ]
        out.append(Conversation(i, system + prefix, inputs))
    return out


def run(engine, workload: AgentWorkload, *, progress=None) -> dict:
    """Serves the workload on `engine` (a `kvcache.serving.scheduler.EngineCore`: the engine or a simulated one);
    returns per-request records and per-round summaries (P50 / P90 time to first token, KV hit rate = cached / prompt
    tokens) and the output throughput (output tokens / wall seconds). `progress(done, total)` is called as requests
    finish."""
    pending = conversations(workload)[::-1]
    active, owner, records = 0, {}, []
    total = workload.conversations * workload.rounds

    def submit(conv):
        request = engine.submit(conv.history + conv.inputs[conv.round], workload.output_tokens, ignore_eos=True)
        owner[request.id] = conv

    started = engine.clock()
    while pending or engine.has_work:
        while pending and active < workload.concurrency:
            submit(pending.pop())
            active += 1
        for request in engine.step():
            conv = owner.pop(request.id)
            records.append(
                {
                    "conversation": conv.id,
                    "round": conv.round,
                    "prompt_tokens": len(request.prompt),
                    "cached_tokens": request.cached_tokens,
                    "ttft": request.ttft,
                    "tpot": request.tpot,
                    "output_tokens": len(request.output),
                    "preemptions": request.preemptions,
                }
            )
            conv.history = conv.history + conv.inputs[conv.round] + request.output
            conv.round += 1
            if conv.round < workload.rounds:
                submit(conv)
            else:
                active -= 1
            if progress is not None:
                progress(len(records), total)
    seconds = engine.clock() - started
    rounds = []
    for r in range(workload.rounds):
        rs = [x for x in records if x["round"] == r]
        ttft = np.array([x["ttft"] for x in rs])
        rounds.append(
            {
                "round": r,
                "ttft_p50": float(np.percentile(ttft, 50)),
                "ttft_p90": float(np.percentile(ttft, 90)),
                "hit_rate": sum(x["cached_tokens"] for x in rs) / sum(x["prompt_tokens"] for x in rs),
            }
        )
    out_tokens = sum(x["output_tokens"] for x in records)
    return {
        "records": records,
        "rounds": rounds,
        "seconds": seconds,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / seconds,
        "hit_rate": sum(x["cached_tokens"] for x in records) / sum(x["prompt_tokens"] for x in records),
        "ttft_p50": float(np.percentile([x["ttft"] for x in records], 50)),
        "preemptions": engine.stats["preemptions"],
        "steps": engine.stats["steps"],
    }
