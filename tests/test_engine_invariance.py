"""Batch invariance on the real SmolLM2 model: a greedy request yields the same tokens
alone, in a mixed batch, chunked, from the prefix cache, paged or contiguous, static or
continuous, and when preempted."""

from __future__ import annotations

import random

import pytest
from engine_fixtures import make_llm

from infer import SamplingParams

pytestmark = pytest.mark.slow  # `pytest -m 'not slow'`: the quick inner loop skips it

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    llm = make_llm(num_blocks=64)
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def _batch(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


VARIANTS = {
    "continuous-paged": dict(num_blocks=64),
    "synchronous": dict(num_blocks=64, async_scheduling=False),
    "chunked-small": dict(num_blocks=64, prefill_chunk_size=3, max_num_batched_tokens=8),
    "no-chunking": dict(num_blocks=64, chunked_prefill=False, max_num_batched_tokens=256,
                        max_model_len=256),
    "contiguous": dict(kv_cache="contiguous", prefix_caching=False, max_model_len=128,
                       max_num_seqs=4),
    "static": dict(num_blocks=64, batching_mode="static", max_num_seqs=2),
    "block-size-1": dict(num_blocks=512, block_size=1),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_equals_alone(alone, variant):
    llm = make_llm(**VARIANTS[variant])
    assert _batch(llm) == alone
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_mixed_with_sampled_requests(alone):
    llm = make_llm(num_blocks=96)
    rng = random.Random(0)
    prompts, params = [], []
    for p in PROMPTS:
        prompts += [p, "Tell me a story about " + rng.choice(["cats", "dogs", "ships"])]
        params += [GREEDY, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=rng.randint(
            1, 20), seed=rng.randrange(100))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[::2]] == alone


def test_prefix_cache_hit_gives_same_tokens(alone):
    llm = make_llm(num_blocks=64, block_size=4)
    first = _batch(llm)
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert first == alone
    assert [o.outputs[0].token_ids for o in again] == alone
    assert all(o.num_cached_tokens > 0 for o in again)
    assert llm.engine.stats()["prefix_cache_hits"] > 0


def test_preemption_under_a_tiny_pool(alone):
    # Each request alone needs at most ~7 blocks of 4; 12 blocks cannot hold all four.
    llm = make_llm(num_blocks=12, block_size=4, prefix_caching=False)
    assert _batch(llm) == alone
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0
