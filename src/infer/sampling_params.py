"""User-facing sampling parameters, shaped like vLLM's so a script can swap one import."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass

from infer.structured_outputs import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

# Temperatures below this are greedy decoding (argmax): dividing by them would overflow.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
# Bounds on stop conditions, so that one request cannot slow every step it shares: each
# generated token is matched against all of a sequence's stop strings (OpenAI allows 4).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 128
MAX_STOP_TOKEN_IDS = 256
# logit_bias as OpenAI bounds it (-100 bans a token, 100 all but forces it); the count
# bounds the host work per step.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_BAD_WORDS = 256


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _int(name: str, value: object, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not _is_int(value):
        kind = "an int or None" if optional else "an int"
        raise ValueError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    return int(value)


def _float(name: str, value: object) -> float:
    if not _is_real(value):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _token_id_list(name: str, ids: object) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of ints, got {ids!r}")
    for t in ids:
        if not _is_int(t):
            raise ValueError(f"{name} must be ints, got {t!r}")
        if t < 0:
            raise ValueError(f"{name} must be >= 0, got {t}")
    return [int(t) for t in ids]


class RequestOutputKind(enum.Enum):
    """What each output of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, once the request has finished


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    ignore_eos: bool = False
    # Top logprobs returned per token besides the sampled one's; 0: only the sampled token's.
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output obeys
    # Logprobs of the prompt's tokens (each given the ones before it), with the top-N
    # at each position: RequestOutput.prompt_logprobs. Such a request computes its whole
    # prompt (no prefix-cache hits), as vLLM does.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # Words never generated: each word's tokens (with and without a leading space) are
    # banned as a sequence, i.e. its last token after the others.
    bad_words: list[str] | None = None
    detokenize: bool = True  # False: token ids only, `text` stays empty
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens
    # bad_words as token-id sequences: filled in from the tokenizer when the request is
    # queued (the engine core has no tokenizer).
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        self.n = _int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")

        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature}"
            )
        self.top_p = _float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {self.top_p}")
        self.top_k = _int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(
                f"top_k must be -1 or 0 (disabled) or a positive int, got {self.top_k}"
            )
        self.min_p = _float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = disabled), got {self.min_p}")

        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(
                "repetition_penalty must be > 0 (1 = disabled, > 1 discourages repeats), "
                f"got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = disabled), got {value}")
            setattr(self, name, value)

        self.seed = _int("seed", self.seed, optional=True)
        self.max_tokens = _int("max_tokens", self.max_tokens, optional=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (or None), got {self.max_tokens}")
        self.min_tokens = _int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

        self.logprobs = _int("logprobs", self.logprobs, optional=True)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"logprobs must be in [0, {MAX_LOGPROBS}] (or None), got {self.logprobs}"
            )
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, optional=True)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (or None), got "
                             f"{self.prompt_logprobs}")
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_id_list("allowed_token_ids",
                                                    self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None: every token)")
        self.bad_words = self._normalise_bad_words(self.bad_words)
        self.detokenize = _bool("detokenize", self.detokenize)
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need the text: they cannot be combined with "
                             "detokenize=False (use stop_token_ids)")
        self.truncate_prompt_tokens = _int("truncate_prompt_tokens",
                                           self.truncate_prompt_tokens, optional=True)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError("truncate_prompt_tokens must be at least 1 (or None), got "
                             f"{self.truncate_prompt_tokens}")
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [_token_id_list("bad_words_token_ids", ids)
                                        for ids in self.bad_words_token_ids]
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured_outputs: the "
                                 "grammar decides where the output may end")

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} "
                             "are allowed")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop strings must be strings, got {s!r}")
            if not s:
                raise ValueError("stop strings must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must have at most {MAX_STOP_STRING_CHARS} "
                                 f"characters, got one of {len(s)}")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        ids = _token_id_list("stop_token_ids", ids)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(ids)} ids; at most "
                             f"{MAX_STOP_TOKEN_IDS} are allowed")
        return ids

    @staticmethod
    def _normalise_logit_bias(bias: object) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias has {len(bias)} tokens; at most "
                             f"{MAX_LOGIT_BIAS_TOKENS} are allowed")
        out = {}
        for token, value in bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
            value = _float("logit_bias values", value)
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {value} for token {token}")
            out[int(token)] = value
        return out or None

    @staticmethod
    def _normalise_bad_words(words: object) -> list[str] | None:
        if words is None:
            return None
        if isinstance(words, str) or not isinstance(words, (list, tuple)):
            raise ValueError(f"bad_words must be a list of strings, got {words!r}")
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words has {len(words)} words; at most {MAX_BAD_WORDS} "
                             "are allowed")
        for word in words:
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words must be non-empty strings, got {word!r}")
        return list(words) or None

    def token_ids_named(self) -> list[tuple[str, list[int]]]:
        """Every token id the parameters name, by field (checked against the vocabulary
        when the request is queued)."""
        named = [("stop_token_ids", self.stop_token_ids)]
        if self.logit_bias:
            named.append(("logit_bias", list(self.logit_bias)))
        if self.allowed_token_ids:
            named.append(("allowed_token_ids", self.allowed_token_ids))
        return named

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def reads_output(self) -> bool:
        """Whether sampling reads the tokens generated so far: penalties count them, a
        bad word of several tokens matches its start against them."""
        return self.has_penalties or any(len(w) > 1 for w in self.bad_words_token_ids or ())

    @property
    def has_penalties(self) -> bool:
        """Whether sampling depends on the tokens generated so far (not just their count)."""
        return (self.repetition_penalty != 1 or self.frequency_penalty != 0
                or self.presence_penalty != 0)
