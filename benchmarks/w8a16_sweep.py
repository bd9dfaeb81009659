"""The W8A16 kernel's launch configurations on the Llama-3.1-8B projection shapes (or
gemv_sweep.py's other shape sets), at one row and at 32, INT8 and FP8 weights: the fastest
per shape, against bf16 cuBLAS and against the copy bandwidth, to choose `w8a16_matmul`'s
defaults.

Each case is captured in a CUDA graph (quantized_gemv.py's timer) whose calls cycle
through enough copies of the weight to exceed the L2 cache three times over, as the
layers of a decode step do (one weight called 20 times would be read from L2).

With `--tensor-cores` the kernel swept is `rows_mma` (up to 64 rows on tensor cores,
`EngineConfig.w8a16_tensor_cores`), its default launch timed beside the CUDA-core one, and
for FP8 weights the FP8 x FP8 paths, x quantized per row first (`fp8_quant.py`): rows_mma's
(`fp8_decode_activations`, `fp8_mma_rows`; swept with `--fp8-x`) and `torch._scaled_mm`'s
(what FP8 layers take past the weight-only rows). INT8 weights are also timed on the int8
tensor cores with x split into two int8 halves (`int8_x16.py`, `int8_mma_rows`; its
launches swept with `--int8-x16`), and every weight through rows_mma with the weight as the
MMA's first operand in the engine's tiles (`mma_weight_first`; swept with
`--weight-first`).

    python benchmarks/w8a16_sweep.py [--rows 1 32] [--shapes 8b 1b] [--one-row-kernel-only]
                                     [--tensor-cores [--fp8-x | --int8-x16 |
                                                      --weight-first] [--bf16-8bit]]
                                     [--quick | --defaults-only]
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
import gemv_sweep
from quantized_gemv import L2_BYTES, time_cycled


def configs(rows: int, quick: bool, one_row_kernel_only: bool = False) -> list[dict]:
    out = []
    if rows == 1:
        for bn, bk, warps, stages in itertools.product(
                (4, 8, 16), (512, 1024, 2048), (4, 8), (2, 3)):
            out.append(dict(block_n=bn, block_k=bk, split=1, one_row_gemv=True,
                            num_warps=warps, num_stages=stages))
        if one_row_kernel_only:
            return out[::4] if quick else out
    for bn, bk, warps, stages, split in itertools.product(
            (16, 32, 64), (128, 256, 512), (4,) if rows == 1 else (4, 8), (3, 4), (1, 2)):
        out.append(dict(block_n=bn, block_k=bk, split=split, one_row_gemv=False,
                        num_warps=warps, num_stages=stages))
    return out[::4] if quick else out


def mma_configs(quick: bool) -> list[dict]:
    """rows_mma's launches (splits None: its own rule)."""
    out = [dict(block_n=bn, block_k=bk, splits=splits, num_warps=warps, num_stages=stages)
           for bn, bk, splits, warps, stages in itertools.product(
               (64, 128), (64, 128, 256), (None, 1, 2, 4, 8), (4, 8), (2, 3, 4))]
    return out[::4] if quick else out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--quick", action="store_true", help="every fourth configuration")
    parser.add_argument("--dtypes", nargs="+", default=["int8", "float8_e4m3fn"])
    parser.add_argument("--shapes", nargs="+", choices=list(gemv_sweep.SHAPES),
                        default=["8b"])
    parser.add_argument("--one-row-kernel-only", action="store_true",
                        help="at one row, sweep the dot-free kernel's launches only")
    parser.add_argument("--defaults-only", action="store_true",
                        help="time the kernel's own launch only")
    parser.add_argument("--tensor-cores", action="store_true",
                        help="sweep rows_mma (tensor cores) instead of w8a16_matmul")
    parser.add_argument("--fp8-x", action="store_true",
                        help="with --tensor-cores, FP8 weights swept FP8 by FP8 (x "
                        "quantized per row first: fp8_mma_rows)")
    parser.add_argument("--int8-x16", action="store_true",
                        help="with --tensor-cores, INT8 weights swept on the int8 tensor "
                        "cores, x split into two int8 halves (int8_mma_rows)")
    parser.add_argument("--weight-first", action="store_true",
                        help="with --tensor-cores, sweep rows_mma with the weight as the "
                        "MMA's first operand (mma_weight_first)")
    parser.add_argument("--bf16-8bit", action="store_true",
                        help="with --tensor-cores, rows_mma's 8-bit weights made bfloat16 by "
                        "their bits, x as it is (mma_8bit_bf16)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("w8a16_sweep.py times CUDA kernels: no GPU here")
    from infer.kernels.fp8_quant import fp8_quantize_rows
    from infer.kernels.int8_x16 import int8_x16_matmul
    from infer.kernels.rows_mma import MAX_ROWS, fp8_x_launch, rows_mma, set_bf16_8bit

    set_bf16_8bit(args.bf16_8bit)
    from infer.kernels.w8a16_matmul import _matmul, w8a16_matmul

    def fp8_by_fp8(x, weight, scale, **cfg):  # without cfg: the engine's launch
        xq, x_scale = fp8_quantize_rows(x)
        return rows_mma(xq, weight, scale, x_scale=x_scale, out_dtype=x.dtype,
                        **(cfg or fp8_x_launch(*weight.shape, x.device)))

    def scaled_mm(x, weight, scale):
        xq, x_scale = fp8_quantize_rows(x)
        return torch._scaled_mm(xq, weight.t(), scale_a=x_scale[:, None],
                                scale_b=scale[None, :], out_dtype=x.dtype)

    ceil = common.ceilings()
    copy_gbs = ceil["copy_GBps"]
    results, best_rows = [], []
    shapes = [(f"{model} {name}", n, k) for model in args.shapes
              for name, n, k in gemv_sweep.SHAPES[model]]
    for (shape, n, k), rows in itertools.product(shapes, args.rows):
        copies = max(1, -(-3 * L2_BYTES // (n * k)))
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(max(1, copies // 2))]
        bf16_us = time_cycled(F.linear, x, w16, replays=20)
        del w16
        for dtype in [getattr(torch, name) for name in args.dtypes]:
            weights = [torch.randint(-100, 100, (n, k), device="cuda", dtype=torch.int8)
                       .to(dtype) for _ in range(copies)]
            scale = torch.rand(n, device="cuda") * 1e-3
            moved = n * k + 4 * n + x.nbytes + rows * n * 2

            def frac(us: float | None, moved: int = moved) -> float | None:
                """The share of the copy rate that moving the step's bytes in `us` is."""
                return moved / us / 1e3 / copy_gbs if us else None

            default_us = time_cycled(w8a16_matmul, x, weights, scale, replays=20)
            tensor_cores = args.tensor_cores and rows <= MAX_ROWS
            mma_us = (time_cycled(rows_mma, x, weights, scale, replays=20)
                      if tensor_cores else None)
            w_first = partial(rows_mma, **fp8_x_launch(n, k, x.device), weight_first=True)
            w_first_us = (time_cycled(w_first, x, weights, scale, replays=20)
                          if tensor_cores else None)
            fp8_x = tensor_cores and dtype == torch.float8_e4m3fn
            fp8_x_us = (time_cycled(fp8_by_fp8, x, weights, scale, replays=20)
                        if fp8_x else None)
            scaled_mm_us = (time_cycled(scaled_mm, x, weights, scale, replays=20)
                            if dtype == torch.float8_e4m3fn else None)
            int8_x = tensor_cores and dtype == torch.int8
            int8_x_us = (time_cycled(int8_x16_matmul, x, weights, scale, replays=20)
                         if int8_x else None)
            best = None
            swept = not shape.endswith("lm_head") and not args.defaults_only
            cases = ((gemv_sweep.weight_first_launches() if int8_x and args.int8_x16 else
                      gemv_sweep.weight_first_launches(weight_first=True)
                      if tensor_cores and args.weight_first else
                      mma_configs(args.quick) if tensor_cores else
                      configs(rows, args.quick, args.one_row_kernel_only)) if swept else [])
            for cfg in cases:
                try:
                    if tensor_cores:
                        swept_fn = (fp8_by_fp8 if fp8_x and args.fp8_x else
                                    int8_x16_matmul if int8_x and args.int8_x16 else rows_mma)
                        us = time_cycled(partial(swept_fn, **cfg), x, weights, scale)
                    else:
                        us = time_cycled(partial(_matmul, **cfg), x, weights, scale, None)
                except Exception as exc:  # a configuration that does not compile: skip it
                    print(f"  {shape} {cfg}: {exc!r}"[:200])
                    continue
                row = dict(shape=shape, rows=rows, dtype=str(dtype)[6:], **cfg, us=us,
                           frac_copy=frac(us))
                results.append(row)
                if best is None or us < best["us"]:
                    best = row
            summary = dict(shape=shape, rows=rows, dtype=str(dtype)[6:], bf16_us=bf16_us,
                           default_us=default_us,
                           default_frac=frac(default_us),
                           tensor_cores_us=mma_us,
                           tensor_cores_frac=frac(mma_us),
                           w_first_us=w_first_us,
                           w_first_frac=frac(w_first_us),
                           fp8_x_us=fp8_x_us,
                           fp8_x_frac=frac(fp8_x_us),
                           int8_x16_us=int8_x_us,
                           int8_x16_frac=frac(int8_x_us),
                           scaled_mm_us=scaled_mm_us,
                           scaled_mm_frac=frac(scaled_mm_us),
                           best_us=best["us"] if best else default_us,
                           best_frac=best["frac_copy"] if best else None,
                           best=({k: v for k, v in best.items()
                                  if k in {**configs(1, False)[-1], **mma_configs(False)[-1]}}
                                 if best else None))
            best_rows.append(summary)
            print(f"[w8a16] {summary}", flush=True)
            del weights
            torch.cuda.empty_cache()
    common.write_results("w8a16_sweep", args, {"ceilings": ceil, "best": best_rows,
                                               "sweep": results})
    common.print_table("W8A16 launches (us per call, CUDA graph, "
                       "weights cycled past L2)", best_rows,
                       [("shape", "shape", ""), ("rows", "rows", ""), ("dtype", "dtype", ""),
                        ("bf16 us", "bf16_us", ".1f"), ("default us", "default_us", ".1f"),
                        ("%copy", "default_frac", ".0%"),
                        ("tensor cores us", "tensor_cores_us", ".1f"),
                        ("%copy", "tensor_cores_frac", ".0%"),
                        ("weight first us", "w_first_us", ".1f"),
                        ("%copy", "w_first_frac", ".0%"),
                        ("fp8 x fp8 us", "fp8_x_us", ".1f"), ("%copy", "fp8_x_frac", ".0%"),
                        ("int8 x16 us", "int8_x16_us", ".1f"),
                        ("%copy", "int8_x16_frac", ".0%"),
                        ("_scaled_mm us", "scaled_mm_us", ".1f"),
                        ("%copy", "scaled_mm_frac", ".0%"),
                        ("best us", "best_us", ".1f"),
                        ("%copy", "best_frac", ".0%"), ("best launch", "best", "")])


if __name__ == "__main__":
    main()
