"""Drafts from a model: the target's own first layers (`speculative_method="self"`) or a
small model with the target's vocabulary (`"draft"`).

A proposal round runs k forwards over every speculating sequence at once, each feeding
the previous forward's argmax (greedy drafts: the verification treats them as
deterministic proposals, which keeps it lossless). The first forward takes the sequence's
last token, which the target has not computed yet; the later ones one draft each, and
forward i writes the draft's KV at the position of draft i - 1 -- where the verify step
writes next (its slots are allocated before the round; the scheduler then finds them
held).

Whose KV the draft's cache holds:
- an early exit shares the target's layers and cache: the target wrote every position.
- a draft model has a cache of its own, with the target's block tables. It runs every
  step item the target runs without drafts (`mirror`: prefill chunks, plain decodes).
  Verified positions need no mirror: the round wrote each accepted draft's KV with that
  draft as input, except the last draft, which no draft forward took. When all k were
  accepted (`Request.draft_behind`), the next forward over the sequence -- the round's
  first, or the mirror of a plain decode -- starts one token earlier.

A round may also be queued right behind the verify step it follows, before the host has
read that step's verdict (`propose_ahead`): whatever the verdict, a sequence of N tokens
that verified k drafts goes on at N + m, m the drafts it accepted, so the round is the
host's plan for m = 0 moved m tokens on, on the device. Its first forward takes the token
the verdict ends on and, with a cache of its own, the one before, whose KV the draft's
cache lacks exactly when m = k; otherwise that token is done (`done_below`): nothing
stored, and for a lone sequence its row left out of the GEMVs (`kernels/row_skip.py`).
"""

from __future__ import annotations

import torch

from infer.cache.kv_manager import KVCacheManager
from infer.engine.model_runner import ModelRunner, StepInputs
from infer.engine.request import Request
from infer.engine.sampler import argmax
from infer.engine.scheduler import ScheduledRequest, SchedulerOutput
from infer.kernels import triton_available
from infer.spec.drafter import draft_budget
from infer.spec.rejection import Verified


