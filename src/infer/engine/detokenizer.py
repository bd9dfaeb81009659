"""Incremental detokenization and stop strings, per generated sequence.

Text is emitted only once it is stable: a token that ends in the middle of a UTF-8
character (the decoder yields U+FFFD) waits for the next one, and while stop strings are
set, the last `longest_stop - 1` characters are held back, so a stop string that spans
tokens is never half-emitted.
"""

from __future__ import annotations

import re
from typing import Protocol

# Prompt tokens decoded in front of the output, so that tokenizers which strip a leading
# space at the start of a decode (SentencePiece) still render the first output token right.
_CONTEXT_TOKENS = 6


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop or []
        # One pass over the new text for all stop strings: the leftmost match wins, and at
        # one position the string listed first (alternation order).
        self._stop_pattern = re.compile("|".join(map(re.escape, self.stop))) if self.stop \
            else None
        self.include_stop = include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.emitted = 0  # characters of `text` already returned by `new_text`

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str | None:
        """Add one token; returns the stop string if the text now contains one (the text is
        then cut at it), else None."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        old_len = len(self.text)
        self.text += after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._find_stop(old_len)

    def append(self, token_id: int) -> None:
        """Add a token without decoding it (no stop strings to look for, no text wanted
        before the end): `flush` decodes everything pending in one call."""
        self.ids.append(token_id)

    def flush(self) -> None:
        """At the end: take whatever is pending, even an incomplete character."""
        if self.read_offset < len(self.ids):
            before = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset:])[len(before):]
            self.read_offset = len(self.ids)

    def _find_stop(self, old_len: int) -> str | None:
        if self._stop_pattern is None:
            return None
        match = self._stop_pattern.search(self.text, max(0, old_len - self.hold_back))
        if match is None:
            return None
        self.text = self.text[:match.end()] if self.include_stop else self.text[:match.start()]
        return match.group()

    def new_text(self, finished: bool) -> str:
        """Text not returned before that is safe to show now."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold_back)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
