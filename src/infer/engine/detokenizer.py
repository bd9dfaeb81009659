"""Incremental detokenization and stop strings, per generated sequence.

Text is emitted only once it is stable: a token that ends in the middle of a UTF-8
character (the decoder yields U+FFFD) waits for the next one, and while stop strings are
set, the last `longest_stop - 1` characters are held back, so a stop string that spans
tokens is never half-emitted.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Protocol

# Prompt tokens decoded in front of the output, so that tokenizers which strip a leading
# space at the start of a decode (SentencePiece) still render the first output token right.
_CONTEXT_TOKENS = 6


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def _no_stream(skip_special_tokens: bool) -> None:
    return None


class IncrementalDetokenizer:
    """Per token, work in proportion to the new text only: the text is kept as pieces
    (returned, ready to return) plus a short pending tail, the last `hold_back`
    characters, which is all a stop string ending in the next token can reach into."""

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
        self.stop = stop or []
        # One pass over the new text for all stop strings: the leftmost match wins, and at
        # one position the string listed first (alternation order).
        self._stop_pattern = re.compile("|".join(map(re.escape, self.stop))) if self.stop \
            else None
        self.include_stop = include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self._returned: list[str] = []  # text `new_text` gave out
        self._ready: list[str] = []  # text safe to give out, not asked for yet
        self._pending = ""  # the held-back tail (the whole remainder once stopped)
        # The tokenizer's own incremental decoder where it has one (one call per token in
        # place of two decodes), made at the first push. Once it has given text, its
        # window is prefix_offset / read_offset, so `_decode_new` can take over any time.
        self._step: Callable[[int], str | None] | None = None
        self._stream_tried = False

    @property
    def text(self) -> str:
        """All text so far (cut at a stop string once one is found)."""
        return "".join(self._returned) + "".join(self._ready) + self._pending

    @property
    def returned_text(self) -> str:
        return "".join(self._returned)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self) -> str | None:
        """The text the tokens after read_offset add, or None while it is incomplete."""
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        return after[len(before):]

    def _start_stream(self) -> Callable[[int], str | None] | None:
        step = getattr(self.tokenizer, "decode_stream", _no_stream)(self.skip_special_tokens)
        if step is not None:
            for token_id in self.ids[:self.read_offset]:  # the prompt's tail, as context
                step(token_id)
            if self.read_offset != len(self.ids) or self.prefix_offset != 0:
                return None  # tokens came before the first push: keep to _decode_new
        return step

    def push(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one token; returns the stop string if the text now contains one (the text is
        then cut at it), else None. `check_stop=False`: no stop string may end here yet."""
        if not self._stream_tried:
            self._stream_tried, self._step = True, self._start_stream()
        self.ids.append(token_id)
        new = None
        if self._step is not None:
            try:
                new = self._step(token_id)
            except Exception:  # the stream refuses a decode that rewrote earlier text
                self._step = None
        if self._step is None:
            new = self._decode_new()
        if new is None:
            return None
        self._pending += new
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        stop = self._find_stop() if check_stop else None
        if stop is None and len(self._pending) > self.hold_back:
            cut = len(self._pending) - self.hold_back
            self._ready.append(self._pending[:cut])
            self._pending = self._pending[cut:]
        return stop

    def append(self, token_id: int) -> None:
        """Add a token without decoding it (no stop strings to look for, no text wanted
        before the end): `flush` decodes everything pending in one call."""
        self.ids.append(token_id)

    def flush(self) -> None:
        """At the end: take whatever is pending, even an incomplete character."""
        if self.read_offset < len(self.ids):
            before = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self._pending += self._decode(self.ids[self.prefix_offset:])[len(before):]
            self.read_offset = len(self.ids)

    def _find_stop(self) -> str | None:
        """The pending tail holds the last `hold_back` characters before the new text, so
        every stop string that ends in the new text starts inside it."""
        if self._stop_pattern is None:
            return None
        match = self._stop_pattern.search(self._pending)
        if match is None:
            return None
        self._pending = self._pending[:match.end() if self.include_stop else match.start()]
        return match.group()

    def new_text(self, finished: bool) -> str:
        """Text not returned before that is safe to show now (all of it once finished)."""
        if finished:
            self._ready.append(self._pending)
            self._pending = ""
        delta = "".join(self._ready)
        self._ready.clear()
        if delta:
            self._returned.append(delta)
        return delta


class NoText:
    """The detokenizer of a sequence that asked for token ids only (detokenize=False):
    it has no text and no stop strings."""

    text = returned_text = ""

    def push(self, token_id: int, check_stop: bool = True) -> None:
        return None

    def append(self, token_id: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def new_text(self, finished: bool) -> str:
        return ""
