"""How many threads the model's kernels use on a CPU.

On the 2-core CPU machine (`benchmarks/cpu_threads.py`, the embedded SmolLM2) a second
thread gained 7-14 % at batch 8 with nothing else running, lost 5-16 % at batch 1, and
beside one busy process fell 3-3.7x (the threads of a parallel region wait for the slowest,
and one of them shares its core). So by default a core is left to everything else (a
server's API process, its tokenizer threads, other programs): one thread per usable core
less one, at least one.

Also where threads run (Linux): the CPUs of a physical core, the CPU a thread last ran on,
so that the grammar worker can be kept off the step loop's core (`grammar_worker_apart`).
"""

from __future__ import annotations

import os
from pathlib import Path

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


def cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel CPU list such as `0-1,8-9`."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def core_siblings(cpu: int) -> set[int]:
    """The CPUs on `cpu`'s physical core, itself included (itself alone where the kernel
    does not say)."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    return cpu_list(path.read_text()) if path.exists() else {cpu}


def thread_cpu(thread_id: int) -> int | None:
    """The CPU a thread of this process (its native id) last ran on; None where Linux's
    /proc does not say."""
    try:
        stat = Path(f"/proc/self/task/{thread_id}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[36])  # field 39, `processor`


def cpus_off_core(cpu: int) -> set[int]:
    """This process's CPUs outside `cpu`'s physical core."""
    return set(os.sched_getaffinity(0)) - core_siblings(cpu)
