"""Proposers of draft tokens. The engine core asks one after each step it accounts, for
the sequences that just sampled; every proposer answers for a list of requests at once."""

from __future__ import annotations

from typing import Protocol

import torch

from infer.engine.request import Request
from infer.engine.scheduler import SchedulerOutput
from infer.spec.ngram import propose_ngram
from infer.spec.rejection import Verified


def draft_budget(request: Request, k: int, max_model_len: int) -> int:
    """How many drafts `request` may get: at most k, none past its length limits (the
    verify step computes its last token and every draft; the last accepted draft is
    followed by one more sampled token)."""
    return max(0, min(k, max_model_len - request.num_tokens,
                      request.max_new_tokens - len(request.output_token_ids) - 1))


class Drafter(Protocol):
    own_cache: bool  # a draft model with a KV cache of its own
    on_device: bool  # proposes on the device too (`propose_on_device`)

    def propose(self, requests: list[Request]) -> list[list[int]]:
        """Drafts for the tokens after each request's last."""

    def propose_on_device(self, requests: list[Request]) -> list[torch.Tensor | None]:
        """The same drafts left where they were made (with `on_device`)."""

    def propose_ahead(self, requests: list[Request], verify_ids: torch.Tensor,
                      verdict: Verified) -> torch.Tensor | None:
        """The drafts after a verify step still on the device, queued behind it (with
        `on_device`; None where it cannot)."""

    def mirror(self, out: SchedulerOutput, requests: dict[str, Request],
               device_input_ids: torch.Tensor | None = None) -> None:
        """See each step the target runs, once launched (a draft model keeps its cache);
        `device_input_ids` as `ModelRunner.execute` takes them."""


class NgramDrafter:
    own_cache = False
    on_device = False  # matched on the host

    def __init__(self, k: int, min_n: int, max_n: int, max_model_len: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.max_model_len = max_model_len

    def propose(self, requests: list[Request]) -> list[list[int]]:
        drafts = []
        for request in requests:
            k = draft_budget(request, self.k, self.max_model_len)
            drafts.append(propose_ngram(request.all_token_ids, k, self.min_n, self.max_n)
                          if k else [])
        return drafts

    def mirror(self, out: SchedulerOutput, requests: dict[str, Request],
               device_input_ids: torch.Tensor | None = None) -> None:
        pass
