"""All-reduce latency between the GPUs of one host, at the sizes tensor parallelism sends:
NCCL against the engine's custom all-reduce (`peer`: `distributed/peer_all_reduce.py`,
`EngineConfig.custom_all_reduce`) and torch's symmetric-memory all-reduces called
directly (one-shot and two-shot: each rank reads its peers' buffers over NVLink; no
multicast, which this host keeps off), eager and inside a CUDA graph.

Why: at TP=2 on the Llama-3.1-8B shape each decode step runs 65 collectives (two 8 KB
all-reduces per layer, the embedding's, the LM head's gather) and about 1.3 ms of a
3.69 ms step is not the ranks' own reading (docs/performance.md, issue 18). If one small
all-reduce costs ~15 µs through NCCL and ~5 µs over peer memory, the group should use
the latter for small tensors.

For each method and size (bf16 rows of `--hidden` values: 1 row is a batch-1 decode step's
all-reduce, 8 and 32 larger batches, 2048 a prefill chunk), on every rank:
- correctness: three inputs per rank, random from its own seeds; each result must equal
  the float32 sum of every rank's input (computed from an NCCL all-gather) within bf16
  rounding of the sum (|diff| <= 2^-7 x max |sum| + 1e-2); in the graph the all-reduces
  cycle through the three, each into a tensor of its own, so one that read a staging
  buffer a later all-reduce had already overwritten would be caught;
- eager latency: median over `--reps` of one all-reduce (device events, rank 0);
- graph latency: `--graph-ops` all-reduces captured in one CUDA graph (as a decode step's
  are), replayed; median per all-reduce.
A method that fails to set up (no symmetric memory in this torch, no CUDA) is reported
with why, on every rank alike, and the others still run.

    torchrun-free: python benchmarks/all_reduce.py [--ranks 2]   # spawns the ranks itself
    python benchmarks/all_reduce.py --tiny                        # CPU (gloo): NCCL and
                                                                  # peer's refusal

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

METHODS = ("nccl", "peer", "symm_one_shot", "symm_two_shot")


# -- the methods ------------------------------------------------------------------------------
class Method:
    """An in-place all-reduce of a 1-D tensor, or why it cannot run. `peer` is the engine's
    own (`infer.distributed.peer_all_reduce`, `EngineConfig.custom_all_reduce`); the
    `symm_*` rows call torch's kernels directly, staging through a symmetric buffer."""

    def __init__(self, name: str, max_numel: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.name, self.why_not = name, None
        self.buffer: torch.Tensor | None = None
        try:
            if name == "peer":
                self._setup_peer(max_numel * torch.finfo(dtype).bits // 8, device)
            elif name != "nccl":
                self._setup_symm(max_numel, dtype, device)
        except Exception as exc:  # reported in the table
            self.why_not = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]

    def _setup_peer(self, max_bytes: int, device: torch.device) -> None:
        from infer.distributed.peer_all_reduce import PeerAllReduce

        # A cpu group as the engine has one (init_group): where the ranks agree.
        self.cpu_group = dist.new_group(backend="gloo")
        self.peer = PeerAllReduce.create(dist.group.WORLD, self.cpu_group, device, max_bytes)
        if self.peer is None:
            raise RuntimeError("PeerAllReduce.create declined (see its log line)")

    def _setup_symm(self, max_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        if device.type != "cuda":
            raise RuntimeError("symmetric memory needs CUDA")
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.buffer = symm_mem.empty(max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def __call__(self, t: torch.Tensor) -> None:
        if self.name == "nccl":
            dist.all_reduce(t)
            return
        if self.name == "peer":
            assert self.peer(t), "the engine's all-reduce declined a tensor it should take"
            return
        assert self.buffer is not None
        staged = self.buffer[:t.numel()]
        staged.copy_(t)
        if self.name == "symm_one_shot":
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, t)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
            t.copy_(staged)


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
    """Three different inputs per rank, each checked against the float32 sum of every
    rank's; the graph's all-reduces cycle through them, each into its own tensor, so an
    all-reduce that read a buffer a later one had overwritten would show."""
    numel = rows * args.hidden
    dtype = torch.bfloat16 if _device.type == "cuda" else torch.float32
    xs, expected = [], []
    for k in range(3):
        gen = torch.Generator(device="cpu").manual_seed(1000 * rows + 100 * k + rank)
        x = torch.randn(numel, generator=gen).to(_device, dtype)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        xs.append(x)
        expected.append(torch.stack([p.float() for p in parts]).sum(0))
    tol = [2.0 ** -7 * e.abs().max().item() + 1e-2 for e in expected]

    def worst(ts: list[torch.Tensor]) -> tuple[float, bool]:
        diffs = [(t.float() - expected[i % 3]).abs().max().item() for i, t in enumerate(ts)]
        return max(diffs), all(d <= tol[i % 3] for i, d in enumerate(diffs))

    ts = [x.clone() for x in xs]
    for t in ts:
        method(t)
    if _device.type == "cuda":
        torch.cuda.synchronize()
    diff, ok = worst(ts)
    row: dict[str, Any] = dict(method=method.name, rows=rows, numel=numel,
                               bytes=numel * xs[0].element_size(),
                               KB=numel * xs[0].element_size() / 1024,
                               max_abs_diff=diff, correct=agree(ok))
    # In place, again and again: the values double each time (bf16 holds 2^100 easily).
    t = xs[0].clone()
    row["eager_us"] = timed_ms(lambda: method(t), args.reps) * 1e3
    if _device.type == "cuda" and not args.no_graphs:
        graph = torch.cuda.CUDAGraph()
        gts = [xs[i % 3].clone() for i in range(args.graph_ops)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(3):  # warm-up outside the capture, as the engine's graphs do
                method(gts[i])
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        dist.barrier()
        with torch.cuda.graph(graph):
            for g in gts:
                method(g)
        for i, g in enumerate(gts):
            g.copy_(xs[i % 3])
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        _, ok = worst(gts)
        row["graph_correct"] = agree(ok)
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


def run_ranks(rank_main: Callable, args: argparse.Namespace) -> Any:
    """`rank_main(rank, world, port, args, queue)` in `args.ranks` spawned processes, NVLink
    multicast off (this host keeps it off); returns what rank 0 puts on the queue."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(rank_main, args=(args.ranks, free_port(), args, queue),
                       nprocs=args.ranks, start_method="spawn")
    return queue.get()


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
        args.hidden, args.rows, args.reps, args.methods = 64, [1, 8], 5, ["nccl", "peer"]
    elif torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"{torch.cuda.device_count()} GPU(s) visible, --ranks {args.ranks}")
    rows = run_ranks(rank_main, args)
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
