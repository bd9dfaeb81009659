"""A child process's exit, seen from a thread that does not own its reaping.

`Process.exitcode` and `Process.join` reap the child (waitpid). When two threads of a
process do that for the same child (a watcher that reports a death, and the code that
stops the child), the second waitpid fails with ECHILD, which multiprocessing reports as
still running: exit code None after a join that returned at once. So a watcher waits on
the child's sentinel and peeks at its status without reaping; the owner joins.
"""

from __future__ import annotations

import multiprocessing.connection
import os
from multiprocessing.process import BaseProcess


def wait_exited(process: BaseProcess, timeout: float | None = None) -> bool:
    """Whether `process` has exited within `timeout` seconds; it is left unreaped."""
    return bool(multiprocessing.connection.wait([process.sentinel], timeout))


def exit_code_unreaped(process: BaseProcess) -> int | None:
    """An exited child's code (minus the signal that killed it), left unreaped; None while
    it runs."""
    if not wait_exited(process, 0):
        return None
    try:  # blocks, briefly: the sentinel closes before the child is a zombie
        status = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # reaped meanwhile, by the thread that joined it
        return process.exitcode
    return status.si_status if status.si_code == os.CLD_EXITED else -status.si_status
