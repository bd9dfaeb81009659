"""A request as the scheduler sees it: token ids, how many are computed, and why it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    # Tokens this request may generate at most (max_tokens, capped by max_model_len).
    max_new_tokens: int
    arrival_time: float = 0.0
    # n > 1: the id of the sibling whose computed prompt blocks this one should share.
    share_prefix_with: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    # Token stop conditions, checked by the scheduler as each token is appended: a token
    # in either set ends the request once `min_tokens` are out (eos_token_ids is empty
    # with ignore_eos). Stop strings need the text, so the output side checks those.
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    # Draft tokens proposed for the next step (speculative decoding): scheduled after the
    # request's last token and verified by that step.
    spec_token_ids: list[int] = field(default_factory=list)
    # A draft model's cache lacks the token before the last: its last verify accepted
    # every draft, and the draft model never ran the last draft (spec/model_drafter.py).
    draft_behind: bool = False
    # Slots past the tokens its verify step computes that a proposal round queued behind
    # that step writes (spec/model_drafter.py, `propose_ahead`): the verdict's rejected
    # drafts do not give them back.
    slots_ahead: int = 0
    # Computes its prompt in full, taking no prefix-cache hits (prompt logprobs need the
    # hidden state at every prompt position).
    skip_prefix_cache: bool = False
    # Wants no update from `Scheduler.update` for a token that does not end it (the
    # engine's quiet sequences once their first output is out: nothing between is sent).
    updates_at_end_only: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] without copying the whole sequence."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n_prompt]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
