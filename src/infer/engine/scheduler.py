"""One scheduling rule for everything.

Each request has `num_tokens` (prompt + generated) and `num_computed_tokens` (already in
the KV cache). Every step hands out a budget of `max_num_batched_tokens` token slots:
running requests first (decodes, then unfinished prefills), then waiting requests in
arrival order. A request that gets `num_tokens - num_computed_tokens` slots this step
produces logits for its last token and so samples a new one; one that gets fewer (a
prefill chunk) does not. Prefill, decode, chunked prefill, prefix-cache hits, n > 1
sharing and recompute-after-preemption are all this rule.

Policies on top of the rule:
- static batching admits waiting requests only when nothing is running;
- without chunked prefill a request's remaining tokens must fit the budget in one step;
- when a running request cannot grow, the newest unscheduled running request is preempted
  (its blocks freed, its tokens recomputed later from the front of the waiting queue), so
  the oldest requests always make progress and none starves;
- waiting requests are admitted strictly first-come first-served.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from infer.cache.kv_manager import KVCacheManager
from infer.engine.request import Request, RequestStatus

# Builds a named tuple from all its fields at half the cost of its constructor (the
# scheduler builds one per row per step): `_tuple(ScheduledRequest, (every field))`.
_tuple = tuple.__new__


class ScheduledRequest(NamedTuple):
    """One request's share of a step, as it stood when the step was planned (a tuple:
    immutable, and built per request per step, cheaper than a frozen dataclass)."""

    request_id: str
    start: int  # tokens of the request already in the KV cache
    num_new_tokens: int  # positions start .. start + num_new_tokens - 1 run this step
    # Whether the step ends at the request's last known token (then it samples): its
    # logits give the next token, and with draft tokens the verdict on each of them.
    samples: bool
    # The step's input tokens; None when they are still on the device (a step launched
    # before the previous one's tokens were read back).
    token_ids: tuple[int, ...] | None
    spec_token_ids: tuple[int, ...] = ()  # the last len(...) of token_ids are drafts


@dataclass(frozen=True)
class SchedulerOutput:
    """An immutable snapshot of one step's plan."""

    scheduled: tuple[ScheduledRequest, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.scheduled


class RequestUpdate(NamedTuple):
    """What a step did to one request, on the way out: the tokens it kept, and whether a
    token ended it (a stop token, EOS, or the length limit)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        batching: str = "continuous",
        chunked_prefill: bool = True,
        max_prefill_chunk: int | None = None,
    ) -> None:
        if batching not in ("static", "continuous"):
            raise ValueError(f"batching must be 'static' or 'continuous', got {batching!r}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.static = batching == "static"
        self.chunked_prefill = chunked_prefill
        self.max_prefill_chunk = max_prefill_chunk or max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- bookkeeping -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None):
        """End a request now (stop, length or abort) and free all its blocks."""
        if request.finished:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        del self.requests[request.request_id]

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, "abort")
        return request

    # -- the step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out: list[ScheduledRequest] = []
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        was_running = bool(self.running)
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                continue
            if not self._grow_or_preempt(request, num_new, scheduled):
                continue
            out.append(_plan(request, num_new))
            scheduled.add(request.request_id)
            budget -= num_new
        if not (self.static and was_running):
            self._admit(budget, out)
        return SchedulerOutput(tuple(out))

    def _num_new_tokens(self, request: Request, budget: int, start: int | None = None) -> int:
        """Tokens to compute from `start` (default: what the KV cache holds); drafts count
        as tokens to compute, and only a request at its last token has any."""
        remaining = request.num_tokens - (request.num_computed_tokens if start is None
                                          else start)
        if remaining == 1 and request.spec_token_ids:
            return min(1 + len(request.spec_token_ids), budget)
        if self.chunked_prefill:
            return min(remaining, budget, self.max_prefill_chunk)
        return remaining if remaining <= budget else 0

    def _grow_or_preempt(self, request: Request, num_new: int, scheduled: set[str]) -> bool:
        total = request.num_computed_tokens + num_new
        while not self.kv.allocate(request.request_id, total):
            victims = [r for r in self.running if r.request_id not in scheduled]
            victim = victims[-1]  # the newest; `request` itself is always a candidate
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self, budget: int, out: list[ScheduledRequest]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self._waits_for_sibling(request):
                break
            rid = request.request_id
            if rid not in self.kv.tables:
                request.num_computed_tokens = self._match_prefix(request)
                request.num_cached_tokens = request.num_computed_tokens
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0 or not self.kv.allocate(rid, request.num_computed_tokens + num_new):
                self.kv.free(rid)
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.append(_plan(request, num_new))
            budget -= num_new

    def _waits_for_sibling(self, request: Request) -> bool:
        """An n > 1 sibling waits until the first sibling has computed its prompt."""
        source = self.requests.get(request.share_prefix_with or "")
        return (
            source is not None
            and source.status is RequestStatus.RUNNING
            and source.num_computed_tokens < len(source.prompt_token_ids)
        )

    def _match_prefix(self, request: Request) -> int:
        if request.skip_prefix_cache:
            return 0
        tokens = request.all_token_ids
        computed = self.kv.match_prefix(request.request_id, tokens)
        source = self.requests.get(request.share_prefix_with or "")
        if computed == 0 and source is not None and source.status is RequestStatus.RUNNING:
            self.kv.free(request.request_id)
            usable = min(len(request.prompt_token_ids) - 1, source.num_computed_tokens)
            computed = self.kv.share_prefix(request.request_id, source.request_id, usable)
        return computed

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Plan the step after `prev` before prev's tokens are known (async scheduling),
        by the rule of `schedule` applied to the state prev will leave: each request prev
        samples decodes one more token (its id still on the device: `token_ids` None, and
        these rows come first), prefills go on from where prev's chunk ends, and waiting
        requests are admitted. Requests prev ends by length are left out; one that prev
        ends by a stop token computes a row in vain (dropped on the way out). Allocates the
        blocks; None when the plan is not certain (drafts; static batching with requests
        waiting) or would need a preemption."""
        if self.static and self.waiting:
            return None  # admission depends on whether prev ends every running request
        budget = self.max_num_batched_tokens
        out: list[ScheduledRequest] = []
        prev_end: dict[str, int] = {}  # where prev leaves its rows that do not sample
        sampling = 0  # running requests that prev samples
        requests, allocate, running = self.requests, self.kv.allocate, RequestStatus.RUNNING
        tables, block_size = self.kv.tables, self.kv.block_size
        for rid, start, num_new, samples, _, spec in prev.scheduled:
            request = requests.get(rid)
            if request is None or request.status is not running:
                continue  # finished or aborted while prev ran (its id may be reused)
            if spec:
                return None
            pos = start + num_new
            if not samples:
                prev_end[rid] = pos
                continue
            sampling += 1
            if len(request.output_token_ids) + 1 >= request.max_new_tokens:
                continue
            if budget == 0:
                return None
            if len(tables[rid]) * block_size <= pos and not allocate(rid, pos + 1):
                return None  # (the next slot not in the last block: a block more)
            out.append(_tuple(ScheduledRequest, (rid, pos, 1, True, None, ())))
            budget -= 1
        if sampling < len(self.running):  # some running request is not one of those
            sampled = {item.request_id for item in prev.scheduled if item.samples}
            rest = [(r, prev_end.get(r.request_id, r.num_computed_tokens))
                    for r in self.running if r.request_id not in sampled]
            rest.sort(key=lambda rc: rc[0].num_tokens - rc[1] > 1)  # decodes, then prefills
            for request, start in rest:
                num_new = self._num_new_tokens(request, budget, start)
                if num_new == 0:
                    continue
                if not self.kv.allocate(request.request_id, start + num_new):
                    return None
                out.append(_plan(request, num_new, start))
                budget -= num_new
        self._admit(budget, out)
        return SchedulerOutput(tuple(out)) if out else None

    def update(self, out: SchedulerOutput, sampled: Mapping[str, Sequence[int]]
               ) -> list[RequestUpdate]:
        """Account for a finished step. `sampled[request_id]`: the tokens a sampling
        request accepted, 1 .. 1 + its drafts (the verdict on each draft, then one more);
        drafts not accepted were computed in vain, and the KV blocks past the accepted
        tokens go back to the pool. Tokens are appended one by one, stopping at the first
        that ends the request (stop token, EOS after min_tokens, length), which frees its
        blocks. Full blocks of accepted tokens enter the prefix cache. A request aborted
        while the step ran is skipped, and so is a decode row's token that does not end a
        request with `updates_at_end_only`. A request that kept all its tokens gets its
        list of `sampled` as its update's (not copied)."""
        updates = []
        requests, block_size = self.requests, self.kv.block_size
        for rid, start, num_new, samples, _, spec in out.scheduled:
            request = requests.get(rid)
            if request is None:
                continue  # finished or aborted while the step ran
            before = request.num_computed_tokens
            computed = start + num_new
            if samples:
                tokens = sampled[rid]
                if spec or len(tokens) != 1:  # (a decode row's one token: nothing rejected)
                    rejected = 1 + len(spec) - len(tokens)
                    if not 0 <= rejected <= len(spec):
                        raise ValueError(f"{rid}: {len(tokens)} tokens accepted from "
                                         f"{len(spec)} drafts")
                    if rejected:
                        computed -= rejected
                        self.kv.trim(rid, computed + request.slots_ahead)
                request.slots_ahead = 0
            request.num_computed_tokens = computed
            if computed // block_size > before // block_size:
                # a block filled up (all_token_ids copies the whole sequence: not every step)
                self.kv.commit_computed(rid, request.all_token_ids, computed)
            if not samples:
                continue
            if len(tokens) == 1:  # a decode row's one token: the common case, first
                token = tokens[0]
                request.output_token_ids.append(token)
                stop = _token_stop(request, token)
                if stop is None:
                    if not request.updates_at_end_only:
                        updates.append(_tuple(RequestUpdate, (rid, tokens, None, None)))
                    continue
                self.finish(request, *stop)
                updates.append(RequestUpdate(rid, tokens, *stop))
                continue
            kept: list[int] = []
            stop = None
            for token in tokens:
                request.output_token_ids.append(token)
                kept.append(token)
                stop = _token_stop(request, token)
                if stop is not None:
                    self.finish(request, *stop)
                    break
            updates.append(RequestUpdate(rid, kept, *(stop or ())))
        return updates


def _plan(request: Request, num_new: int, start: int | None = None) -> ScheduledRequest:
    if start is None:
        start = request.num_computed_tokens
    known = min(num_new, request.num_tokens - start)
    spec = tuple(request.spec_token_ids[:num_new - known])
    tokens = tuple(request.token_slice(start, start + known)) + spec
    return ScheduledRequest(request.request_id, start, num_new,
                            start + known == request.num_tokens, tokens, spec)


def _token_stop(request: Request, token: int) -> tuple[str, int | None] | None:
    """Whether `token`, just appended, ends the request: (finish reason, stop reason)."""
    n = len(request.output_token_ids)
    if n >= request.min_tokens:
        if token in request.stop_token_ids:
            return "stop", token
        if token in request.eos_token_ids:
            return "stop", None
    if n >= request.max_new_tokens:
        return "length", None
    return None
