"""Test helper: transformers reading a real GGUF file (the references of the GGUF tests),
without the time gguf's Python reader wastes on a large file.

transformers parses a file with gguf's GGUFReader, which slices an np.memmap item by item:
every slice runs memmap's Python hooks, ~20 s for Gemma 3's 262k-token vocabulary, and a
model is parsed twice (its config, then its weights). Over a plain ndarray view of the
same read-only mapping the reader reads the same bytes in ~4 s, and one parse serves
both. Mapping the tensor names, transformers builds gguf's name map for the whole model
once per module (~400 times for SmolLM2, ~10 s): one map serves them all.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest


@contextmanager
def fast_gguf_reads() -> Iterator[None]:
    """While open, gguf's reader (as transformers calls it: `gguf.GGUFReader(path)`)
    parses each file once, over a plain view of its mapping, and its name map is built
    once per architecture and depth."""
    import gguf

    class PlainArrayReader(gguf.GGUFReader):
        # GGUFReader.__init__ assigns its np.memmap to `data`, then parses through it.
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)

    @functools.cache
    def reader(path: str, mode: str) -> Any:
        return PlainArrayReader(path, mode)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader",
                      lambda path, mode="r": reader(os.fspath(path), mode))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield
