"""One decode row (or --rows) through each CPU matmul path this torch offers, on SmolLM2's layer
shapes and its LM head: torch's INT4 kernel and INT8 weight-only kernel (bfloat16 rows,
as `quantization/int4.py` and `int8.py` feed them), FBGEMM's dynamic INT8 (the row
quantized with one scale to 7 bits: `reduce_range`, as x86 without VNNI needs) and FP16-weight
kernels, infer's block kernels (`kernels/cpu_block_linear.cpp`: 4-bit and Q8_0 blocks of
32, x rounded to int8 per 32 values; where they build), and float32 `F.linear`; one torch
thread, µs a call (median) and GB/s of the
weight bytes read, each call on the next of enough copies of the weight that they do not
stay in the caches (as a model's layers do not). A decode token's sum is 30 layers of
the four shapes plus the LM head.

    python benchmarks/cpu_matmul_paths.py [--repeats 200] [--rows 8]
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/cpu_matmul_paths.py   # an AVX2 CPU's kernels

Prints one table and writes benchmarks/results/cpu_matmul_paths_<device>.json.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from infer.kernels import cpu_extension
from infer.kernels.cpu_block_linear import Q8_BLOCK_BYTES, q4_1_linear, q8_0_linear
from infer.quantization.cpu_blocks import q4_blocks

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
LAYERS = 30
CACHE_BYTES = 256 * 2**20  # float32 copies cycled per shape: more than any CPU's caches


def _cycled(calls: list[Callable[[], object]]) -> Callable[[], object]:
    state = {"i": 0}

    def call() -> object:
        state["i"] = (state["i"] + 1) % len(calls)
        return calls[state["i"]]()
    return call


def _paths(n: int, k: int, rows: int, gen: torch.Generator
           ) -> dict[str, tuple[Callable[[], object], int]]:
    """Each path's calls on `rows` rows of x, cycled over copies of a `[n, k]` weight, with
    the bytes of weight a call reads."""
    copies = max(1, CACHE_BYTES // (n * k * 4))
    made = [_one_copy(n, k, rows, gen) for _ in range(copies)]
    return {path: (_cycled([m[path][0] for m in made]), made[0][path][1]) for path in made[0]}


def _one_copy(n: int, k: int, rows: int, gen: torch.Generator
              ) -> dict[str, tuple[Callable[[], object], int]]:
    w = torch.randn(n, k, generator=gen) * 0.02
    x = torch.randn(rows, k, generator=gen)
    xb = x.bfloat16()
    q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 2)
    scales_zeros = (torch.rand(k // 32, n, 2, generator=gen) * 0.01).bfloat16()
    scale = w.abs().amax(1) / 127
    q8 = torch.round(w / scale[:, None]).to(torch.int8)
    with warnings.catch_warnings():  # torch's quantized tensors are deprecated, not gone
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(n, dtype=torch.long),
                                        0, torch.qint8)
    fbgemm8 = torch.ops.quantized.linear_prepack(qw, None)
    fbgemm16 = torch.ops.quantized.linear_prepack_fp16(w, None)
    scale_b = scale.bfloat16()
    paths = _block_paths(n, k, x, gen) if cpu_extension.available() else {}
    return paths | {
        "int4 kernel": (lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
            xb, packed4, 32, scales_zeros), n * k // 2 + scales_zeros.numel() * 2),
        "int8 weight-only": (lambda: torch.ops.aten._weight_int8pack_mm(xb, q8, scale_b),
                             n * k + n * 2),
        "FBGEMM dynamic int8": (lambda: torch.ops.quantized.linear_dynamic(x, fbgemm8, True),
                                n * k + n * 4),
        "FBGEMM fp16": (lambda: torch.ops.quantized.linear_dynamic_fp16(x, fbgemm16),
                        n * k * 2),
        "float32": (lambda: F.linear(x, w), n * k * 4),
    }


def _block_paths(n: int, k: int, x: torch.Tensor, gen: torch.Generator
                 ) -> dict[str, tuple[Callable[[], object], int]]:
    q4 = q4_blocks(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                   torch.rand(n, k // 32, generator=gen) * 0.01,
                   -torch.rand(n, k // 32, generator=gen) * 0.01)
    q8 = torch.randint(0, 256, (n, k // 32 * Q8_BLOCK_BYTES), generator=gen,
                       dtype=torch.uint8)
    q8.view(n, -1, Q8_BLOCK_BYTES)[..., :2] = torch.tensor([0, 0x20], dtype=torch.uint8)
    return {"infer 4-bit blocks, x int8": (lambda: q4_1_linear(x, q4), q4.numel()),
            "infer Q8_0 blocks, x int8": (lambda: q8_0_linear(x, q8), q8.numel())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--rows", type=int, default=1, help="rows of x (sequences a step)")
    common.add_common_args(p)
    args = p.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows, token_us = [], {}
    for shape, (n, k) in SHAPES.items():
        for path, (fn, nbytes) in _paths(n, k, args.rows, gen).items():
            us = common.host_time(fn, args.repeats, warmup=5) * 1e6
            rows.append(dict(shape=shape, path=path, us=us, gb_s=nbytes / us / 1e3))
            token_us[path] = token_us.get(path, 0.0) + us * (1 if shape == "lm_head"
                                                             else LAYERS)
    rows += [dict(shape="token", path=path, us=us, gb_s=None) for path, us in token_us.items()]
    capability = torch.backends.cpu.get_cpu_capability()
    common.write_results("cpu_matmul_paths", args, {"cpu_capability": capability,
                                                    "rows": rows})
    common.print_table(f"{args.rows} decode row(s) per CPU matmul path, µs a call, one "
                       f"thread ({capability}; token = {LAYERS} layers + LM head, a step "
                       f"of the rows)", rows,
                       [("shape", "shape", ""), ("path", "path", ""), ("µs", "us", ".1f"),
                        ("weight GB/s", "gb_s", ".1f")])


if __name__ == "__main__":
    main()
