"""Timers around named methods of the engine, for the benchmarks that say where a step's
host time goes (`host_overhead.py`, `structured_output.py`, `loop_phases.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wrap_timed(holder: Any, name: str, record: Callable[[float, tuple], None]) -> None:
    """`holder.name` (a method on a class or an instance, or a module's function) replaced
    by a call that hands its seconds and its positional arguments to `record`."""
    fn = getattr(holder, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record(time.perf_counter() - start, args)

    setattr(holder, name, timed)
