"""A child's exit seen by a watcher thread without reaping it (process_exit.py)."""

from __future__ import annotations

import multiprocessing
import os
import signal

from infer.process_exit import exit_code_unreaped, wait_exited


def test_the_exit_code_is_read_and_the_child_left_for_its_owner_to_reap():
    process = multiprocessing.get_context("spawn").Process(target=os._exit, args=(3,))
    process.start()
    assert wait_exited(process, 30)
    assert exit_code_unreaped(process) == 3
    assert exit_code_unreaped(process) == 3  # still there to be read again
    pid, status = os.waitpid(process.pid, os.WNOHANG)  # the owner's reap finds it
    assert pid == process.pid and os.waitstatus_to_exitcode(status) == 3


def test_a_killed_child_reads_minus_its_signal_and_a_running_one_none():
    process = multiprocessing.get_context("spawn").Process(target=signal.pause)
    process.start()
    try:
        assert not wait_exited(process, 0.2) and exit_code_unreaped(process) is None
    finally:
        process.kill()
    assert wait_exited(process, 30) and exit_code_unreaped(process) == -signal.SIGKILL
    process.join()
    assert process.exitcode == -signal.SIGKILL
    assert exit_code_unreaped(process) == -signal.SIGKILL  # reaped: multiprocessing's record
