"""benchmarks/cpu_placement.py: the step loop's thread alone on one CPU, every other thread
(this process's and the grammar worker's) off that CPU's physical core."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

import benchmark_script
import pytest

from infer.engine.cpu_threads import core_siblings, cpu_list, cpus_off_core, thread_cpu

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")


def test_kernel_cpu_lists_are_read_as_the_kernel_writes_them():
    assert cpu_list("3\n") == {3}
    assert cpu_list("0-1,8-9\n") == {0, 1, 8, 9}
    assert cpu_list("2,5-7") == {2, 5, 6, 7}


def test_the_loop_gets_a_core_and_everything_else_stays_off_it():
    placement = benchmark_script.load("cpu_placement")
    cpus = sorted(os.sched_getaffinity(0))
    worker = subprocess.Popen([sys.executable, "-c", (
        "import threading, time\n"
        "for _ in range(2): threading.Thread(target=time.sleep, args=(60,), daemon=True)"
        ".start()\n"
        "time.sleep(60)")])
    saved = {tid: os.sched_getaffinity(tid) for tid in placement._threads(os.getpid())}
    result: dict = {}

    def loop() -> None:
        result["placement"] = placement.apart([worker.pid])
        result["mine"] = os.sched_getaffinity(0)

    try:
        deadline = time.monotonic() + 30
        while len(os.listdir(f"/proc/{worker.pid}/task")) < 3:  # its threads started
            assert time.monotonic() < deadline and worker.poll() is None
            time.sleep(0.01)
        thread = threading.Thread(target=loop)
        thread.start()
        thread.join()
        done = result["placement"]
        off_core = set(cpus) - placement.core_siblings(cpus[0])
        if not off_core:  # one core: nothing to move the rest to
            assert not done["pinned"] and "no CPU off" in done["why"]
            return
        assert done["pinned"] and result["mine"] == {cpus[0]}
        assert done["others"] == sorted(off_core)
        moved = placement.affinity(worker.pid)
        assert len(moved) == 3 and all(set(c) == off_core for c in moved.values())
        assert os.sched_getaffinity(0) == off_core  # this (pytest's) thread was moved too
    finally:
        worker.kill()
        worker.wait()
        for tid, cpus_before in saved.items():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, cpus_before)


def test_a_thread_is_found_on_one_of_its_cpus_and_a_core_is_left_out_whole():
    mine = os.sched_getaffinity(0)
    cpu = thread_cpu(threading.get_native_id())
    assert cpu in mine
    assert thread_cpu(2**22 + 12345) is None  # no such thread here
    off = cpus_off_core(cpu)
    assert off <= mine and not off & core_siblings(cpu) and off | core_siblings(cpu) >= mine
