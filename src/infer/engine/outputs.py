"""Output objects shaped like vLLM's, so a script can swap one import."""

from __future__ import annotations

from dataclasses import dataclass, field

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
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # time.monotonic() seconds: arrival_time, first_token_time, last_token_time, and
    # finished_time once finished.
    metrics: dict[str, float] = field(default_factory=dict)
    # Set when the engine failed this request (and only it): a finished output whose
    # completions end with finish_reason "error".
    error: str | None = None


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None: outside the requested top-N
    decoded_token: str | None = None
