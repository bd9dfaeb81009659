"""Engine logprobs ({token_id: Logprob} per token) in OpenAI's two shapes, and prompt
logprobs in vLLM's."""

from __future__ import annotations

from collections.abc import Callable

from infer.engine.outputs import TokenLogprobs
from infer.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)


def _ranked(entry: TokenLogprobs, k: int) -> list[tuple[str, float]]:
    tops = sorted((lp.rank, lp.decoded_token or "", lp.logprob)
                  for lp in entry.values() if lp.rank is not None and lp.rank <= k)
    return [(text, logprob) for _, text, logprob in tops]


def completion_logprobs(entries: list[TokenLogprobs | None], token_ids: list[int],
                        k: int, decode: Callable[[int], str] | None = None
                        ) -> CompletionLogprobs:
    """A None entry (an echoed prompt's first token: nothing before it) gets null
    logprobs, its text from `decode`."""
    out = CompletionLogprobs()
    offset = 0
    for entry, token in zip(entries, token_ids):
        if entry is None:
            text = decode(token) if decode is not None else ""
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(text)
            continue
        chosen = entry[token]
        text = chosen.decoded_token or ""
        out.tokens.append(text)
        out.token_logprobs.append(chosen.logprob)
        out.top_logprobs.append(dict(_ranked(entry, k)) if k else {text: chosen.logprob})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(entries: list[TokenLogprobs], token_ids: list[int], k: int) -> ChatLogprobs:
    content = []
    for entry, token in zip(entries, token_ids):
        chosen = entry[token]
        text = chosen.decoded_token or ""
        content.append(ChatTokenLogprob(
            token=text, logprob=chosen.logprob, bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                          for t, lp in _ranked(entry, k)]))
    return ChatLogprobs(content=content)


def prompt_logprobs(entries: list[TokenLogprobs | None]) -> PromptLogprobs:
    return [None if entry is None else {
        str(token): PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                  decoded_token=lp.decoded_token)
        for token, lp in entry.items()} for entry in entries]
