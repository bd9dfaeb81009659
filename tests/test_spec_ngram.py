"""N-gram (prompt lookup) proposals, on hand-written token sequences."""

from __future__ import annotations

import pytest

from infer.spec.ngram import propose_ngram


def test_the_longest_suffix_that_occurred_before_picks_the_continuation():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # suffix (6, 7) occurred at 1 and 6; the latest (6) is followed by 2, 6, 7
    assert propose_ngram(tokens, k=3, min_n=1, max_n=2) == [2, 6, 7]
    # with n up to 3, (2, 6, 7) never occurred before: (6, 7) still decides
    assert propose_ngram(tokens, k=2, min_n=1, max_n=3) == [2, 6]
    # a longer match wins over a later shorter one: (8, 9, 1) vs (1)
    assert propose_ngram([8, 9, 1, 4, 4, 1, 3, 8, 9, 1], k=2, max_n=3) == [4, 4]


def test_proposals_stop_at_the_end_of_the_sequence():
    assert propose_ngram([1, 2, 3, 1, 2], k=5, max_n=2) == [3, 1, 2]


def test_no_match_no_proposal():
    assert propose_ngram([1, 2, 3, 4], k=3) == []
    assert propose_ngram([7], k=3) == []
    assert propose_ngram([], k=3) == []
    assert propose_ngram([1, 2, 1, 3], k=3, min_n=2) == []  # only a 1-gram recurs


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="k >= 1"):
        propose_ngram([1, 2, 1], k=0)
    with pytest.raises(ValueError, match="min_n"):
        propose_ngram([1, 2, 1], k=2, min_n=3, max_n=2)
