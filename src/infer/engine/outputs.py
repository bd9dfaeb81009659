"""Output objects shaped like vLLM's, so a script can swap one import."""

from __future__ import annotations

from dataclasses import dataclass

# Per generated token: {token_id: logprob} holding the sampled token and the top-N.
TokenLogprobs = dict[int, "Logprob"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When things happened to a request, in time.monotonic() seconds (vLLM's names)."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None  # once finished

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Set when the engine failed this request (and only it): a finished output whose
    # completions end with finish_reason "error".
    error: str | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    # (nothing comes before it), as vLLM gives them.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None
