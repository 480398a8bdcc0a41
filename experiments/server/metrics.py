"""The server's live metrics, in Prometheus' text format at `GET /metrics` (prometheus_client).

Each server has its own registry (two servers in one process do not share counters). The engine thread updates
them after every step (experiments.server.runner); names follow vLLM's where one exists, with our prefix:

  lowbit_num_requests_running / _waiting           gauges: in the engine's batch / queued (HTTP queue included)
  lowbit_kv_blocks_used / _free / _cached          gauges: pool blocks held by requests / allocatable (free or
                                                   evictable) / of those, holding a cached prefix
  lowbit_prefix_cache_hit_rate                     gauge: prompt tokens found in the prefix cache / prompt tokens
  lowbit_prefix_cache_queries_total / _hits_total  counters of prompt tokens (rate() of their ratio = hit rate)
  lowbit_num_preemptions_total                     counter
  lowbit_engine_steps_total / _step_seconds_total  counters: engine steps, and the seconds spent in them (their
                                                   rate over wall time = how busy the engine is)
  lowbit_time_to_first_token_seconds               histogram: from the HTTP request's arrival to its first token
  lowbit_inter_token_latency_seconds               histogram: between consecutive tokens of a request
  lowbit_request_success_total{finished_reason}    counter: stop / length / abort
  lowbit_prompt_tokens_total / _generation_tokens_total   counters
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from kvcache.serving import Engine, Request

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    """The metrics of one server, labelled with its model name."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(f"lowbit_{name}", doc, list(labels), registry=self.registry).labels(**labels)

        def counter(name, doc):
            return Counter(f"lowbit_{name}", doc, list(labels), registry=self.registry).labels(**labels)

        self.running = gauge("num_requests_running", "requests in the engine's batch")
        self.waiting = gauge("num_requests_waiting", "requests queued, not yet running (HTTP queue included)")
        self.blocks_used = gauge("kv_blocks_used", "KV pool blocks held by requests")
        self.blocks_free = gauge("kv_blocks_free", "KV pool blocks an allocation can take (free or evictable)")
        self.blocks_cached = gauge("kv_blocks_cached", "unreferenced KV blocks holding a cached prefix (evictable)")
        self.hit_rate = gauge("prefix_cache_hit_rate", "prompt tokens found in the prefix cache / prompt tokens")
        self.queries = counter("prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.hits = counter("prefix_cache_hits", "prompt tokens found in the prefix cache")
        self.preemptions = counter("num_preemptions", "requests preempted (blocks released, recomputed later)")
        self.steps = counter("engine_steps", "engine steps (one forward pass each)")
        self.step_seconds = counter("engine_step_seconds", "seconds spent in engine steps")
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "tokens generated")

        def histogram(name, doc, buckets):
            return Histogram(f"lowbit_{name}", doc, list(labels), buckets=buckets, registry=self.registry).labels(
                **labels
            )

        self.ttft = histogram(
            "time_to_first_token_seconds", "from the HTTP request's arrival to its first token", _TTFT_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "between consecutive tokens of a request", _ITL_BUCKETS)
        self._finished = Counter(
            "lowbit_request_success",
            "finished requests by reason",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self._labels = labels
        self._seen = {"preemptions": 0, "prompt_tokens": 0, "cached_tokens": 0}  # the engine's stats, last read

    def observe_tokens(self, request: Request, already: int) -> None:
        """`request`'s tokens from index `already` on are new: their time to first token / inter-token times."""
        times = request.token_times
        if already == 0 and times:
            self.ttft.observe(times[0] - request.arrival)
        for i in range(max(already, 1), len(times)):
            self.itl.observe(times[i] - times[i - 1])
        self.generation_tokens.inc(len(times) - already)

    def observe_finished(self, request: Request) -> None:
        self._finished.labels(**self._labels, finished_reason=request.finish_reason).inc()
        self.prompt_tokens.inc(len(request.prompt))

    def observe_engine(self, engine: Engine, *, queued: int, step_seconds: float) -> None:
        """The engine's state after a step that took `step_seconds` (0: no step ran); `queued`: requests submitted
        and not yet running."""
        if step_seconds:
            self.steps.inc()
            self.step_seconds.inc(step_seconds)
        blocks = engine.blocks
        self.running.set(len(engine.running))
        self.waiting.set(queued)
        self.blocks_free.set(blocks.num_available)
        self.blocks_used.set(blocks.num_blocks - blocks.num_available)
        self.blocks_cached.set(blocks.num_cached)
        stats = engine.stats
        self.preemptions.inc(stats["preemptions"] - self._seen["preemptions"])
        self.queries.inc(stats["prompt_tokens"] - self._seen["prompt_tokens"])
        self.hits.inc(stats["cached_tokens"] - self._seen["cached_tokens"])
        self._seen = {k: stats[k] for k in self._seen}
        if stats["prompt_tokens"]:
            self.hit_rate.set(stats["cached_tokens"] / stats["prompt_tokens"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
