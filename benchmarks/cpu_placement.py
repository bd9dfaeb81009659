"""Where the step loop and the grammar workers run on the host's CPUs (Linux).

`apart(worker_pids)` puts the calling thread (the step loop) on one CPU and every other
thread of this process and of the workers on the CPUs outside that CPU's physical core
(its hyperthread siblings excluded), so that no spinning or filling thread shares the
loop's core. A benchmark runs with and without it to see what sharing costs.
"""

from __future__ import annotations

import contextlib
import os
import threading

from infer.engine.cpu_threads import core_siblings, cpus_off_core


def threads_per_core() -> int:
    return max(len(core_siblings(cpu)) for cpu in os.sched_getaffinity(0))


def _threads(pid: int) -> list[int]:
    return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]


def apart(worker_pids: list[int]) -> dict:
    """Pin as the module docstring says (`worker_pids`: the grammar workers'); returns what
    was done, or why not."""
    cpus = sorted(os.sched_getaffinity(0))
    loop_cpu = cpus[0]
    rest = cpus_off_core(loop_cpu)
    if not rest:
        return {"pinned": False, "why": f"no CPU off CPU {loop_cpu}'s core", "cpus": cpus}
    loop = threading.get_native_id()
    os.sched_setaffinity(loop, {loop_cpu})
    others = [tid for tid in _threads(os.getpid()) if tid != loop]
    others += [tid for pid in worker_pids for tid in _threads(pid)]
    for tid in others:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, rest)
    return {"pinned": True, "loop_cpu": loop_cpu, "others": sorted(rest),
            "threads_per_core": threads_per_core(), "threads_moved": len(others)}


def affinity(pid: int) -> dict[int, list[int]]:
    """Each thread of `pid` and the CPUs it may run on."""
    return {tid: sorted(os.sched_getaffinity(tid)) for tid in _threads(pid)}
