"""Engine logprobs ({token_id: Logprob} per generated token) in OpenAI's two shapes."""

from __future__ import annotations

from infer.engine.outputs import TokenLogprobs
from infer.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def _ranked(entry: TokenLogprobs, k: int) -> list[tuple[str, float]]:
    tops = sorted((lp.rank, lp.decoded_token or "", lp.logprob)
                  for lp in entry.values() if lp.rank is not None and lp.rank <= k)
    return [(text, logprob) for _, text, logprob in tops]


def completion_logprobs(entries: list[TokenLogprobs], token_ids: list[int],
                        k: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    offset = 0
    for entry, token in zip(entries, token_ids):
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
