"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the log-probability of each prompt
token given the tokens before it, read off the hidden states a prefill step computes
anyway, chunk by chunk as the prompt is computed.

The hidden state at position p gives the distribution of token p + 1, so a prompt of P
tokens has P - 1 entries (its first token has none). A request that wants them computes
its whole prompt: positions served from the prefix cache would have no hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from infer.engine.sampler import raw_logprobs
from infer.engine.scheduler import ScheduledRequest
from infer.transfer import HostCopy, to_device

if TYPE_CHECKING:
    from infer.engine.model_runner import ModelRunner

# Rows of logits made at once: [rows, vocab] float32 (128 MB for a 128k vocabulary).
CHUNK_ROWS = 256


class PromptLogprobs(NamedTuple):
    """Entries for prompt tokens 1 .. P - 1: each token's raw logprob and rank, and the
    (ids, logprobs) of the `prompt_logprobs` most likely tokens there (None if 0)."""

    logprobs: list[float]
    ranks: list[int]
    top: list[tuple[list[int], list[float]]] | None


@dataclass
class PromptLogprobsState:
    """One sequence's prompt logprobs as its prefill steps compute them."""

    num_top: int
    num_prompt: int
    next_position: int = 0  # the first position whose logits no launched step computes
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.logprobs) >= self.num_prompt - 1

    def result(self) -> PromptLogprobs:
        return PromptLogprobs(self.logprobs, self.ranks, self.top if self.num_top else None)


@dataclass
class PromptLogprobsJob:
    """A launched step's prompt logprobs on their way to the host: per span (sequence
    id, number of entries) in row order."""

    spans: list[tuple[str, int]]
    results: HostCopy  # chosen [R], ranks [R], top ids [R, K], top logprobs [R, K]

    def deliver(self, states: dict[str, PromptLogprobsState]) -> None:
        """Append each span's entries to its sequence's state (a sequence gone since is
        skipped)."""
        chosen, ranks, top_ids, top_lps = (
            None if t is None else t.tolist() for t in self.results.wait())
        at = 0
        for seq_id, count in self.spans:
            state = states.get(seq_id)
            if state is not None:
                state.logprobs += chosen[at:at + count]
                state.ranks += ranks[at:at + count]
                if state.num_top:
                    state.top += [(top_ids[r][:state.num_top], top_lps[r][:state.num_top])
                                  for r in range(at, at + count)]
            at += count


def launch_prompt_logprobs(runner: ModelRunner, hidden: torch.Tensor,
                           scheduled: tuple[ScheduledRequest, ...],
                           states: dict[str, PromptLogprobsState],
                           prompts: dict[str, list[int]]) -> PromptLogprobsJob | None:
    """Queue the logprobs of the prompt positions this step computes for the sequences
    in `states` (`hidden [tokens, H]` in the step's token order); None if it computes
    none. Moves each state's `next_position` past them: a preempted sequence computing
    its prompt again does not report it twice."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[str, int]] = []
    num_top = 0
    offset = 0
    for item in scheduled:
        state = states.get(item.request_id)
        if state is not None:
            first = max(item.start, state.next_position)
            end = min(item.start + item.num_new_tokens, state.num_prompt - 1)
            if end > first:
                rows += range(offset + first - item.start, offset + end - item.start)
                targets += prompts[item.request_id][first + 1:end + 1]
                spans.append((item.request_id, end - first))
                state.next_position = end
                num_top = max(num_top, state.num_top)
        offset += item.num_new_tokens
    if not rows:
        return None
    target_ids = to_device(torch.tensor(targets), hidden.device)
    parts = []
    with torch.inference_mode():
        for at, logits in zip(range(0, len(rows), CHUNK_ROWS),
                              runner.logits_of_rows(hidden, rows, CHUNK_ROWS)):
            parts.append(raw_logprobs(logits, target_ids[at:at + CHUNK_ROWS], num_top))
    chosen, ranks, top_ids, top_lps = (
        None if part[0] is None else torch.cat(part) for part in zip(*parts))
    return PromptLogprobsJob(spans, HostCopy(chosen, ranks, top_ids, top_lps))
