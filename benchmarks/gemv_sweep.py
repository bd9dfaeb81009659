"""infer's GEMV (`kernels/gemv.py`) against cuBLAS on the projections of batch-1 decode
(or with `--rows` 2 to 16, a verify step's k + 1 positions or a small batch, the
tensor-core kernel those take, `kernels/rows_mma.py`): the Llama-3.2-1B and
Llama-3.1-8B shapes, and one rank of the 8B at TP=2 (half of every split matrix). For
each shape: cuBLAS (`F.linear`), the kernel's default launch, the default launch again
with programmatic dependent launch (each call launched while the one before runs, as in a
decode step), and the fastest of a sweep of launches (output channels per program, K
step, warps; with `--dependent` each under dependent launch, against the default's
dependent time), in µs per call and as a share of the copy bandwidth measured in the same run.

Each case is captured in a CUDA graph (quantized_gemv.py's timer) whose calls cycle
through enough copies of the weight to exceed the L2 cache three times over, as a decode
step's layers do; every launch's result is checked against cuBLAS's first. Past one row
rows_mma is also timed with the weight as the MMA's first operand in the engine's tiles
(`EngineConfig.mma_weight_first`); `--weight-first` sweeps that form's launches.

With `--dtype int8` or `float8_e4m3fn` the weight is 8-bit with a scale per channel,
through the GEMV's scaled form, and `w8a16_matmul.py`'s own one-row kernel in its last
default launch is timed beside it (with dependent launch, as the GEMV's "dependent"); INT8
also through `int8_x16.py` (the int8 tensor cores, x split into two int8 halves by its own
launch, timed with it), which the engine sends 2 to `int8_mma_rows` rows.
With `--gemv`, two rows (gemv.MAX_ROWS) go through the GEMV too, its launches swept, and
the kernel the engine took for them before is timed beside it with dependent launch: INT8
int8_x16 (its launch to split x included), FP8 and 16-bit rows_mma.
With `--gate-up silu` only the gate_up projections run, through `gemv_gate_up` (the
launch stores `silu(gate) * up`, as `gemv_gate_up_activation` has the engine do); cuBLAS,
w8a16's kernel and rows_mma store `[gate | up]` (the activation's launch not timed).
With `--x16-gemv` (`--dtype int8`, one row) the kernel timed, swept and shown as "default"
is `int8_x16_gemv.py` (dp4a on x split into two int8 halves, its launch to split x timed
with it) in place of the GEMV; with `--x16-halves row` the halves are made before the
timed calls (one scale a row, as the RMSNorm makes them): the GEMV alone.
With `--first-row-skipped` (`--gemv --rows 2`) the GEMV's launches run with the skip flag
set (`kernels/row_skip.py`: the second row alone, as a draft round's catch-up forward
after a verdict that rejected a draft); the engine's kernel before it, without.

    python benchmarks/gemv_sweep.py [--shapes 1b 8b 8b-tp2] [--projections o down]
        [--quick | --defaults-only]
        [--rows 5 [--weight-first] --suffix _rows5] [--dtype int8 --suffix _int8]
        [--gemv --rows 2 [--dtype int8] --suffix _gemv2_int8]
        [--gate-up silu --suffix _gate_up] [--gemv --rows 2 --first-row-skipped]
        [--dependent] [--dtype int8 --x16-gemv [--x16-halves row] --suffix _x16]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import quantized_gemv
from quantized_gemv import L2_BYTES, time_cycled

from infer.engine.config import GEMV_FORMS

# (name, N, K) of each projection; qkv and gate_up fused as the models hold them.
SHAPES = {
    "1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048),
           ("down", 2048, 8192), ("lm_head", 128256, 2048)],
    "8b": quantized_gemv.SHAPES,
    "8b-tp2": [("qkv", 3072, 4096), ("o", 4096, 2048), ("gate_up", 14336, 4096),
               ("down", 4096, 7168), ("lm_head", 64128, 4096)],
}


def weight_first_launches(**extra: bool) -> list[dict]:
    """The launches swept for a weight-first product (rows_mma's with `weight_first=True`,
    or int8_x16's)."""
    return [dict(block_n=bn, block_k=bk, splits=splits, num_warps=4, num_stages=stages,
                 **extra)
            for bn, bk, splits, stages in itertools.product(
                (64, 128), (128, 256), (1, 2, 4), (3, 4))]


def launches(quick: bool, gemv: bool, weight_first: bool = False,
             eight_bit: bool = False, x16_gemv: bool = False) -> list[dict]:
    """The GEMV's launches, int8_x16_gemv's, or rows_mma's (splits None: its own rule)."""
    if weight_first:
        return weight_first_launches(weight_first=True)
    if x16_gemv:
        out = [dict(block_n=bn, block_k=bk, num_warps=warps) for bn, bk, warps in
               itertools.product((8, 16, 32), (256, 512, 1024), (4, 8))]
        return out[::3] if quick else out
    if gemv:
        steps = (512, 1024, 2048, 4096) if eight_bit else (256, 512, 1024)
        out = [dict(block_n=bn, block_k=bk, num_warps=warps) for bn, bk, warps in
               itertools.product((2, 4, 8, 16) if eight_bit else (4, 8, 16), steps, (4, 8))]
    else:
        out = [dict(block_n=bn, block_k=bk, splits=splits, num_warps=warps,
                    num_stages=stages)
               for bn, bk, splits, warps, stages in itertools.product(
                   (64, 128), (64, 128, 256), (None, 1, 2, 4, 8), (4, 8), (3, 4))]
    return out[::3] if quick else out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--projections", nargs="+", default=None,
                        help="only these projections of each shape set (qkv o gate_up down "
                        "lm_head)")
    parser.add_argument("--quick", action="store_true", help="every third launch")
    parser.add_argument("--defaults-only", action="store_true",
                        help="time the kernel's default launch only")
    parser.add_argument("--rows", type=int, default=1, help="rows of x (up to 16)")
    parser.add_argument("--weight-first", action="store_true",
                        help="past one row, sweep rows_mma with the weight as the first "
                        "operand")
    parser.add_argument("--dtype", default="bfloat16",
                        choices=["bfloat16", "int8", "float8_e4m3fn"],
                        help="the weight's dtype (8-bit: one row or --gemv's two, a scale "
                        "per channel)")
    parser.add_argument("--gemv", action="store_true",
                        help="past one row, the GEMV (up to gemv.MAX_ROWS rows) against "
                        "the engine's kernel before it")
    parser.add_argument("--gate-up", choices=["", "silu"], default="",
                        help="the gate_up projections only, the activation stored by the "
                        "launch (gemv_gate_up)")
    parser.add_argument("--first-row-skipped", action="store_true",
                        help="with --gemv --rows 2: the GEMV's launches with the skip flag "
                        "set (the second row alone)")
    parser.add_argument("--form", choices=GEMV_FORMS, default="floats",
                        help="the GEMV's form (EngineConfig.gemv_form)")
    parser.add_argument("--dependent", action="store_true",
                        help="sweep the launches under dependent launch too (each call "
                        "launched while the one before runs, as in a decode step)")
    parser.add_argument("--x16-gemv", action="store_true",
                        help="with --dtype int8 (one row): int8_x16_gemv.py's kernel in the "
                        "GEMV's place")
    parser.add_argument("--x16-halves", choices=["split", "row"], default="split",
                        help="with --x16-gemv, x's halves: split by the timed call's own "
                        "launch, or made beforehand with one scale for the row (as the "
                        "RMSNorm makes them): the GEMV alone")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemv_sweep.py times CUDA kernels: no GPU here")
    from infer.kernels import dependent_launch, int8_x16_gemv, row_skip
    from infer.kernels import gemv as gemv_kernel
    from infer.kernels.gemv import Launch, default_launch, gemv, gemv_gate_up
    from infer.kernels.int8_x16 import int8_x16_matmul, split_rows
    from infer.kernels.rows_mma import MAX_ROWS, rows_mma, weight_first_launch
    from infer.kernels.w8a16_matmul import _matmul as w8a16_kernel

    if not 1 <= args.rows <= MAX_ROWS:
        raise SystemExit(f"--rows: 1 to {MAX_ROWS}")
    wdtype = getattr(torch, args.dtype)
    eight_bit = wdtype != torch.bfloat16
    through_gemv = args.rows == 1 or args.gemv
    if args.gemv and not 1 <= args.rows <= gemv_kernel.MAX_ROWS:
        raise SystemExit(f"--gemv: 1 to {gemv_kernel.MAX_ROWS} rows")
    gemv_kernel.set_form(args.form)
    if eight_bit and not through_gemv:
        raise SystemExit("--dtype int8 / float8_e4m3fn: one row, or --gemv")
    if args.gate_up and not through_gemv:
        raise SystemExit("--gate-up: one row, or --gemv (gemv_gate_up is the GEMV's)")
    if args.first_row_skipped and not (args.gemv and args.rows == 2):
        raise SystemExit("--first-row-skipped: with --gemv --rows 2")
    if args.x16_gemv and (args.dtype != "int8" or args.rows != 1 or args.gemv):
        raise SystemExit("--x16-gemv: with --dtype int8, one row")
    if args.x16_halves != "split" and not args.x16_gemv:
        raise SystemExit("--x16-halves: with --x16-gemv")
    made_halves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def halves_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x's halves made before the timed call (--x16-halves), one set an x."""
        if args.x16_halves == "split":
            return None
        if x.data_ptr() not in made_halves:
            made_halves[x.data_ptr()] = split_rows(x)
        return made_halves[x.data_ptr()]
    flag = torch.ones(1, dtype=torch.int32, device="cuda")
    checked_from = 1 if args.first_row_skipped else 0  # the rows a skipped launch writes

    def run(x: torch.Tensor, weight: torch.Tensor, launch: dict,
            scale: torch.Tensor | None = None) -> torch.Tensor:
        if args.x16_gemv:
            return int8_x16_gemv.int8_x16_gemv(x, weight, scale, args.gate_up,
                                               Launch(**launch) if launch else None,
                                               halves=halves_of(x))
        if through_gemv:
            launch = Launch(**launch) if launch else None
            with (row_skip.first_row_skipped_where(flag) if args.first_row_skipped
                  else nullcontext()):
                if args.gate_up:
                    return gemv_gate_up(x, weight, args.gate_up, scale, launch)
                return gemv(x, weight, launch, scale=scale)
        return rows_mma(x, weight, **launch)

    def w8a16_one_row(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
                      ) -> torch.Tensor:  # w8a16_matmul's one-row default before the GEMV
        return w8a16_kernel(x, weight, scale, None, block_n=8, block_k=1024, split=1,
                            one_row_gemv=True, num_warps=4, num_stages=2)

    def before_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None
                    ) -> torch.Tensor:  # the engine's kernel for a few rows before --gemv
        if weight.dtype == torch.int8:
            return int8_x16_matmul(x, weight, scale)
        if scale is not None:
            return rows_mma(x, weight, scale)
        return rows_mma(x, weight, **weight_first_launch(*weight.shape, x.device))

    def checked_us(kernel, x: torch.Tensor, weights: list[torch.Tensor],
                   expected: torch.Tensor, first: int = 0) -> float:
        """`kernel(x, weight)`'s time, once its result's rows from `first` on match
        cuBLAS's."""
        got = kernel(x, weights[0]).float()[first:]
        expected = expected[first:]
        err = (got - expected).abs().max().item() / expected.abs().max().item()
        assert err < 2e-2, (kernel, err)
        return time_cycled(kernel, x, weights, replays=10)

    ceil = common.ceilings()
    copy_gbs = ceil["copy_GBps"]
    rows, sweep = [], []
    for model in args.shapes:
        for shape, n, k in SHAPES[model]:
            if args.gate_up and shape != "gate_up":
                continue
            if args.projections and shape not in args.projections:
                continue
            x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
            w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(max(1, -(-3 * L2_BYTES // (2 * n * k))))]
            cublas_us = time_cycled(F.linear, x, w16, replays=10)
            scale = None
            if eight_bit:
                del w16
                weights = [torch.randint(-100, 100, (n, k), device="cuda", dtype=torch.int8)
                           .to(wdtype) for _ in range(max(1, -(-3 * L2_BYTES // (n * k))))]
                scale = torch.rand(n, device="cuda") * 1e-3 + 1e-4
                expected = F.linear(x, (weights[0].float() * scale[:, None]).to(x.dtype))
            else:
                weights = w16
                expected = F.linear(x, weights[0])
            expected = expected.float()
            # What `run` stores: the activation of the product, with --gate-up.
            run_expected = (F.silu(expected[:, :n // 2]) * expected[:, n // 2:]
                            if args.gate_up else expected)
            stored = n // 2 if args.gate_up else n  # output columns
            moved = (weights[0].nbytes + 2 * args.rows * (x.shape[1] + stored)
                     + (0 if scale is None else scale.nbytes))

            def frac(us: float, moved: int = moved) -> float:
                return moved / us / 1e3 / copy_gbs

            def timed(launch, x=x, weights=weights, expected=run_expected,
                      scale=scale) -> float:
                return checked_us(partial(run, launch=launch, scale=scale), x, weights,
                                  expected, checked_from)

            if args.x16_gemv:
                default = int8_x16_gemv.default_launch(n, k)._asdict()
            else:
                default = (default_launch(n, k, weights[0].element_size(), x.shape[0],
                                          wdtype == torch.int8)._asdict()
                           if through_gemv else {})
            default_us = timed(default)
            dependent_launch.set_enabled(True)  # each call's launch under the one before
            pdl_us = timed(default)
            w8a16_us = (checked_us(partial(w8a16_one_row, scale=scale), x, weights, expected)
                        if eight_bit and args.rows == 1 else None)
            before_us = (checked_us(partial(before_gemv, scale=scale), x, weights, expected)
                         if args.gemv and args.rows > 1 else None)
            int8_mma_us = (checked_us(partial(int8_x16_matmul, scale=scale), x, weights,
                                      expected)
                           if wdtype == torch.int8 and args.rows == 1 else None)
            dependent_launch.set_enabled(False)
            mma_us = w_first_us = None
            if args.rows == 1:  # the tensor-core kernel's, for comparison
                mma_us = checked_us(partial(rows_mma, scale=scale), x, weights, expected)
            elif not args.gemv:  # the weight as the first operand, in the engine's tiles
                w_first_us = timed(weight_first_launch(n, k, x.device))
            best, best_us = default, default_us
            swept = launches(args.quick, through_gemv,
                             args.weight_first and not through_gemv, eight_bit, args.x16_gemv)
            dependent_launch.set_enabled(args.dependent)
            if args.dependent:  # the best is then the dependent default's to beat
                best_us = pdl_us
            for launch in ([] if args.defaults_only else swept):
                try:
                    us = timed(launch)
                except Exception as exc:  # a launch that does not compile: skip it
                    print(f"  {model} {shape} {launch}: {exc!r}"[:200])
                    continue
                sweep.append(dict(model=model, shape=shape, n=n, k=k, **launch, us=us))
                if us < best_us:
                    best, best_us = launch, us
            dependent_launch.set_enabled(False)
            row = dict(model=model, shape=shape, rows=args.rows, n=n, k=k, MB=moved / 1e6,
                       cublas_us=cublas_us,
                       cublas_frac=(2 * n * k + 2 * args.rows * (k + n)) / cublas_us / 1e3
                       / copy_gbs,
                       default_us=default_us, default_frac=frac(default_us),
                       pdl_us=pdl_us, pdl_frac=frac(pdl_us), rows_mma_us=mma_us,
                       w8a16_us=w8a16_us, w8a16_frac=w8a16_us and frac(w8a16_us),
                       int8_mma_us=int8_mma_us,
                       int8_mma_frac=int8_mma_us and frac(int8_mma_us),
                       before_us=before_us, pdl_vs_before=before_us and before_us / pdl_us,
                       w_first_us=w_first_us, w_first_frac=w_first_us and frac(w_first_us),
                       best_us=best_us, best_frac=frac(best_us), best=best,
                       best_vs_cublas=cublas_us / best_us)
            rows.append(row)
            print(f"[gemv] {row}", flush=True)
            del weights
            torch.cuda.empty_cache()
            common.write_results("gemv_sweep", args, {"ceilings": ceil, "rows": rows,
                                                      "sweep": sweep})
    common.print_table(
        f"{'int8_x16_gemv' if args.x16_gemv else 'GEMV' if through_gemv else 'rows_mma'} "
        f"of {args.rows} row(s), {args.dtype} "
        f"weights{', ' + args.gate_up + ' stored by the launch' if args.gate_up else ''} "
        "(cuBLAS: bf16; us per "
        "call in a CUDA graph, weights cycled past L2)", rows,
        [("model", "model", ""), ("shape", "shape", ""), ("MB", "MB", ".1f"),
         ("cuBLAS us", "cublas_us", ".1f"), ("%copy", "cublas_frac", ".0%"),
         ("default us", "default_us", ".1f"), ("%copy", "default_frac", ".0%"),
         ("dependent us", "pdl_us", ".1f"), ("%copy", "pdl_frac", ".0%"),
         ("W8A16 one-row us", "w8a16_us", ".1f"), ("%copy", "w8a16_frac", ".0%"),
         ("int8 MMA one-row us", "int8_mma_us", ".1f"), ("%copy", "int8_mma_frac", ".0%"),
         ("engine before us", "before_us", ".1f"), ("before/dependent", "pdl_vs_before", ".2f"),
         ("rows_mma us", "rows_mma_us", ".1f"), ("weight first us", "w_first_us", ".1f"),
         ("%copy", "w_first_frac", ".0%"), ("best us", "best_us", ".1f"),
         ("%copy", "best_frac", ".0%"),
         ("cuBLAS/best", "best_vs_cublas", ".2f"), ("best launch", "best", "")])


if __name__ == "__main__":
    main()
