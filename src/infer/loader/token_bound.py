"""A lower bound on a text's token count from its byte length, without tokenizing it.

For a lossless tokenizer the tokens partition the normalized text, so

    tokens >= normalized bytes / (bytes one token covers at most)
           >= input bytes / (shrink * longest vocabulary string in UTF-8 bytes)

where `shrink` bounds how much the normalizer can shorten the text. A server uses it to
refuse a prompt far over the context length before spending seconds tokenizing it. Where a
tokenizer's parts are not known to keep that bound (a normalizer that strips or lowercases,
a pre-tokenizer that drops whitespace, an unknown-token that swallows a whole run of
characters), there is no bound: `max_bytes_per_token` is None.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tokenizers import Tokenizer as Backend

# NFC / NFKC compose at most three code points into one (a Hangul syllable from its jamo):
# 9 bytes of UTF-8 become 3. Decomposition only lengthens text.
_NORMALIZATION_SHRINK = 3.0
_LOSSLESS_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation",
                            "UnicodeScripts"}


def max_bytes_per_token(backend: Backend) -> float | None:
    """Input bytes one token can stand for at most, or None when no bound holds."""
    shrink = _normalizer_shrink(_state(backend.normalizer))
    if shrink is None or not _lossless_pre_tokenizer(_state(backend.pre_tokenizer)):
        return None
    if not _no_fused_unknowns(backend.model):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    longest = max((len(token.encode("utf-8")) for token in vocab), default=1)
    return shrink * max(longest, 4)  # an unknown token still covers one code point


def _state(component: Any) -> dict[str, Any] | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_shrink(state: dict[str, Any] | None) -> float | None:
    if state is None:
        return 1.0
    kind = state["type"]
    if kind == "Sequence":
        factors = [_normalizer_shrink(s) for s in state["normalizers"]]
        return None if None in factors else math.prod(factors)
    if kind in ("NFC", "NFKC", "NFD", "NFKD"):
        return _NORMALIZATION_SHRINK
    if kind == "Prepend":
        return 1.0
    if kind == "Replace" and "String" in state["pattern"] and state["content"]:
        old, new = state["pattern"]["String"].encode(), state["content"].encode()
        return max(1.0, len(old) / len(new))
    return None


def _lossless_pre_tokenizer(state: dict[str, Any] | None) -> bool:
    if state is None:
        return True
    if state["type"] == "Sequence":
        return all(_lossless_pre_tokenizer(s) for s in state["pretokenizers"])
    return state["type"] in _LOSSLESS_PRE_TOKENIZERS and state.get("behavior") != "Removed"


def _no_fused_unknowns(model: Any) -> bool:
    kind = type(model).__name__
    if kind == "BPE":  # its attributes: the state would serialize the whole vocabulary
        return bool(model.byte_fallback or not model.fuse_unk)
    if kind == "Unigram":  # an unknown run is one token unless it falls back to bytes
        return bool(_state(model).get("byte_fallback"))
    return False  # WordPiece / WordLevel: one unknown token for a whole word
