"""The token-count lower bound from a text's byte length: never above the real count, on
the real tokenizers and on adversarial texts; no bound where a tokenizer part can shrink
text without limit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_tokenizers import ours
from tokenizers import Tokenizer as Backend
from tokenizers import models, normalizers, pre_tokenizers

from infer.loader.token_bound import max_bytes_per_token


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=300) | st.text(alphabet=" \t\n.aé\u0301", max_size=300))
def test_bound_never_exceeds_the_real_count(name, text):
    tok = ours(name)
    assert tok.min_token_count(text) <= len(tok.encode(text))


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_bound_holds_for_the_longest_tokens_repeated(name):
    """The text that packs the most bytes into each token."""
    tok = ours(name)
    vocab = tok.backend.get_vocab()
    longest = max(vocab, key=lambda t: len(tok.decode([vocab[t]], False).encode()))
    text = tok.decode([vocab[longest]], False) * 2000
    count = len(tok.encode(text, add_special_tokens=False))
    assert 0 < tok.min_token_count(text) <= count


def _backend(normalizer=None, pre_tokenizer=None, model=None) -> Backend:
    model = model or models.BPE(vocab={"a": 0, "b": 1, "ab": 2, "<unk>": 3},
                                merges=[("a", "b")], unk_token="<unk>")
    backend = Backend(model)
    if normalizer is not None:
        backend.normalizer = normalizer
    if pre_tokenizer is not None:
        backend.pre_tokenizer = pre_tokenizer
    return backend


@pytest.mark.parametrize(("backend", "expected"), [
    (_backend(), 5 * 1.0),  # "<unk>" is the longest string: 5 bytes
    (_backend(normalizers.NFC()), 5 * 3.0),
    (_backend(normalizers.Sequence([normalizers.NFKC(), normalizers.Replace("  ", " ")])),
     5 * 3.0 * 2),
    (_backend(normalizers.Replace(" ", "\u2581")), 5.0),  # lengthens text
    (_backend(normalizers.Lowercase()), None),
    (_backend(normalizers.Strip()), None),
    (_backend(normalizers.Replace(" ", "")), None),
    (_backend(pre_tokenizer=pre_tokenizers.Whitespace()), None),  # drops whitespace
    (_backend(pre_tokenizer=pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(), pre_tokenizers.ByteLevel()])), 5.0),
    (_backend(model=models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>",
                               fuse_unk=True)), None),  # a run of unknowns is one token
    (_backend(model=models.WordLevel(vocab={"a": 0, "<unk>": 1}, unk_token="<unk>")), None),
])
def test_which_tokenizer_parts_allow_a_bound(backend, expected):
    assert max_bytes_per_token(backend) == expected


def test_unknown_runs_fused_into_one_token_would_break_a_bound():
    """Why fuse_unk has no bound: 3,000 bytes of unknown characters are one token."""
    backend = _backend(model=models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[],
                                        unk_token="<unk>", fuse_unk=True))
    assert len(backend.encode("\u00e9" * 1500).ids) == 1
