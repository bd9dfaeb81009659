"""A progress bar while the model loads (as vLLM's "Loading safetensors checkpoint
shards"), on stderr and only when stderr is a terminal: a log gets the start-up lines
instead."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def loading_bar(items: Iterable[T], total: int, desc: str, unit: str = "tensor"
                ) -> Iterator[T]:
    from tqdm import tqdm

    # disable=None: off when the output is not a TTY
    yield from tqdm(items, total=total, desc=desc, unit=unit, disable=None,
                    dynamic_ncols=True)
