"""How many threads the model's kernels use on a CPU.

Measured with the embedded SmolLM2 on the 2-core CI machine (`.ab/threads.py`, greedy
decode): alone, 1 thread gave 16.1 tok/s at batch 1 and 67 at batch 8, 2 threads 13.5 and
72; beside one busy process, 1 thread gave 12.8 and 58, 2 threads collapsed to 4.7 and 23.5
(the threads of a parallel region wait for the slowest, and one of them shares its core).
So by default a core is left to everything else (a server's API process, its tokenizer
threads, other programs): one thread per usable core less one, at least one.
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
