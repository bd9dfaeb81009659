"""The server's latency histograms render as prometheus_client's own Histogram does."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from infer.server.metrics import LatencyHistogram

BUCKETS = (0.005, 0.01, 0.1, 1.0, 10.0)


def test_latency_histogram_matches_prometheus_client():
    rng = random.Random(0)
    observations = [(b, 1) for b in BUCKETS] + [(0.0, 2), (50.0, 3)] + [
        (rng.uniform(0, 12), rng.randint(1, 5)) for _ in range(200)]
    ours = LatencyHistogram("itl_seconds", "Time between tokens", BUCKETS)
    reference = CollectorRegistry()
    theirs = Histogram("itl_seconds", "Time between tokens", buckets=BUCKETS,
                       registry=reference)
    for seconds, count in observations:
        ours.observe(seconds, count)
        for _ in range(count):  # the reference takes one observation per call
            theirs.observe(seconds)
    registry = CollectorRegistry()
    registry.register(ours)

    def samples(text: bytes) -> dict[str, float]:
        lines = [line.rsplit(" ", 1) for line in text.decode().splitlines()
                 if line.startswith("itl_seconds_") and "_created" not in line]
        return {name: float(value) for name, value in lines}

    got, want = samples(generate_latest(registry)), samples(generate_latest(reference))
    assert got.keys() == want.keys() and len(got) == len(BUCKETS) + 3
    for name in want:
        assert abs(got[name] - want[name]) <= 1e-9 * max(1.0, abs(want[name])), name


def test_per_position_speculation_counters_carry_a_position_label():
    from infer.server.metrics import ServerMetrics

    stats = {"spec_draft_tokens": 7, "spec_draft_tokens_at_0": 4, "spec_draft_tokens_at_1": 3,
             "spec_accepted_tokens_at_0": 2, "spec_accepted_tokens_at_1": 1}
    text = ServerMetrics(lambda: stats).render().decode()
    assert 'infer:spec_draft_tokens_per_position_total{position="0"} 4.0' in text
    assert 'infer:spec_draft_tokens_per_position_total{position="1"} 3.0' in text
    assert 'infer:spec_accepted_tokens_per_position_total{position="1"} 1.0' in text
    assert "infer:spec_draft_tokens_total 7.0" in text
