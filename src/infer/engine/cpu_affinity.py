"""A physical CPU core of its own for the engine core's process (`infer serve` on a GPU).

The core's step loop is serial host work the GPU waits on at large batches; the API
processes and their clients, busy streaming, would otherwise take turns on its CPU (or on
the other hyperthread of its core), and its steps slow down with them. With `--pin-core`
the core process runs on one physical core (every hyperthread of it the server may use)
and the server's other processes on the rest. Linux only; elsewhere nothing is pinned.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_SYS_CPU = Path("/sys/devices/system/cpu")


def allowed_cpus() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()


def _siblings(cpu: int) -> set[int]:
    """The logical CPUs of `cpu`'s physical core (itself alone when the kernel won't say)."""
    try:
        text = (_SYS_CPU / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
    except OSError:
        return {cpu}
    return parse_cpu_list(text) or {cpu}


def parse_cpu_list(text: str) -> set[int]:
    """The kernel's CPU list format: "0-3,8,10-11"."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def physical_cores(cpus: set[int]) -> list[set[int]]:
    """`cpus` grouped by physical core, each group within `cpus`, in CPU order."""
    groups: list[set[int]] = []
    for cpu in sorted(cpus):
        if not any(cpu in group for group in groups):
            groups.append(_siblings(cpu) & cpus | {cpu})
    return groups


def split_for_core(cpus: set[int], min_cores: int = 4) -> tuple[set[int], set[int]] | None:
    """(the core process's CPUs, everyone else's): the last physical core of `cpus` for the
    core, the others for the rest; None with fewer than `min_cores` physical cores (too few
    to give one away)."""
    cores = physical_cores(cpus)
    if len(cores) < min_cores:
        return None
    mine = cores[-1]
    return mine, cpus - mine


def pin_this_process(cpus: set[int]) -> None:
    """Every thread of this process on `cpus` (threads started later inherit it from the
    thread that starts them)."""
    tasks = Path("/proc/self/task")
    tids = [int(t) for t in os.listdir(tasks)] if tasks.is_dir() else [0]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)
