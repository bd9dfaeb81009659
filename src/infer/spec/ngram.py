"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence
of the sequence's last n tokens, for the longest n in [min_n, max_n] that occurs. No
weights: it pays where the output copies from the prompt or from itself (code edits,
summaries, retrieval answers).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, min_n: int = 1,
                  max_n: int = 4) -> list[int]:
    """Up to `k` draft tokens for the sequence `tokens` (prompt and output so far); empty
    when no suffix of `min_n`..`max_n` tokens occurred before."""
    if k < 1 or not 1 <= min_n <= max_n:
        raise ValueError(f"propose_ngram: need k >= 1 and 1 <= min_n <= max_n, got k={k}, "
                         f"min_n={min_n}, max_n={max_n}")
    ids = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        # windows that start before the suffix itself: tokens[i:i + n], i + n < len
        windows = sliding_window_view(ids[:-1], n)
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return ids[start:start + k].tolist()
    return []
