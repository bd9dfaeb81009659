"""Scheduler: budgets, chunking, static vs continuous admission, preemption, no leaks."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from infer.cache.kv_manager import KVCacheManager
from infer.engine.request import Request
from infer.engine.scheduler import Scheduler


def make(num_blocks=16, block_size=4, seqs=4, budget=16, **kw) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size, kw.pop("prefix", False)),
                     max_num_seqs=seqs, max_num_batched_tokens=budget, **kw)


def req(rid: str, prompt_len: int, max_new: int = 4, **kw) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), max_new, **kw)


def step(s: Scheduler) -> dict[str, int]:
    """Run one step with a fake model that always samples token 0 (the scheduler ends a
    request at max_new)."""
    out = s.schedule()
    plan = {i.request_id: i.num_new_tokens for i in out.scheduled}
    s.update(out, {i.request_id: [0] for i in out.scheduled if i.samples})
    return plan


def test_prefill_then_decode():
    s = make()
    s.add(req("a", 6, max_new=3))
    assert step(s) == {"a": 6}
    assert s.kv.table("a") == [0, 1]
    assert step(s) == {"a": 1}
    assert step(s) == {"a": 1}
    assert not s.has_unfinished() and s.kv.pool.num_free == 16


def test_chunked_prefill_keeps_decodes_flowing():
    s = make(budget=8, max_prefill_chunk=8)
    s.add(req("a", 3, max_new=10))
    assert step(s) == {"a": 3}
    s.add(req("long", 20))
    # The decode is served first, the long prompt gets the rest of the budget.
    assert step(s) == {"a": 1, "long": 7}
    assert step(s) == {"a": 1, "long": 7}
    assert step(s) == {"a": 1, "long": 6}
    assert step(s) == {"a": 1, "long": 1}


def test_without_chunking_a_prompt_waits_for_a_whole_step():
    s = make(budget=8, chunked_prefill=False)
    s.add(req("a", 3, max_new=10))
    s.add(req("b", 8))
    assert step(s) == {"a": 3}  # b (8 tokens) does not fit the 5 left
    assert step(s) == {"a": 1}  # still 7 left: b waits, FCFS
    s2 = make(budget=8, chunked_prefill=False)
    s2.add(req("b", 8))
    assert step(s2) == {"b": 8}


def test_static_batching_admits_only_when_idle():
    s = make(batching="static")
    s.add(req("a", 2, max_new=2))
    assert step(s) == {"a": 2}
    s.add(req("b", 2, max_new=1))
    assert step(s) == {"a": 1}  # b waits for the batch to drain
    assert step(s) == {"b": 2}


def test_continuous_batching_admits_every_step():
    s = make()
    s.add(req("a", 2, max_new=3))
    step(s)
    s.add(req("b", 2, max_new=1))
    assert step(s) == {"a": 1, "b": 2}


def test_max_num_seqs_caps_the_batch():
    s = make(seqs=2)
    for rid in "abc":
        s.add(req(rid, 2))
    assert set(step(s)) == {"a", "b"}


def test_preemption_of_newest_and_recompute():
    s = make(num_blocks=4, block_size=2, budget=16)
    s.add(req("old", 3, max_new=4))
    s.add(req("new", 3, max_new=4))
    assert step(s) == {"old": 3, "new": 3}  # 2 blocks each: pool full
    assert step(s) == {"old": 1, "new": 1}  # the 4th token still fits 2 blocks
    # old needs a 3rd block for its 5th token: new is preempted, its blocks freed.
    assert step(s) == {"old": 1}
    new = s.requests["new"]
    assert new.num_preemptions == 1 and new.num_computed_tokens == 0
    assert s.waiting[0] is new and new.output_token_ids == [0, 0]
    while "old" in s.requests:
        step(s)
    # new is recomputed over prompt + its generated token, then continues.
    assert step(s) == {"new": 5}
    while s.has_unfinished():
        step(s)
    assert s.kv.pool.num_free == 4


def test_prefix_cache_hit_skips_cached_tokens():
    s = make(prefix=True, block_size=4)
    s.add(req("a", 10, max_new=1))
    step(s)
    s.add(req("b", 10, max_new=1))
    assert step(s) == {"b": 2}  # two full blocks (8 tokens) reused
    assert s.kv.prefix_hits == 8


def test_n_siblings_share_prompt_blocks():
    s = make(block_size=4)
    s.add(req("a", 10, max_new=3))
    s.add(req("a#1", 10, max_new=3, share_prefix_with="a"))
    assert step(s) == {"a": 10}  # the sibling waits for a's prompt
    assert step(s) == {"a": 1, "a#1": 2}
    assert s.kv.table("a#1")[:2] == s.kv.table("a")[:2]


def test_abort_frees_everything_at_once():
    s = make()
    s.add(req("a", 9))
    s.add(req("b", 5))
    step(s)
    s.abort("a")
    s.abort("b")
    s.abort("never-existed")
    assert s.kv.pool.num_free == 16 and not s.has_unfinished()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    ops=st.lists(st.sampled_from(["add", "step", "step", "step", "abort"]), max_size=60),
    prefix=st.booleans(),
    chunked=st.booleans(),
    static=st.booleans(),
)
def test_random_interleavings_never_leak(seed, ops, prefix, chunked, static):
    rng = random.Random(seed)
    s = Scheduler(
        KVCacheManager(num_blocks=12, block_size=2, enable_prefix_caching=prefix),
        max_num_seqs=3, max_num_batched_tokens=10,
        batching="static" if static else "continuous", chunked_prefill=chunked,
        max_prefill_chunk=rng.choice([None, 3]),
    )
    next_id = 0
    for op in [*ops, *["step"] * 200]:
        if op == "add":
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
            s.add(Request(f"r{next_id}", prompt, rng.randrange(1, 6)))
            next_id += 1
        elif op == "abort" and s.requests:
            s.abort(rng.choice(sorted(s.requests)))
        elif op == "step":
            step(s)
        _check_invariants(s)
        if op == "step" and not s.has_unfinished():
            break
    assert not s.has_unfinished()
    assert s.kv.pool.num_free == 12
    assert s.kv.tables == {}


def _check_invariants(s: Scheduler) -> None:
    pool = s.kv.pool
    refs = [0] * pool.num_blocks
    for table in s.kv.tables.values():
        for block_id in table:
            refs[block_id] += 1
    assert refs == [b.ref_count for b in pool.blocks]
    assert set(pool.free) == {i for i, r in enumerate(refs) if r == 0}
    for r in s.running:
        assert len(s.kv.table(r.request_id)) * s.kv.block_size >= r.num_computed_tokens


@given(st.integers(1, 6), st.integers(0, 6), st.data())
def test_token_slice_equals_slicing_all_tokens(n_prompt, n_out, data):
    r = Request("r", list(range(100, 100 + n_prompt)), 8)
    r.output_token_ids = list(range(200, 200 + n_out))
    total = n_prompt + n_out
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    assert r.token_slice(start, stop) == r.all_token_ids[start:stop]


# -- multi-token steps (speculative decoding's verification) ---------------------------
def _decode_with_drafts(s: Scheduler, rid: str, drafts: list[int], accepted: list[int]):
    """One step of `rid` with `drafts` proposed; the model keeps `accepted`."""
    s.requests[rid].spec_token_ids = list(drafts)
    out = s.schedule()
    [item] = [i for i in out.scheduled if i.request_id == rid]
    s.requests[rid].spec_token_ids = []
    return item, s.update(out, {rid: accepted})


def test_rejected_drafts_give_their_blocks_back():
    s = make(num_blocks=8, block_size=4, budget=16)
    s.add(req("a", 6, max_new=20))
    step(s)  # prompt (6) -> blocks [0, 1]; one token out
    assert s.kv.table("a") == [0, 1] and s.requests["a"].num_tokens == 7
    item, [update] = _decode_with_drafts(s, "a", [5, 6, 7, 8], accepted=[5, 9])
    # positions 6..10 ran: the last token plus four drafts, in blocks 1 and 2
    assert (item.start, item.num_new_tokens, item.samples) == (6, 5, True)
    assert item.token_ids == (0, 5, 6, 7, 8) and item.spec_token_ids == (5, 6, 7, 8)
    # draft 5 accepted, 6 rejected (9 sampled instead): positions 6, 7 hold valid KV
    assert update.new_token_ids == [5, 9] and update.finish_reason is None
    a = s.requests["a"]
    assert a.output_token_ids == [0, 5, 9] and a.num_computed_tokens == 8
    assert s.kv.table("a") == [0, 1]  # block 2 held only rejected drafts
    assert s.kv.pool.num_free == 6 and 2 in s.kv.pool.free
    item, [update] = _decode_with_drafts(s, "a", [1, 2], accepted=[1, 2, 3])  # all taken
    assert update.new_token_ids == [1, 2, 3] and a.num_computed_tokens == 11
    assert s.kv.table("a") == [0, 1, 3]  # the freed block 2 went to the free list's tail


def test_prefix_cache_holds_only_accepted_tokens():
    s = make(num_blocks=8, block_size=4, budget=16, prefix=True)
    s.add(req("a", 3, max_new=20))  # prompt 1 2 3
    step(s)  # + token 0: four tokens, three computed
    _decode_with_drafts(s, "a", [7, 7, 7, 7, 7], accepted=[7, 8])
    # computed: 1 2 3 0 | 7 (8 is the new last token): only the first block is full
    assert s.requests["a"].num_computed_tokens == 5
    assert len(s.kv.pool.cached) == 1
    [(key, block_id)] = s.kv.pool.cached.items()
    assert key[1] == (1, 2, 3, 0) and block_id == s.kv.table("a")[0]
    s.abort("a")
    s.add(req("b", 3, max_new=2))
    s.requests["b"].prompt_token_ids = [1, 2, 3, 0, 7, 7, 7, 7, 5]  # the rejected drafts
    step(s)
    assert s.kv.prefix_hits == 4  # the accepted block only; 7 7 7 7 was never cached


def test_a_stop_token_among_accepted_tokens_ends_the_request_there():
    s = make()
    s.add(Request("a", [1, 2], 10, stop_token_ids=frozenset({42}), min_tokens=3))
    step(s)  # one token out; the first 42 makes two, below min_tokens: no stop yet
    _, [update] = _decode_with_drafts(s, "a", [42, 42, 5], accepted=[42, 42, 5, 6])
    assert update.new_token_ids == [42, 42] and update.finish_reason == "stop"
    assert update.stop_reason == 42 and "a" not in s.requests
    assert s.kv.pool.num_free == 16


def test_drafts_are_cut_to_the_budget():
    s = make(budget=3)
    s.add(req("a", 2, max_new=10))
    step(s)
    item, _ = _decode_with_drafts(s, "a", [4, 4, 4, 4], accepted=[4, 4, 1])
    assert item.num_new_tokens == 3 and item.spec_token_ids == (4, 4)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), prefix=st.booleans(),
       ops=st.lists(st.sampled_from(["add", "step", "step", "abort"]), max_size=50))
def test_random_multi_token_steps_never_leak(seed, prefix, ops):
    """Random drafts, random acceptance (0..all of them rejected), aborts, preemption."""
    rng = random.Random(seed)
    s = Scheduler(KVCacheManager(num_blocks=14, block_size=2, enable_prefix_caching=prefix),
                  max_num_seqs=3, max_num_batched_tokens=8)
    next_id = 0
    for op in [*ops, *["step"] * 300]:
        if op == "add":
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 7))]
            s.add(Request(f"r{next_id}", prompt, rng.randrange(1, 12)))
            next_id += 1
        elif op == "abort" and s.requests:
            s.abort(rng.choice(sorted(s.requests)))
        elif op == "step":
            for r in s.running:
                r.spec_token_ids = [rng.randrange(3) for _ in range(rng.randrange(4))]
            out = s.schedule()
            for r in s.requests.values():
                r.spec_token_ids = []
            accepted = {i.request_id: [rng.randrange(3) for _ in range(
                rng.randrange(1, len(i.spec_token_ids) + 2))]
                for i in out.scheduled if i.samples}
            s.update(out, accepted)
        _check_invariants(s)
        for r in s.running:  # no block beyond what the computed tokens and the next need
            assert len(s.kv.table(r.request_id)) <= s.kv.blocks_needed(r.num_tokens + 8)
        if op == "step" and not s.has_unfinished():
            break
    assert not s.has_unfinished()
    assert s.kv.pool.num_free == 14 and s.kv.tables == {}


def _sampled(request: Request) -> int:
    """A fake model's next token: a function of the request and its length alone."""
    return (request.num_tokens * 7 + int(request.request_id[1:])) % 3


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), prefix=st.booleans(), chunked=st.booleans(),
       static=st.booleans(),
       ops=st.lists(st.sampled_from(["add", "step", "step", "abort"]), max_size=50))
