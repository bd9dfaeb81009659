"""The fused all-reduce + residual add + RMSNorm (`kernels/all_reduce_norm.py`,
`EngineConfig.fuse_all_reduce_norm`) between the GPUs of one host: checked bit for bit
against NCCL's all-reduce followed by the unfused add + RMSNorm kernel, and timed against
it, at the rows a decode step sends (bf16 rows of `--hidden`).

Each case is a chain of `--ops` calls (an 8B decode step makes 65 all-reduces, 64 of them
before an add + norm), each on its own partials (random, from each rank's own seed) and all
on one residual stream, updated in place by each call, so that one wrong call anywhere
shows in the final residual. On every rank, for every row count:
- `eager`: the chain launched op by op, outputs and final residual equal to NCCL's chain;
- `skewed`: the same with rank 1 sleeping on its GPU a different time before each call
  (`torch.cuda._sleep`), so that the ranks arrive at each call out of step, as in an engine
  where one rank's GEMVs run late;
- `graph`: the chain captured in one CUDA graph, replayed `--replays` times, each replay
  from the same inputs and checked (the call counts, and so the tags, carry over from
  replay to replay, as in the engine);
- latency per call: both chains captured in graphs, median replay over `--reps` / `--ops`.
Dependent launch as the engine sets it (on for compute capability >= 9; `--no-pdl`).
`--gemma`: Gemma 3's form (a norm of the sum alone, `x * (1 + w)`); the residual then
passes through, so only each call's output is checked.

    python benchmarks/all_reduce_norm.py [--ranks 2] [--suffix _x2]

Writes benchmarks/results/all_reduce_norm_<device>.json; rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import all_reduce  # agree, timed_ms, run_ranks
import common

EPS = 1e-5


def chain_inputs(rows: int, args, rank: int) -> tuple[list[torch.Tensor], torch.Tensor,
                                                      torch.Tensor]:
    device = all_reduce._device
    gen = torch.Generator().manual_seed(10_000 * rows + rank)
    partials = [torch.randn(rows, args.hidden, generator=gen).to(device, torch.bfloat16)
                for _ in range(args.ops)]
    shared = torch.Generator().manual_seed(rows)  # the same residual and weight everywhere
    residual = (torch.randn(rows, args.hidden, generator=shared) * 4).to(device, torch.bfloat16)
    weight = (torch.randn(args.hidden, generator=shared) * 0.2 + 1).to(device, torch.bfloat16)
    return partials, residual, weight


def run_chain(step: Callable, partials: list[torch.Tensor], residual: torch.Tensor,
              weight: torch.Tensor, skew: list[int] | None = None) -> list[torch.Tensor]:
    """The outputs of every call, then the final residual (updated in place)."""
    outs = []
    for k, x in enumerate(partials):
        if skew is not None:
            torch.cuda._sleep(skew[k])
        out, residual = step(x.clone(), residual, weight)
        outs.append(out)
    return [*outs, residual]


def measure(fused, rows: int, args, rank: int) -> dict[str, Any]:
    from infer.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

    def unfused(x, residual, weight):
        dist.all_reduce(x)
        if args.gemma:  # the residual passes through untouched
            return rmsnorm(x, weight, EPS, 1.0), residual
        return fused_add_rmsnorm(x, residual, weight, EPS)

    def fused_step(x, residual, weight):  # also where the engine would decline the rows
        if args.gemma:
            return fused(x, None, weight, EPS, 1.0), residual
        return fused(x, residual, weight, EPS, 0.0)

    partials, residual0, weight = chain_inputs(rows, args, rank)
    want = run_chain(unfused, partials, residual0.clone(), weight)
    torch.cuda.synchronize()

    def same(got: list[torch.Tensor]) -> bool:
        torch.cuda.synchronize()
        return all(torch.equal(a, b) for a, b in zip(got, want))

    row: dict[str, Any] = dict(rows=rows, KB=rows * args.hidden * 2 / 1024,
                               engine_takes=fused.takes(partials[0], residual0))
    row["eager_equal"] = all_reduce.agree(same(run_chain(fused_step, partials,
                                                         residual0.clone(), weight)))
    gen = torch.Generator().manual_seed(rows)
    skew = [int(c) for c in torch.randint(0, 20_000, (args.ops,), generator=gen)] \
        if rank == 1 else None
    row["skewed_equal"] = all_reduce.agree(same(run_chain(fused_step, partials,
                                                          residual0.clone(), weight, skew)))

    def captured(step: Callable, skew: list[int] | None = None
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, list[torch.Tensor]]:
        residual = residual0.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run_chain(step, partials[:2], residual0.clone(), weight)  # warm-up, as the engine
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = run_chain(step, partials, residual, weight, skew)
        return graph, residual, outs

    graph, residual, outs = captured(fused_step, skew)
    ok = True
    for _ in range(args.replays):
        residual.copy_(residual0)
        dist.barrier()
        graph.replay()
        ok &= same(outs)
    row["graph_equal"] = all_reduce.agree(ok)
    del graph
    for name, step in (("nccl_then_norm", unfused), ("fused", fused_step)):
        graph, residual, _ = captured(step)
        row[f"{name}_us"] = all_reduce.timed_ms(graph.replay, args.reps) * 1e3 / args.ops
        del graph
    row["speedup"] = row["nccl_then_norm_us"] / row["fused_us"]
    return row


def rank_main(rank: int, world: int, port: int, args, queue) -> None:
    from infer.distributed.peer_add_rmsnorm import PeerAddRMSNorm
    from infer.kernels import dependent_launch

    torch.cuda.set_device(rank)
    device = all_reduce._device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    dependent_launch.set_enabled(not args.no_pdl and dependent_launch.supported(device))
    cpu_group = dist.new_group(backend="gloo")
    fused = PeerAddRMSNorm.create(dist.group.WORLD, cpu_group, device)
    rows_out: list[dict[str, Any]] = []
    if fused is None:
        rows_out.append(dict(error="PeerAddRMSNorm.create declined (see its log line)"))
    else:
        for rows in args.rows:
            try:
                rows_out.append(measure(fused, rows, args, rank))
            except Exception as exc:  # reported; the ranks may be out of step after it
                traceback.print_exc()
                rows_out.append(dict(rows=rows, error=f"{type(exc).__name__}: {exc}"[:300]))
                break
    if rank == 0:
        queue.put(dict(rows=rows_out, pdl=dependent_launch.enabled()))
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096, help="values per row (8B: 4096)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24, 32, 128])
    parser.add_argument("--ops", type=int, default=64, help="calls per chain (8B step: 64)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--no-pdl", action="store_true")
    parser.add_argument("--gemma", action="store_true",
                        help="Gemma 3's sandwich norms: no residual add, x * (1 + w)")
    parser.add_argument("--suffix", default="")
    parser.add_argument("--results-dir", default=str(common.RESULTS))
    parser.set_defaults(tiny=False)  # common.results_path reads it
    args = parser.parse_args()
    if torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"{torch.cuda.device_count()} GPU(s) visible, --ranks {args.ranks}")
    result = all_reduce.run_ranks(rank_main, args)
    out = common.write_results("all_reduce_norm", args, dict(ranks=args.ranks,
                                                             hidden=args.hidden, **result))
    print(f"wrote {out}")
    for r in result["rows"]:
        if "error" in r:
            print(f"rows {r.get('rows')}: {r['error']}")
    common.print_table(
        f"all-reduce + {'' if args.gemma else 'add + '}RMSNorm over {args.ranks} ranks on "
        f"{common.device_name()}, "
        f"rows of {args.hidden} bf16, {args.ops} calls a graph, per call; dependent launch "
        f"{'on' if result['pdl'] else 'off'}",
        [r for r in result["rows"] if "error" not in r],
        [("rows", "rows", "d"), ("KB", "KB", ".1f"),
         ("NCCL + norm us", "nccl_then_norm_us", ".1f"), ("fused us", "fused_us", ".1f"),
         ("speed-up", "speedup", ".2f"), ("engine fuses", "engine_takes", ""),
         ("eager =", "eager_equal", ""),
         ("skewed =", "skewed_equal", ""), ("graph =", "graph_equal", "")])


if __name__ == "__main__":
    main()
