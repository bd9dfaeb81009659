"""Run a function on every rank of a small gloo world on this CPU (tensor-parallel tests).

`run_ranks(fn, size, *args)` spawns `size` processes; each joins the world, calls
`fn(group, *args)` and sends back what it returns (picklable; tensors fine). A rank that
raises fails the call with its traceback; a world that does not finish in `timeout` is
killed.
"""

from __future__ import annotations

import io
import multiprocessing
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable, rank: int, size: int, init_method: str, args: tuple,
               results: Any) -> None:
    from infer.distributed.group import init_group

    torch.set_num_threads(1)
    try:
        group = init_group(rank, size, init_method, torch.device("cpu"), timeout_s=120)
        value = fn(group, *args)
        # As bytes: a tensor put on a queue as is lives in shared memory that goes with
        # this process.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """`fn(group, *args)` on ranks 0..size-1; their results in rank order."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(fn, r, size, init_method, args, results),
                         daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(size):
            rank, ok, value = results.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(size)]
