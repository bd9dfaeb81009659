"""The Gluon wgmma kernels for 8-bit weights on the Llama-3.1-8B projection shapes at
decode-sized rows: `kernels/w8_wgmma.py` (8-bit by 8-bit x) and, for FP8,
`kernels/fp8_wgmma.py` (FP8 weights by bfloat16 x, weight-only; its K splits timed too,
and on gate_up its gated launch against the plain one and the activation's launch),
beside what the engine runs there today: bf16 `F.linear` (cuBLAS), at one or two rows the
GEMV (`gemv.py`), FP8 weights by FP8 x through `rows_mma` (`fp8_mma_rows`) and
`torch._scaled_mm`, INT8 weights by x's int8 halves through `int8_x16_matmul`. x is
quantized once, outside the timed calls, for every 8-bit by 8-bit path alike (the engine
quantizes once per layer input). w8_wgmma's default launch and a grid of launches (channels
a program, ring stages, K slices) are timed; each case against the reference path's output
(largest difference over the output's scale; fp8_wgmma's against float32 of the same
weights and x).

Timing as quantized_gemv.py: each case captured in a CUDA graph whose calls take copies of
the weight in turn (past the L2 cache), the median replay per call; % copy = the weight's
bytes (and x's, y's) over the time, against the copy rate measured in the same run.

    python benchmarks/w8_wgmma_sweep.py [--rows 1 8 32 64] [--dtypes fp8 int8] [--no-grid]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from quantized_gemv import L2_BYTES, SHAPES, cycling, graph_time_us


def grid() -> list[dict]:
    return [dict(block_n=bn, block_k=128, stages=st, splits=sp)
            for bn, st, sp in itertools.product((64, 128), (3, 4, 6), (1, 2, 4, 8))]


def cycled(fn, weights: list[torch.Tensor]) -> float:
    """Microseconds per `fn(weight)`, the weights taken in turn (past the L2 cache)."""
    return graph_time_us(cycling([partial(fn, w) for w in weights]), replays=10)


def _fp8_rows_mma(rows_mma, xq, xs, scale, launch, w):
    return rows_mma(xq, w, scale, x_scale=xs, out_dtype=torch.bfloat16, **launch)


def _gemv(w8a16_matmul, x, scale, w):
    return w8a16_matmul(x, w, scale, gemv_rows=2)


def _fp8_wgmma(fp8_wgmma, x, scale, splits, w):
    return fp8_wgmma(x, w, scale, splits=splits)


def _fp8_wgmma_gated(fp8_wgmma, x, scale, w):
    return fp8_wgmma(x, w, scale, act="silu")


def _fp8_wgmma_then_act(fp8_wgmma, x, scale, w):
    from infer.kernels.activation import gated_rows

    return gated_rows(fp8_wgmma(x, w, scale), "silu")


def _scaled_mm(xq, xs, scale, w):
    return torch._scaled_mm(xq, w.t(), scale_a=xs[:, None], scale_b=scale[None, :],
                            out_dtype=torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--dtypes", nargs="+", choices=["fp8", "int8"], default=["fp8", "int8"])
    parser.add_argument("--no-grid", action="store_true", help="the default launch only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("w8_wgmma_sweep.py times CUDA kernels: no GPU here")
    from infer.kernels.fp8_quant import fp8_quantize_rows
    from infer.kernels.fp8_wgmma import default_launch as fp8_launch
    from infer.kernels.fp8_wgmma import fp8_wgmma
    from infer.kernels.int8_x16 import int8_x16_matmul, split_rows
    from infer.kernels.rows_mma import fp8_x_launch, rows_mma
    from infer.kernels.w8_wgmma import default_launch, w8_wgmma
    from infer.kernels.w8a16_matmul import w8a16_matmul

    ceil = common.ceilings()
    copy_gbs = ceil["copy_GBps"]
    rows_out, sweep = [], []
    for (shape, n, k), dtype in itertools.product(SHAPES, args.dtypes):
        copies = max(1, -(-3 * L2_BYTES // (n * k)))
        int8 = dtype == "int8"
        weights = [torch.randint(-100, 100, (n, k), device="cuda", dtype=torch.int8)
                   for _ in range(copies)]
        if not int8:
            weights = [w.to(torch.float8_e4m3fn) for w in weights]
        scale = torch.rand(n, device="cuda") * 1e-3 + 1e-4
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                   for _ in range(max(1, copies // 2))]
            bf16_us = cycled(partial(F.linear, x), w16)
            del w16
            moved = n * k + 4 * n + x.nbytes + rows * n * 2

            def frac(us, moved=moved):
                return moved / us / 1e3 / copy_gbs if us else None

            row = dict(shape=shape, rows=rows, dtype=dtype, bf16_us=bf16_us)
            if int8:
                halves, xs = split_rows(x)
                ref = partial(int8_x16_matmul, x, scale=scale, halves=(halves, xs))
                row["engine_us"] = cycled(ref, weights)
                row["engine"] = "int8_x16_matmul"
                xq = halves
            else:
                xq, xs = fp8_quantize_rows(x)

                ref = partial(_fp8_rows_mma, rows_mma, xq, xs, scale,
                              fp8_x_launch(n, k, x.device))
                scaled_mm = partial(_scaled_mm, xq, xs, scale)
                row["engine_us"] = cycled(ref, weights)
                row["engine"] = "rows_mma fp8 x fp8"
                row["scaled_mm_us"] = cycled(scaled_mm, weights)
            if rows <= 2:
                row["gemv_us"] = cycled(partial(_gemv, w8a16_matmul, x, scale), weights)
            if not int8:  # weight-only: x as it is
                exact = (x.float() @ (weights[0].float() * scale[:, None]).T)
                chosen_splits = fp8_launch(n, k, x.device)["splits"]
                for splits in sorted({chosen_splits, 1, 2, 4, 8}):
                    fn = partial(_fp8_wgmma, fp8_wgmma, x, scale, splits)
                    us = cycled(fn, weights)
                    err = ((fn(weights[0]).float() - exact).abs().max()
                           / exact.abs().max()).item()
                    sweep.append(dict(shape=shape, rows=rows, dtype="fp8 by bf16",
                                      splits=splits, us=us, frac_copy=frac(us), err=err))
                    if splits == chosen_splits:
                        row.update(w16_us=us, w16_frac=frac(us), w16_err=err)
                    if us < row.get("w16_best_us", float("inf")):
                        row.update(w16_best_us=us, w16_best_splits=splits)
                if shape == "gate_up":  # act(gate) * up from the launch, or a launch after
                    row["w16_gated_us"] = cycled(partial(_fp8_wgmma_gated, fp8_wgmma, x,
                                                         scale), weights)
                    row["w16_then_act_us"] = cycled(
                        partial(_fp8_wgmma_then_act, fp8_wgmma, x, scale), weights)
            want = ref(weights[0]).float()
            chosen = default_launch(n, k, x.device)
            launches = [chosen] + ([] if args.no_grid else
                                   [g for g in grid() if g != chosen])
            best = None
            for launch in launches:
                fn = partial(w8_wgmma, xq, xs, scale=scale, out_dtype=torch.bfloat16, **launch)
                try:
                    got = fn(weights[0]).float()
                    us = cycled(lambda w, fn=fn: fn(weight=w), weights)
                except Exception as exc:  # a launch that does not fit: skip it
                    print(f"  {shape} {rows} {launch}: {exc!r}"[:300], flush=True)
                    continue
                err = ((got - want).abs().max() / want.abs().max()).item()
                sweep.append(dict(shape=shape, rows=rows, dtype=dtype, **launch, us=us,
                                  frac_copy=frac(us), err=err))
                if launch is chosen:
                    row.update(wgmma_us=us, wgmma_frac=frac(us), wgmma_err=err)
                if best is None or us < best[0]:
                    best = (us, launch)
            if best:
                row.update(best_us=best[0], best_frac=frac(best[0]), best=best[1])
            row.update(engine_frac=frac(row["engine_us"]))
            rows_out.append(row)
            print(f"[w8_wgmma] {row}", flush=True)
        del weights
        torch.cuda.empty_cache()
        common.write_results("w8_wgmma_sweep", args, {"ceilings": ceil, "rows": rows_out,
                                                      "sweep": sweep})
    common.print_table("8-bit weights by 8-bit x (us per call, CUDA graph, weights past L2)",
                       rows_out,
                       [("shape", "shape", ""), ("rows", "rows", ""), ("dtype", "dtype", ""),
                        ("bf16 us", "bf16_us", ".1f"), ("engine", "engine", ""),
                        ("engine us", "engine_us", ".1f"), ("%copy", "engine_frac", ".0%"),
                        ("_scaled_mm us", "scaled_mm_us", ".1f"), ("gemv us", "gemv_us", ".1f"),
                        ("fp8 x bf16 us", "w16_us", ".1f"), ("%copy", "w16_frac", ".0%"),
                        ("err", "w16_err", ".1e"), ("best", "w16_best_us", ".1f"),
                        ("splits", "w16_best_splits", ""),
                        ("gated us", "w16_gated_us", ".1f"),
                        ("then act us", "w16_then_act_us", ".1f"),
                        ("wgmma us", "wgmma_us", ".1f"), ("%copy", "wgmma_frac", ".0%"),
                        ("err", "wgmma_err", ".1e"), ("best us", "best_us", ".1f"),
                        ("%copy", "best_frac", ".0%"), ("best", "best", "")])


if __name__ == "__main__":
    main()
