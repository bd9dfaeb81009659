"""Prometheus metrics: engine counters read from AsyncEngine.stats at scrape time, and
latency histograms the engine thread observes. One registry per app (tests build many)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "infer:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_GAUGES = {
    "num_requests_running": "Requests (sequences) in the running batch",
    "num_requests_waiting": "Requests (sequences) waiting to be scheduled",
    "kv_cache_usage": "Fraction of KV cache blocks in use (0..1)",
    "kv_blocks_used": "KV cache blocks in use",
    "kv_blocks_total": "KV cache blocks in the pool",
}
_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache",
    "num_preemptions": "Sequences preempted for lack of KV blocks",
    "prompt_tokens": "Prompt tokens received",
    "generation_tokens": "Tokens generated",
    "request_rejected": "Requests refused because the waiting queue was full",
    "engine_step_errors": "Engine steps that raised",
    "num_requests_failed": "Requests failed alone by a fault of their own (the rest of "
                           "their step went on)",
    "num_steps": "Engine steps run (model forwards)",
    "num_steps_launched_ahead": "Decode steps launched before the previous step's tokens "
                                "were read (async scheduling)",
    "num_discarded_tokens": "Tokens sampled for a sequence that had already stopped "
                            "(async scheduling)",
}
_COUNTER_SOURCES = {
    "prompt_tokens": "prompt_tokens_total", "generation_tokens": "generation_tokens_total",
    "request_rejected": "requests_rejected", "engine_step_errors": "step_errors",
}


class _StatsCollector:
    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, doc in _GAUGES.items():
            gauge = GaugeMetricFamily(PREFIX + name, doc)
            gauge.add_metric([], float(stats.get(name, 0)))
            yield gauge
        for name, doc in _COUNTERS.items():
            counter = CounterMetricFamily(PREFIX + name, doc)
            counter.add_metric([], float(stats.get(_COUNTER_SOURCES.get(name, name), 0)))
            yield counter


class ServerMetrics:
    """Also the AsyncEngine's LatencyObserver."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between tokens",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Arrival to last token", buckets=_LATENCY_BUCKETS,
                             registry=self.registry)
        self.registry.register(_StatsCollector(stats))

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