def round_inputs(verify_ids: torch.Tensor, token_ids: torch.Tensor, num_tokens: torch.Tensor,
                 with_input: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a round queued behind a verify step starts, from its verdict: (ids `[n * q]`,
    accepted `[n]`), int64; sequence i's ids are the token its verdict ends on,
    `token_ids[i, accepted[i]]`, after (`with_input`, q = 2) the verify step's input
    there, `verify_ids[i, accepted[i]]`. `accepted = num_tokens - 1`; `verify_ids` and
    `token_ids` `[n, K + 1]`."""
    if token_ids.is_cuda and triton_available():
        from infer.kernels import advance_step

        return advance_step.round_inputs(verify_ids, token_ids, num_tokens, with_input)
    accepted = num_tokens - 1
    ids = token_ids.gather(1, accepted[:, None])
    if with_input:
        ids = torch.cat([verify_ids.gather(1, accepted[:, None]), ids], dim=1)
    return ids.reshape(-1), accepted


class ModelDrafter:
    on_device = True  # `propose_on_device` leaves the drafts where the round made them

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, k: int, max_model_len: int,
                 own_cache: bool) -> None:
        """`own_cache`: the runner's model is a separate draft model (see above)."""
        self.runner, self.kv = runner, kv
        runner.float_logits = False  # a round takes only the argmax of its logits
        self.k, self.max_model_len = k, max_model_len
        self.own_cache = own_cache
        self.num_forwards = 0  # draft forwards run in proposal rounds
        self.num_rounds_ahead = 0  # rounds queued before the verdict they follow was read

    def enable_graphs(self, max_batch: int, max_model_len: int, capture: bool = True,
                      logits: bool = False, ahead_batch: int = 0, split_keys: bool = False
                      ) -> float:
        """CUDA graphs of the runner's one-token steps and, for rounds queued ahead of up
        to `ahead_batch` sequences with a cache of its own, of their two-token first
        forward (`split_keys`: as the verify graphs' attention; `logits`: each graph ends
        with the LM head, over the rows a round samples); `capture=False`: the same static
        buffers, run eagerly (CPU tests). Seconds spent capturing."""
        graphs = [self.runner.enable_decode_graphs(max_batch, max_model_len, capture,
                                                   logits=logits)]
        if ahead_batch and self.own_cache:
            graphs.append(self.runner.enable_decode_graphs(
                min(ahead_batch, max_batch), max_model_len, capture, tokens_per_seq=2,
                split_keys=split_keys, catch_up=True, logits=logits, last_token_logits=True))
        if ahead_batch:  # the rounds queued ahead move their graphs' steps on
            for g in graphs:
                g.attn.compile_advance()
        return sum(g.capture_seconds for g in graphs)

    def propose(self, requests: list[Request]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        rows, _, proposed = self._round(requests)
        if not rows:
            return drafts
        flat = torch.cat(proposed).tolist()  # forward by forward, row by row
        at = 0
        for part in proposed:
            for row in range(len(part)):
                drafts[rows[row]].append(flat[at + row])
            at += len(part)
        return drafts

    def propose_on_device(self, requests: list[Request]) -> list[torch.Tensor | None]:
        """The drafts of `propose`, left on the device (none read back, so the host plans
        and queues the step that verifies them while the round runs): request i's as a
        tensor of its drafts, None where it has none."""
        drafts: list[torch.Tensor | None] = [None] * len(requests)
        rows, budgets, proposed = self._round(requests)
        if not rows:
            return drafts
        table = torch.zeros(len(rows), len(proposed), dtype=proposed[0].dtype,
                            device=proposed[0].device)
        for j, part in enumerate(proposed):
            table[:len(part), j] = part
        for row, i in enumerate(rows):
            drafts[i] = table[row, :budgets[i]]
        return drafts

    def propose_ahead(self, requests: list[Request], verify_ids: torch.Tensor,
                      verdict: Verified) -> torch.Tensor | None:
        """The drafts `[len(requests), k]` of the round after a verify step still on the
        device, queued behind it (see above): `requests` are the step's sequences in its
        order, each verifying k drafts, `verify_ids [n, k + 1]` its input ids, `verdict`
        its tokens. None where the round cannot run so: a sequence without room for k
        drafts after the longest verdict, too few free blocks, no static buffers."""
        k, n, q = self.k, len(requests), 1 + self.own_cache
        if not (self.runner.takes_offsets([q] * n) and self.runner.takes_offsets([1] * n)):
            return None
        # The longest verdict adds k + 1 tokens; draft_budget must still grant k after it.
        if any(min(self.max_model_len - r.num_tokens,
                   r.max_new_tokens - len(r.output_token_ids) - 1) < 2 * k + 1
               for r in requests):
            return None
        # Up to the slots of the verify step after it, k drafts on from the longest verdict.
        if not all(self.kv.allocate(r.request_id, r.num_tokens + 2 * k + 1)
                   for r in requests):
            return None
        for r in requests:
            r.slots_ahead = k + 1
        tables = [self.kv.tables[r.request_id] for r in requests]
        request_ids = [r.request_id for r in requests]
        ids, accepted = round_inputs(verify_ids, verdict.token_ids, verdict.num_tokens,
                                     self.own_cache)
        starts = [r.num_tokens + 1 - q for r in requests]
        inputs = StepInputs([], [p for s in starts for p in range(s, s + q)], [q] * n,
                            [s + q for s in starts], tables,
                            [i * q + q - 1 for i in range(n)], request_ids, [1] * n)
        ids = argmax(self.runner.execute(inputs, ids, accepted,
                                         done_below=k if self.own_cache else 0))
        proposed = [ids]
        for j in range(1, k):
            positions = [r.num_tokens + j for r in requests]
            inputs = StepInputs([], positions, [1] * n, [p + 1 for p in positions], tables,
                                list(range(n)), request_ids, [1] * n)
            # The second one-token forward on moves the first's buffers on the device.
            ids = argmax(self.runner.execute(inputs, ids, None if j > 1 else accepted,
                                             follows=j > 1))
            proposed.append(ids)
        self.num_forwards += k
        self.num_rounds_ahead += 1
        return torch.stack(proposed, dim=1)

    def _round(self, requests: list[Request]
               ) -> tuple[list[int], list[int], list[torch.Tensor]]:
        """The proposal round, queued: the requests drafting (indices, longest budget
        first), every request's budget, and each forward's argmax ids (forward j's for the
        rows still drafting then, a prefix of them)."""
        budgets = [draft_budget(r, self.k, self.max_model_len) for r in requests]
        # The verify step computes num_tokens + k tokens of each; without the blocks for
        # them now, no drafts (the scheduler decides what to preempt, not the drafter).
        rows = [i for i, (r, k) in enumerate(zip(requests, budgets))
                if k and self.kv.allocate(r.request_id, r.num_tokens + k)]
        if not rows:
            return rows, budgets, []
        # Longest budgets first: the rows still drafting at forward j are a prefix.
        rows.sort(key=lambda i: -budgets[i])
        chosen = [requests[i] for i in rows]
        tables = [self.kv.tables[r.request_id] for r in chosen]
        ids = argmax(self.runner.execute(self._first_inputs(chosen, tables)))
        proposed = [ids]
        positions = [r.num_tokens for r in chosen]
        for j in range(1, budgets[rows[0]]):
            n = sum(budgets[i] > j for i in rows)
            inputs = StepInputs([], positions[:n], [1] * n, [p + 1 for p in positions[:n]],
                                tables[:n], list(range(n)),
                                [r.request_id for r in chosen[:n]], [1] * n)
            ids = argmax(self.runner.execute(inputs, ids[:n]))
            proposed.append(ids)
            positions = [p + 1 for p in positions]
        self.num_forwards += len(proposed)
        return rows, budgets, proposed

    def _first_inputs(self, chosen: list[Request], tables: list[list[int]]) -> StepInputs:
        """Each sequence's last token, after the one before it where the draft's cache
        lacks that."""
        inputs = StepInputs([], [], [], [], tables, [], [r.request_id for r in chosen],
                            [1] * len(chosen))
        for r in chosen:
            n = 1 + (self.own_cache and r.draft_behind)
            r.draft_behind = False
            inputs.input_ids.extend(r.token_slice(r.num_tokens - n, r.num_tokens))
            inputs.positions.extend(range(r.num_tokens - n, r.num_tokens))
            inputs.query_lens.append(n)
            inputs.seq_lens.append(r.num_tokens)
            inputs.sample_rows.append(len(inputs.input_ids) - 1)
        return inputs

    def mirror(self, out: SchedulerOutput, requests: dict[str, Request],
               device_input_ids: torch.Tensor | None = None) -> None:
        """Run the step's items without drafts through a draft model with its own cache;
        `device_input_ids`: the ids of a step launched ahead (no drafts in such a step,
        and no sequence behind: the step after a verify is never launched ahead)."""
        if not self.own_cache:
            return
        items = []
        for item in out.scheduled:
            if item.spec_token_ids:
                continue
            request = requests[item.request_id]
            if request.draft_behind and item.num_new_tokens == 1 and item.start > 0:
                assert item.token_ids is not None, "a sequence behind in a step launched ahead"
                prev = request.token_slice(item.start - 1, item.start)
                item = ScheduledRequest(item.request_id, item.start - 1, 2, False,
                                        (*prev, *item.token_ids), ())
            request.draft_behind = False
            items.append(item._replace(samples=False))
        if device_input_ids is not None:
            assert len(items) == len(out.scheduled), "drafts in a step launched ahead"
        if items:
            self.runner.execute(self.runner.prepare(SchedulerOutput(tuple(items)),
                                                    self.kv.tables), device_input_ids)
