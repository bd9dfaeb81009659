"""Where a step of many rows should leave torch's INT4 kernel for dequantize + F.linear
(`quantization/int4.py`'s DEQUANTIZE_ROWS): both paths on SmolLM2's four linear-layer
shapes, random 4-bit groups, one torch thread, ms per step (the four layers summed,
median of --repeats calls each).

    python benchmarks/int4_rows.py [--rows 128 512 640 768 1024 1536 2000]

Prints one table and writes benchmarks/results/int4_rows_<device>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2: qkv, o, gate_up, down


def _ms(fn, repeats: int) -> float:
    return common.host_time(fn, repeats, warmup=1) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+",
                   default=[128, 512, 640, 768, 1024, 1536, 2000])
    p.add_argument("--repeats", type=int, default=5)
    common.add_common_args(p)
    args = p.parse_args()
    torch.set_num_threads(1)
    from infer.models.linear import RowParallelLinear
    from infer.quantization.gguf_blocks import GROUP
    from infer.quantization.int4 import DEQUANTIZE_ROWS, Int4GroupLinearMethod

    gen = torch.Generator().manual_seed(0)
    layers = []
    for n, k in SHAPES:
        layer, method = RowParallelLinear(k, n), Int4GroupLinearMethod()
        method.load(layer, torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                    torch.rand(n, k // GROUP, generator=gen) * 0.01,
                    torch.randn(n, k // GROUP, generator=gen) * 0.01)
        layers.append((layer, method))
    capability = torch.backends.cpu.get_cpu_capability()
    results = []
    for rows in args.rows:
        kernel = dequantized = 0.0
        for layer, method in layers:
            x = torch.randn(rows, layer.weight.shape[1] * 2, generator=gen).to(torch.bfloat16)
            kernel += _ms(lambda x=x, layer=layer: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, layer.weight, GROUP, layer.weight_scales_and_zeros), args.repeats)
            dequantized += _ms(lambda x=x, layer=layer, method=method: F.linear(
                x.float(), method.dequantize(layer)), args.repeats)
        results.append(dict(rows=rows, kernel_ms=kernel, dequantize_linear_ms=dequantized,
                            faster="kernel" if kernel < dequantized else "dequantize"))
        common.write_results("int4_rows", args, {
            "cpu_capability": capability,
            "dequantize_rows": DEQUANTIZE_ROWS, "rows": results})
    common.print_table(
        f"INT4 kernel vs dequantize + F.linear, ms per step ({capability}; the engine "
        f"switches at {DEQUANTIZE_ROWS} rows)", results,
        [("rows", "rows", "d"), ("kernel ms", "kernel_ms", ".1f"),
         ("dequantize + F.linear ms", "dequantize_linear_ms", ".1f"),
         ("faster", "faster", "")])


if __name__ == "__main__":
    main()
