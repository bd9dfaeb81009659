"""The INT4 GEMV (`kernels/int4_gemv.py`, `quantization="int4"`) against the INT8 one
(`kernels/gemv.py`, per-channel scales) on the projections of batch-1 decode, Llama-3.2-1B
and Llama-3.1-8B shapes: one (or `--rows 2`) rows, each kernel's default launch with
programmatic dependent launch, and the fastest of a sweep of INT4 launches (channels a
program, K step, warps); µs a call and the share of the copy bandwidth measured in the
same run that the bytes it reads (packed weight, scales and zeros, x, y) make.

`--blocks` times the default launch on other channel blockings of the weight
(`int4_weights.kernel_layout`; 0 = the default's, 1 = every channel its own run of words,
-1 = all channels in one block, the layout before blocks), the first of them the one swept.

Each case is captured in a CUDA graph whose calls cycle through enough copies of the
weight to pass the L2 cache three times, as a decode step's layers do
(`quantized_gemv.time_cycled`); each launch's result is checked against the dequantized
weight's product first.

    python benchmarks/int4_gemv_sweep.py [--shapes 1b 8b] [--rows 2] [--defaults-only |
        --quick] [--blocks 0 -1 16] [--suffix _s54]
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
from gemv_sweep import SHAPES
from quantized_gemv import L2_BYTES, time_cycled

GROUP = 128
LAUNCHES = list(itertools.product((8, 16, 32), (512, 1024, 2048, 4096), (4, 8)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--shapes", nargs="+", choices=["1b", "8b"], default=["1b", "8b"])
    parser.add_argument("--rows", type=int, choices=[1, 2], default=1)
    parser.add_argument("--defaults-only", action="store_true")
    parser.add_argument("--quick", action="store_true", help="every third launch")
    parser.add_argument("--blocks", type=int, nargs="+", default=[0],
                        help="channel blockings to time (0: the default, -1: one block)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("int4_gemv_sweep.py times CUDA kernels: no GPU here")
    from infer.kernels import dependent_launch
    from infer.kernels.gemv import Launch, gemv
    from infer.kernels.int4_gemv import default_launch, int4_gemv
    from infer.quantization.int4_weights import channel_block, kernel_layout, quantize_groups

    ceil = common.ceilings()
    copy_gbs = ceil["copy_GBps"]
    dependent_launch.set_enabled(dependent_launch.supported(torch.device("cuda")))
    rows, sweep = [], []
    for model in args.shapes:
        for shape, n, k in SHAPES[model]:
            if shape == "lm_head":  # INT8 in every quantized model
                continue
            x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
            q, scale16, zero16 = quantize_groups(
                torch.randn(n, k, device="cuda") * 0.02, GROUP, torch.bfloat16)
            dense = (q.float().view(n, k // GROUP, GROUP) * scale16.float()[..., None]
                     + zero16.float()[..., None]).view(n, k)
            expected = F.linear(x.float(), dense)
            del dense
            default = default_launch(n, k)
            by_block = {}
            for block in args.blocks:
                block = {0: channel_block(n), -1: n}.get(block, block)
                packed, scale, zero = kernel_layout(q, scale16, zero16, block)
                copies = max(1, -(-3 * L2_BYTES // packed.nbytes))
                weights = [packed] + [packed.clone() for _ in range(copies - 1)]

                def timed(launch, weights=weights, scale=scale, zero=zero, x=x,
                          expected=expected) -> float:
                    got = int4_gemv(x, weights[0], scale, zero, launch).float()
                    err = (got - expected).abs().max().item() / expected.abs().max().item()
                    assert err < 2e-2, (launch, err)
                    return time_cycled(partial(_int4, scale=scale, zero=zero, launch=launch),
                                       x, weights, replays=10)

                by_block[block] = timed(default)
                if len(by_block) == 1:
                    swept_weights, swept_timed = weights, timed
                else:
                    del weights
            del q
            weights, timed = swept_weights, swept_timed
            moved = weights[0].nbytes + 2 * scale16.nbytes + 2 * args.rows * (k + n)
            default_us = next(iter(by_block.values()))
            best, best_us = default, default_us
            swept = LAUNCHES[::3] if args.quick else LAUNCHES
            for launch in ([] if args.defaults_only else map(Launch._make, swept)):
                try:
                    us = timed(launch)
                except Exception as exc:  # a launch that does not compile: skip it
                    print(f"  {model} {shape} {launch}: {exc!r}"[:200])
                    continue
                sweep.append(dict(model=model, shape=shape, **launch._asdict(), us=us))
                if us < best_us:
                    best, best_us = launch, us
            int8 = [torch.randint(-100, 100, (n, k), device="cuda", dtype=torch.int8)
                    for _ in range(max(1, -(-3 * L2_BYTES // (n * k))))]
            int8_scale = torch.rand(n, device="cuda") * 1e-3
            int8_us = time_cycled(partial(_int8, gemv, scale=int8_scale), x, int8, replays=10)
            int8_moved = n * k + 4 * n + 2 * args.rows * (k + n)
            del weights, int8
            torch.cuda.empty_cache()
            row = dict(model=model, shape=shape, rows=args.rows, n=n, k=k, MB=moved / 1e6,
                       int4_us=default_us, int4_frac=moved / default_us / 1e3 / copy_gbs,
                       best_us=best_us, best_frac=moved / best_us / 1e3 / copy_gbs,
                       best=best._asdict(), by_block=by_block, int8_us=int8_us,
                       int8_frac=int8_moved / int8_us / 1e3 / copy_gbs,
                       int8_over_int4=int8_us / default_us)
            rows.append(row)
            print(f"[int4] {row}", flush=True)
            common.write_results("int4_gemv_sweep", args,
                                 {"ceilings": ceil, "rows": rows, "sweep": sweep})
    common.print_table(
        f"INT4 GEMV (groups of {GROUP}) against the INT8 GEMV, {args.rows} row(s), "
        "dependent launch on (us a call in a CUDA graph, weights cycled past L2)", rows,
        [("model", "model", ""), ("shape", "shape", ""), ("MB", "MB", ".1f"),
         ("int4 us", "int4_us", ".1f"), ("%copy", "int4_frac", ".0%"),
         ("best us", "best_us", ".1f"), ("%copy", "best_frac", ".0%"), ("best", "best", ""),
         ("us by block", "by_block", ""),
         ("int8 us", "int8_us", ".1f"), ("%copy", "int8_frac", ".0%"),
         ("int8 / int4", "int8_over_int4", ".2f")])


def _int4(x, weight, scale, zero, launch):
    from infer.kernels.int4_gemv import int4_gemv

    return int4_gemv(x, weight, scale, zero, launch)


def _int8(gemv, x, weight, scale):
    return gemv(x, weight, scale=scale)


if __name__ == "__main__":
    main()
