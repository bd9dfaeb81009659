"""Which sequences get drafts for their next step, and how many (the engine core asks
after each step it accounts)."""

from __future__ import annotations

from infer.engine.config import EngineConfig
from infer.engine.request import Request
from infer.sampling_params import SamplingParams
from infer.spec.ngram import propose_ngram


def speculates(params: SamplingParams, constrained: bool) -> bool:
    """Requests whose sampling the verification does not reproduce are not speculated:
    penalties (they depend on the drafts before each position), logprobs (not reported
    for drafts yet) and grammars (masks per drafted position: not yet)."""
    return not (params.has_penalties or params.logprobs is not None or constrained)


class NgramDrafter:
    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.ngram_min, config.ngram_max
        self.max_batch = config.speculative_max_batch
        self.max_model_len = max_model_len

    def propose(self, request: Request, batch_size: int) -> list[int]:
        """Drafts for the tokens after `request`'s last: none in batches above the limit,
        none past the length limits."""
        k = min(self.k, self.max_model_len - request.num_tokens,
                request.max_new_tokens - len(request.output_token_ids) - 1)
        if k <= 0 or batch_size > self.max_batch:
            return []
        return propose_ngram(request.all_token_ids, k, self.min_n, self.max_n)
