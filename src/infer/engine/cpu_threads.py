"""How many threads the model's kernels use on a CPU.

On the 2-core CPU machine (`benchmarks/cpu_threads.py`, the embedded SmolLM2) a second
thread gained 7-14 % at batch 8 with nothing else running, lost 5-16 % at batch 1, and
beside one busy process fell 3-3.7x (the threads of a parallel region wait for the slowest,
and one of them shares its core). So by default a core is left to everything else (a
server's API process, its tokenizer threads, other programs): one thread per usable core
less one, at least one.
"""

from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity, which containers narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_cpu_threads() -> int:
    return max(1, usable_cores() - 1)


def set_cpu_threads(requested: int | None) -> int:
    """Set torch's intra-op threads to `requested`, or the default; the number set."""
    threads = requested if requested is not None else default_cpu_threads()
    torch.set_num_threads(threads)
    return threads
