"""Every check a request passes before it is queued, in one place: prompt forms,
tokenization, token ids against the vocabulary, and the context length and KV pool.

Pure host work on the tokenizer and a few sizes: the server calls it too (from its
tokenizer threads) so that it answers 400 before anything is queued.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infer.engine.request import Request
from infer.engine.structured_output import CompileThread, GrammarError, StructuredOutputs
from infer.inputs import parse_prompt
from infer.loader.tokenizer import Tokenizer
from infer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from infer.engine.core_loading import CoreInfo
    from infer.structured_outputs import StructuredOutputsParams


class RequestRejected(ValueError):
    """A request that can never be served; `param` names the request field to change."""

    def __init__(self, message: str, param: str = "prompt",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]
    max_new_tokens: int
    params: SamplingParams  # as given, with what needs the tokenizer filled in


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 num_blocks: int, block_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._structured: StructuredOutputs | None = None
        self._structured_lock = threading.Lock()  # made once, whichever thread asks first
        # Where constraints are compiled: this side's own grammar library, unless the
        # engine shares its core's (one vocabulary set-up and one compile per constraint).
        self.structured_outputs: Callable[[], StructuredOutputs] = self._own_structured_outputs
        self.compile_thread = CompileThread()

    @classmethod
    def for_core(cls, tokenizer: Tokenizer, info: CoreInfo) -> InputProcessor:
        return cls(tokenizer, info.vocab_size, info.max_model_len, info.num_blocks,
                   info.block_size)

    def process(self, prompt: object, params: SamplingParams) -> ProcessedPrompt:
        text, ids = parse_prompt(prompt)
        keep = params.truncate_prompt_tokens
        if ids is None:
            ids = self.tokenize(text, limit=keep is None)
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:]
            text = None if text is None else self.tokenizer.decode(ids, False)
        if params.bad_words and params.bad_words_token_ids is None:
            params = dataclasses.replace(params,
                                         bad_words_token_ids=self.bad_words_ids(params))
        self.check_token_ids(ids, params)
        if params.structured_outputs is not None:
            self.check_constraint(params)
        return ProcessedPrompt(text, ids, self.max_new_tokens(len(ids), params.max_tokens),
                               params)

    def bad_words_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's token ids, as written and after a space (how it reads inside a
        text), as vLLM bans them."""
        found: list[list[int]] = []
        for word in params.bad_words or ():
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in found:
                    found.append(ids)
        return found

    def check_constraint(self, params: SamplingParams) -> None:
        """A constraint the grammar library cannot compile is refused before anything is
        queued (a core in another process compiles it again for its matchers). Compiled
        constraints are cached, so a server compiles each in its tokenizer threads first
        (`compile_constraint`) and this check is then a lookup."""
        self.compile_constraint(params.structured_outputs)

    def compile_constraint(self, constraint: StructuredOutputsParams,
                           field: str = "structured_outputs") -> None:
        try:
            library = self.structured_outputs()
        except Exception as exc:  # e.g. a tokenizer the library cannot read
            raise RequestRejected(f"{field}: structured output is not available for this "
                                  f"model's tokenizer ({exc})", field) from None
        try:
            if library.cached(constraint) is None:  # compiled in a thread, under a limit
                job = self.compile_thread.submit(lambda: library.compile(constraint))
                try:
                    job.result(timeout=self.compile_thread.timeout_s)
                except futures.TimeoutError:
                    self.compile_thread.abandon()
                    raise RequestRejected(f"{field}: {self.compile_thread.timeout_message()}",
                                          field) from None
        except GrammarError as exc:
            message = str(exc) if field == "structured_outputs" else f"{field}: {exc.reason}"
            raise RequestRejected(message, field) from None
        except ValueError as exc:
            raise RequestRejected(str(exc), field) from None

    def _own_structured_outputs(self) -> StructuredOutputs:
        with self._structured_lock:
            if self._structured is None:
                self._structured = StructuredOutputs(self.tokenizer, self.vocab_size)
        return self._structured

    def tokenize(self, text: str, add_special_tokens: bool = True,
                 limit: bool = True) -> list[int]:
        """A text whose length alone proves it over the context is refused untokenized
        (unless not `limit`: the prompt is truncated afterwards)."""
        at_least = self.tokenizer.min_token_count(text) if limit else 0
        if at_least >= self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has at least {at_least} tokens.", code="context_length_exceeded")
        return self.tokenizer.encode(text, add_special_tokens)

    def check_token_ids(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Every token id a request names must be a row of the logits: one that is not
        would fail the sampler, or the embedding, for every request of its batch."""
        if not prompt_ids:
            raise RequestRejected("the prompt is empty (no tokens)")
        vocab = self.vocab_size
        for field, ids in (("prompt", prompt_ids), *params.token_ids_named()):
            if not ids or (min(ids) >= 0 and max(ids) < vocab):
                continue
            bad = [t for t in ids if not 0 <= t < vocab]
            what = "prompt token ids" if field == "prompt" else field
            raise RequestRejected(f"{what} out of range [0, {vocab}): {bad[:5]}", field)

    def max_new_tokens(self, num_prompt: int, max_tokens: int | None,
                       strict: bool = False) -> int:
        """How many tokens a request of `num_prompt` prompt tokens may generate.
        `max_tokens` None: as many as fit. Past the context length `max_tokens` is capped,
        or with `strict` (the server, as OpenAI) refused."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens (prompt + output); "
                f"the prompt has {num_prompt} tokens, which leaves no room for output (at "
                f"most {limit - 1} prompt tokens).", code="context_length_exceeded")
        if strict and max_tokens is not None and num_prompt + max_tokens > limit:
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                f"{max_tokens} for the completion).", "max_tokens", "context_length_exceeded")
        capacity = self.num_blocks * self.block_size  # one sequence holding every block
        if num_prompt >= capacity:
            raise RequestRejected(
                f"the prompt has {num_prompt} tokens but the KV cache pool holds {capacity} "
                f"tokens ({self.num_blocks} blocks of {self.block_size}), and the prompt "
                "needs room for at least one output token; send a shorter prompt or start "
                "the engine with more blocks")
        room = limit - num_prompt
        if max_tokens is None:
            return min(room, capacity - num_prompt)
        max_new = min(max_tokens, room)
        if num_prompt + max_new > capacity:
            blocks = -(-(num_prompt + max_new) // self.block_size)
            raise RequestRejected(
                f"the request needs {blocks} KV blocks ({num_prompt} prompt + {max_new} new "
                f"tokens) but the pool has {self.num_blocks} blocks of {self.block_size} "
                f"tokens; lower max_tokens to at most {capacity - num_prompt}", "max_tokens")
        return max_new


def split_into_sequences(request_id: str, prompt: ProcessedPrompt,
                         arrival_time: float) -> list[tuple[Request, SamplingParams]]:
    """A request's `n` sequences for the core: `<id>#<i>` when n > 1 (sharing the first
    one's prompt blocks), each with its own seed (seed + i) when one is set. Only the
    first computes prompt logprobs (they are the request's, not a sequence's)."""
    params = prompt.params
    sequences = []
    for i in range(params.n):
        seq_id = f"{request_id}#{i}" if params.n > 1 else request_id
        p = params
        if i > 0 and (params.seed is not None or params.prompt_logprobs is not None):
            p = dataclasses.replace(params, prompt_logprobs=None, seed=None if params.seed
                                    is None else params.seed + i)
        sequences.append((Request(seq_id, prompt.token_ids, prompt.max_new_tokens, arrival_time,
                                  share_prefix_with=f"{request_id}#0" if i > 0 else None), p))
    return sequences
