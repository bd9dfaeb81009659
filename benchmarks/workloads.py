"""Serving workloads for serve_bench.py: who sends what, and when.

Five workloads, after the ones the project's seed describes: a sequential baseline,
staggered arrivals (continuous batching), a burst (paged attention), long prompts arriving
while others decode (chunked prefill), and a long shared prefix (prefix caching). Every
prompt is random common English words drawn from a seeded generator
(`infer.bench.prompts`), so a run is repeatable; a word is about one token in the BPE
vocabularies of the models served here (the client reports the exact prompt tokens from
the server's usage counts).

`scale` multiplies request counts, arrival rates and prompt/output lengths together, so a
CPU can run a small copy of the same shape.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from infer.bench.prompts import random_words


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    max_tokens: int
    at: float  # seconds after the workload starts (ignored when sequential)


@dataclass(frozen=True)
class Workload:
    name: str
    measures: str
    sequential: bool
    requests: list[RequestSpec]

    @property
    def pattern(self) -> str:
        if self.sequential:
            return "sequential"
        if all(r.at == 0 for r in self.requests):
            return "burst"
        return f"{rate_of(self):.2f} req/s"


def rate_of(workload: Workload) -> float:
    last = max(r.at for r in workload.requests)
    return (len(workload.requests) - 1) / last if last > 0 else 0.0


def _count(n: float, scale: float) -> int:
    return max(2, round(n * scale))


def _len(n: float, scale: float) -> int:
    return max(4, round(n * scale))


def _staggered(prompts: list[str], max_tokens: int, rate: float) -> list[RequestSpec]:
    return [RequestSpec(p, max_tokens, i / rate) for i, p in enumerate(prompts)]


def build(name: str, scale: float = 1.0, seed: int = 0) -> Workload:
    rng = random.Random(f"{name}:{seed}")
    s = scale
    if name == "baseline":
        prompts = [random_words(rng, _len(256, s)) for _ in range(_count(10, s))]
        return Workload(name, "single-request overhead floor", True,
                        [RequestSpec(p, _len(128, s), 0.0) for p in prompts])
    if name == "continuous_batching":
        prompts = [random_words(rng, rng.randint(_len(128, s), _len(384, s)))
                   for _ in range(_count(32, s))]
        return Workload(name, "TTFT with staggered arrivals", False,
                        _staggered(prompts, _len(128, s), 4 * s))
    if name == "paged_attention":
        prompts = [random_words(rng, rng.randint(_len(64, s), _len(512, s)))
                   for _ in range(_count(48, s))]
        return Workload(name, "throughput at high concurrency", False,
                        [RequestSpec(p, _len(128, s), 0.0) for p in prompts])
    if name == "chunked_prefill":
        n = _count(48, s)
        long_ids = set(rng.sample(range(n), round(0.75 * n)))
        prompts = [random_words(rng, _len(1536, s) if i in long_ids else _len(64, s))
                   for i in range(n)]
        return Workload(name, "ITL under long-prompt prefill pressure", False,
                        _staggered(prompts, _len(128, s), 6 * s))
    if name == "prefix_caching":
        prefix = random_words(rng, _len(1024, s))
        prompts = [f"{prefix} {random_words(rng, _len(32, s))}" for _ in range(_count(48, s))]
        return Workload(name, "TTFT with a shared ~1024-token prefix", False,
                        _staggered(prompts, _len(64, s), 8 * s))
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(NAMES)}")


NAMES = ("baseline", "continuous_batching", "paged_attention", "chunked_prefill",
         "prefix_caching")
