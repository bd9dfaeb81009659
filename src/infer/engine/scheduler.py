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
from dataclasses import dataclass, field

from infer.cache.kv_manager import KVCacheManager
from infer.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


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
        out = SchedulerOutput()
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
            if not self._grow_or_preempt(request, num_new, scheduled, out):
                continue
            out.scheduled.append(ScheduledRequest(request, num_new))
            scheduled.add(request.request_id)
            budget -= num_new
        if not (self.static and was_running):
            budget = self._admit(budget, out)
        return out

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if self.chunked_prefill:
            return min(remaining, budget, self.max_prefill_chunk)
        return remaining if remaining <= budget else 0

    def _grow_or_preempt(
        self, request: Request, num_new: int, scheduled: set[str], out: SchedulerOutput
    ) -> bool:
        total = request.num_computed_tokens + num_new
        while not self.kv.allocate(request.request_id, total):
            victims = [r for r in self.running if r.request_id not in scheduled]
            victim = victims[-1]  # the newest; `request` itself is always a candidate
            self._preempt(victim)
            out.preempted.append(victim)
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

    def _admit(self, budget: int, out: SchedulerOutput) -> int:
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
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return budget

    def _waits_for_sibling(self, request: Request) -> bool:
        """An n > 1 sibling waits until the first sibling has computed its prompt."""
        source = self.requests.get(request.share_prefix_with or "")
        return (
            source is not None
            and source.status is RequestStatus.RUNNING
            and source.num_computed_tokens < len(source.prompt_token_ids)
        )

    def _match_prefix(self, request: Request) -> int:
        tokens = request.all_token_ids
        computed = self.kv.match_prefix(request.request_id, tokens)
        source = self.requests.get(request.share_prefix_with or "")
        if computed == 0 and source is not None and source.status is RequestStatus.RUNNING:
            self.kv.free(request.request_id)
            usable = min(len(request.prompt_token_ids) - 1, source.num_computed_tokens)
            computed = self.kv.share_prefix(request.request_id, source.request_id, usable)
        return computed

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Account for a finished step: advance computed counts, append sampled tokens,
        register full blocks for prefix caching. Returns requests that produced a token.
        Stop checks are the engine's (they need the tokenizer)."""
        produced = []
        for item in out.scheduled:
            request = item.request
            if request.finished:
                continue  # aborted while the step ran
            samples = item.samples
            before = request.num_computed_tokens
            request.num_computed_tokens += item.num_new_tokens
            if request.num_computed_tokens // self.kv.block_size > before // self.kv.block_size:
                # a block filled up (all_token_ids copies the whole sequence: not every step)
                self.kv.commit_computed(
                    request.request_id, request.all_token_ids, request.num_computed_tokens
                )
            if samples:
                request.output_token_ids.append(sampled[request.request_id])
                produced.append(request)
        return produced
