"""Prometheus metrics: engine counters read from AsyncEngine.stats at scrape time, and
latency histograms the receiving thread observes. One registry per app (tests build many)."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

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
    "num_steps_launched_ahead": "Steps launched before the previous step's tokens "
                                "were read (async scheduling)",
    "num_discarded_tokens": "Tokens sampled for a sequence that had already stopped "
                            "(async scheduling)",
    "spec_draft_tokens": "Draft tokens judged (speculative decoding)",
    "spec_accepted_tokens": "Draft tokens accepted (speculative decoding)",
    "spec_verified_rows": "Sequence-steps whose drafts were judged: tokens per such "
                          "step = 1 + spec_accepted_tokens / this",
}
# Counters kept per draft position i as `<name>_at_<i>` in the stats: a `position` label.
_PER_POSITION = {
    "spec_draft_tokens": "Draft tokens judged at each draft position (0: the first)",
    "spec_accepted_tokens": "Draft tokens accepted at each draft position (0: the first)",
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
        for name, doc in _PER_POSITION.items():
            counter = CounterMetricFamily(PREFIX + name + "_per_position", doc,
                                          labels=["position"])
            prefix = name + "_at_"
            for key, value in stats.items():
                if key.startswith(prefix):
                    counter.add_metric([key[len(prefix):]], float(value))
            yield counter


class LatencyHistogram:
    """A Prometheus histogram that takes `count` equal observations in one call (a delta
    of k tokens is k inter-token latencies): one bisect and three adds under a lock, where
    prometheus_client's Histogram costs a lock and a bucket walk per observation, for
    every token of every stream."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...],
                 others: Callable[[], list[tuple[list[int], float]]] = list) -> None:
        # others: the same histogram's (counts, sum) in the server's other API processes
        self.name, self.doc, self.bounds, self.others = name, doc, buckets, others
        self._counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float, count: int = 1) -> None:
        i = bisect.bisect_left(self.bounds, seconds)  # buckets are `le`: bound included
        with self._lock:
            self._counts[i] += count
            self._sum += seconds * count

    def snapshot(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self._counts), self._sum

    def collect(self) -> Iterator[Metric]:
        counts, total = self.snapshot()
        for other_counts, other_sum in self.others():
            counts = [a + b for a, b in zip(counts, other_counts)]
            total += other_sum
        cumulative, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts):
            running += count
            cumulative.append((bound, running))
        yield HistogramMetricFamily(self.name, self.doc, buckets=cumulative, sum_value=total)


class ServerMetrics:
    """Also the AsyncEngine's LatencyObserver."""

    def __init__(self, stats: Callable[[], dict[str, float]],
                 others: Callable[[], list[dict[str, tuple[list[int], float]]]] = list
                 ) -> None:
        """`stats`: the counters (summed over the server's API processes); `others`: the
        other API processes' histogram snapshots."""
        self.registry = CollectorRegistry()

        def histogram(key: str, name: str, doc: str) -> LatencyHistogram:
            return LatencyHistogram(PREFIX + name, doc, _LATENCY_BUCKETS,
                                    lambda: [o[key] for o in others() if key in o])

        self.ttft = histogram("ttft", "time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("itl", "inter_token_latency_seconds", "Time between tokens")
        self.e2e = histogram("e2e", "e2e_request_latency_seconds", "Arrival to last token")
        for collector in (self.ttft, self.itl, self.e2e, _StatsCollector(stats)):
            self.registry.register(collector)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float, count: int = 1) -> None:
        self.itl.observe(seconds, count)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(seconds)

    def snapshot(self) -> dict[str, tuple[list[int], float]]:
        return {"ttft": self.ttft.snapshot(), "itl": self.itl.snapshot(),
                "e2e": self.e2e.snapshot()}

    def render(self) -> bytes:
        return generate_latest(self.registry)
