"""Where the step loop and the grammar worker run on the host's CPUs (Linux).

`apart(worker_pid)` puts the calling thread (the step loop) on one CPU and every other
thread of this process and of the worker on the CPUs outside that CPU's physical core
(its hyperthread siblings excluded), so that no spinning or filling thread shares the
loop's core. A benchmark runs with and without it to see what sharing costs.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


def core_siblings(cpu: int) -> set[int]:
    """The CPUs on `cpu`'s physical core, itself included (itself alone where the kernel
    does not say)."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    return cpu_list(path.read_text()) if path.exists() else {cpu}


def cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel CPU list such as `0-1,8-9`."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def threads_per_core() -> int:
    return max(len(core_siblings(cpu)) for cpu in os.sched_getaffinity(0))


def _threads(pid: int) -> list[int]:
    return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]


def apart(worker_pid: int) -> dict:
    """Pin as the module docstring says; returns what was done, or why not."""
    cpus = sorted(os.sched_getaffinity(0))
    loop_cpu = cpus[0]
    rest = set(cpus) - core_siblings(loop_cpu)
    if not rest:
        return {"pinned": False, "why": f"no CPU off CPU {loop_cpu}'s core", "cpus": cpus}
    loop = threading.get_native_id()
    os.sched_setaffinity(loop, {loop_cpu})
    others = [tid for tid in _threads(os.getpid()) if tid != loop] + _threads(worker_pid)
    for tid in others:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, rest)
    return {"pinned": True, "loop_cpu": loop_cpu, "others": sorted(rest),
            "threads_per_core": threads_per_core(), "threads_moved": len(others)}


def affinity(pid: int) -> dict[int, list[int]]:
    """Each thread of `pid` and the CPUs it may run on."""
    return {tid: sorted(os.sched_getaffinity(tid)) for tid in _threads(pid)}
