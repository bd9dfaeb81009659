"""All-reduce latency between the GPUs of one host, at the sizes tensor parallelism sends:
NCCL (what `distributed/group.py` calls today) against torch's symmetric-memory
all-reduces (one-shot and two-shot: each rank reads its peers' buffers over NVLink; no
multicast, which this host keeps off), eager and inside a CUDA graph.

Why: at TP=2 on the Llama-3.1-8B shape each decode step runs 65 collectives (two 8 KB
all-reduces per layer, the embedding's, the LM head's gather) and about 1.3 ms of a
3.69 ms step is not the ranks' own reading (docs/performance.md, issue 18). If one small
all-reduce costs ~15 µs through NCCL and ~5 µs over peer memory, the group should use
the latter for small tensors.

For each method and size (bf16 rows of `--hidden` values: 1 row is a batch-1 decode step's
all-reduce, 8 and 32 larger batches, 2048 a prefill chunk), on every rank:
- correctness: each rank's input is random from its own seed; the result must equal the
  float32 sum of every rank's input (computed from an NCCL all-gather) within bf16
  rounding of the sum (|diff| <= 2^-7 x max |sum| + 1e-2);
- eager latency: median over `--reps` of one all-reduce (device events, rank 0);
- graph latency: `--graph-ops` all-reduces captured in one CUDA graph (as a decode step's
  are), replayed; median per all-reduce.
A method that fails to set up (no symmetric memory in this torch, no CUDA) is reported
with why, on every rank alike, and the others still run.

    torchrun-free: python benchmarks/all_reduce.py [--ranks 2]   # spawns the ranks itself
    python benchmarks/all_reduce.py --tiny                        # CPU (gloo): NCCL's row only

Writes benchmarks/results/all_reduce_<device>.json; rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

METHODS = ("nccl", "symm_one_shot", "symm_two_shot")


# -- the methods ------------------------------------------------------------------------------
class Method:
    """An all-reduce of a 1-D tensor into `out` (out of place), or why it cannot run."""

    def __init__(self, name: str, max_numel: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.name, self.why_not = name, None
        self.buffer: torch.Tensor | None = None
        try:
            if name != "nccl":
                self._setup_symm(max_numel, dtype, device)
        except Exception as exc:  # reported in the table
            self.why_not = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]

    def _setup_symm(self, max_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        if device.type != "cuda":
            raise RuntimeError("symmetric memory needs CUDA")
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.buffer = symm_mem.empty(max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.name == "nccl":
            out.copy_(x)
            dist.all_reduce(out)
            return
        assert self.buffer is not None
        staged = self.buffer[:x.numel()]
        staged.copy_(x)
        if self.name == "symm_one_shot":
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
            out.copy_(staged)


# -- one rank ---------------------------------------------------------------------------------
def agree(ok: bool) -> bool:
    """True on every rank only if `ok` on every rank."""
    t = torch.tensor([int(ok)], device=_device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def timed_ms(fn: Callable[[], None], reps: int) -> float:
    for _ in range(3):
        fn()
    if _device.type != "cuda":
        import time

        times = []
        for _ in range(reps):
            dist.barrier()
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(method: Method, rows: int, args, rank: int, world: int) -> dict[str, Any]:
    numel = rows * args.hidden
    dtype = torch.bfloat16 if _device.type == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(1000 * rows + rank)
    x = torch.randn(numel, generator=gen).to(_device, dtype)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    expected = torch.stack([p.float() for p in parts]).sum(0)
    out = torch.full_like(x, float("nan"))
    method(x, out)
    if _device.type == "cuda":
        torch.cuda.synchronize()
    diff = (out.float() - expected).abs().max().item()
    tol = 2.0 ** -7 * expected.abs().max().item() + 1e-2
    row: dict[str, Any] = dict(method=method.name, rows=rows, numel=numel,
                               bytes=numel * x.element_size(), KB=numel * x.element_size() / 1024,
                               max_abs_diff=diff,
                               correct=agree(diff <= tol))
    row["eager_us"] = timed_ms(lambda: method(x, out), args.reps) * 1e3
    if _device.type == "cuda" and not args.no_graphs:
        graph = torch.cuda.CUDAGraph()
        outs = [torch.empty_like(x) for _ in range(2)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(3):  # warm-up outside the capture, as the engine's graphs do
                method(x, outs[i % 2])
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        dist.barrier()
        with torch.cuda.graph(graph):
            for i in range(args.graph_ops):
                method(x, outs[i % 2])
        outs[0].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        diff = (outs[(args.graph_ops - 1) % 2].float() - expected).abs().max().item()
        row["graph_correct"] = agree(diff <= tol)
        row["graph_us"] = timed_ms(graph.replay, args.reps) * 1e3 / args.graph_ops
        del graph
    return row


_device = torch.device("cpu")


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    global _device
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        torch.cuda.set_device(rank)
        _device = torch.device("cuda", rank)
    kwargs = {"device_id": _device} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, **kwargs)
    rows_out: list[dict[str, Any]] = []
    max_numel = max(args.rows) * args.hidden
    dtype = torch.bfloat16 if cuda else torch.float32
    for name in args.methods:
        method = Method(name, max_numel, dtype, _device)
        ready = agree(method.why_not is None)
        if not ready:
            rows_out.append(dict(method=name, error=method.why_not or "failed on another rank"))
            continue
        for rows in args.rows:
            try:
                rows_out.append(measure(method, rows, args, rank, world))
            except Exception as exc:  # reported; the ranks may be out of step after it
                traceback.print_exc()
                rows_out.append(dict(method=name, rows=rows,
                                     error=f"{type(exc).__name__}: {exc}"[:300]))
                break
        del method
    if rank == 0:
        queue.put(rows_out)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096, help="values per row (8B: 4096)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256, 2048])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--graph-ops", type=int, default=65,
                        help="all-reduces per captured graph (an 8B TP decode step: 65)")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="CPU (gloo), small, NCCL row only")
    parser.add_argument("--suffix", default="")
    parser.add_argument("--results-dir", default=str(common.RESULTS))
    args = parser.parse_args()
    if args.tiny:
        args.hidden, args.rows, args.reps, args.methods = 64, [1, 8], 5, ["nccl"]
    elif torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"{torch.cuda.device_count()} GPU(s) visible, --ranks {args.ranks}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(rank_main, args=(args.ranks, free_port(), args, queue),
                       nprocs=args.ranks, start_method="spawn")
    rows = queue.get()
    out = common.write_results("all_reduce", args, dict(ranks=args.ranks, hidden=args.hidden,
                                                         rows=rows))
    print(f"wrote {out}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']}{' rows ' + str(r['rows']) if 'rows' in r else ''}: "
                  f"{r['error']}")
    common.print_table(
        f"all-reduce over {args.ranks} ranks on {common.device_name()} ('nccl': "
        f"torch.distributed's, {'gloo' if args.tiny else 'NCCL'} here; rows of "
        f"{args.hidden} values; graph: {args.graph_ops} in one CUDA graph, per all-reduce)",
        [r for r in rows if "error" not in r],
        [("method", "method", ""), ("rows", "rows", "d"), ("KB", "KB", ".1f"),
         ("eager us", "eager_us", ".1f"), ("graph us", "graph_us", ".1f"),
         ("correct", "correct", ""), ("graph correct", "graph_correct", ""),
         ("max |diff|", "max_abs_diff", ".2e")])


if __name__ == "__main__":
    main()