def test_steps_planned_ahead_start_where_the_step_before_ends(seed, prefix, chunked, static,
                                                              ops):
    """Async scheduling's loop: the next step is planned (`schedule_ahead`) before the
    current one is accounted. Every planned item must start at the request's computed
    tokens when it is accounted and carry exactly the request's tokens there (or, planned
    ahead, decode the one token the step before sampled); nothing leaks."""
    rng = random.Random(seed)
    s = Scheduler(KVCacheManager(num_blocks=14, block_size=2, enable_prefix_caching=prefix),
                  max_num_seqs=3, max_num_batched_tokens=8,
                  batching="static" if static else "continuous", chunked_prefill=chunked,
                  max_prefill_chunk=rng.choice([None, 3]))
    next_id, in_flight = 0, None
    for op in [*ops, *["step"] * 300]:
        if op == "add":
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
            s.add(Request(f"r{next_id}", prompt, rng.randrange(1, 6)))
            next_id += 1
        elif op == "abort" and s.requests:
            s.abort(rng.choice(sorted(s.requests)))
        elif op == "step":
            out = in_flight or s.schedule()
            in_flight = s.schedule_ahead(out) if not out.empty else None
            sampled = {}
            for item in out.scheduled:
                request = s.requests.get(item.request_id)
                if request is None:
                    continue  # aborted while the step was in flight
                assert item.start == request.num_computed_tokens
                if item.token_ids is None:
                    assert item.num_new_tokens == 1
                    assert item.start == request.num_tokens - 1
                else:
                    assert list(item.token_ids) == request.token_slice(
                        item.start, item.start + item.num_new_tokens)
                if item.samples:
                    sampled[item.request_id] = [_sampled(request)]
            s.update(out, sampled)
        _check_invariants(s)
        if op == "step" and not s.has_unfinished() and in_flight is None:
            break
    assert not s.has_unfinished()
    assert s.kv.pool.num_free == 14 and s.kv.tables == {}


def test_a_request_updated_at_its_end_only_gets_no_update_before_it():
    """Tokens that do not end it are appended without an update; the one that ends it (a
    stop token here, the length limit for the other) comes with its update."""
    s = make()
    a = Request("a", [1, 2], 10, stop_token_ids=frozenset({42}), updates_at_end_only=True)
    b = req("b", 2, max_new=3, updates_at_end_only=True)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert s.update(out, {"a": [7], "b": [7]}) == []
    out = s.schedule()
    assert s.update(out, {"a": [8], "b": [8]}) == []
    out = s.schedule()
    updates = {u.request_id: u for u in s.update(out, {"a": [42], "b": [9]})}
    assert updates["a"].new_token_ids == [42] and updates["a"].finish_reason == "stop"
    assert updates["b"].new_token_ids == [9] and updates["b"].finish_reason == "length"
    assert s.requests == {} and s.kv.pool.num_free == 16
    assert a.output_token_ids == [7, 8, 42] and b.output_token_ids == [7, 8, 9]
