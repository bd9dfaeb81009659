"""The quantized matmul kernels alone, at decode-sized rows, on the Llama-3.1-8B projection
shapes: bf16 `F.linear` (cuBLAS), the W8A16 kernel on INT8 and FP8 weights (per channel,
and per 128x128 tile as block-wise FP8 checkpoints store them), and the GGUF kernel on
Q4_K, Q6_K and Q8_0 blocks.

Each case is captured in a CUDA graph of 20 calls (as decode steps run) and replayed; the
time per call is the median of the replays. The calls take copies of the weight in turn,
enough to exceed the L2 cache three times over (the sweep's one weight does not). Bytes =
the weight as stored (scales included) plus the activations read and written; GB/s as a
fraction of the copy bandwidth measured in the same run. `--sweep` also times the one-row
GGUF kernel's launch configurations, `--gemm-sweep` those of the few-row GGUF kernel
(gguf_gemm.py) at each of `--rows` beside bf16 and the dequantize-then-cuBLAS path (and, for
Q4_K and Q6_K on a Hopper GPU with Triton's Gluon, gguf_wgmma.py at its rule's K split, half
and twice it)
(`Q4_K-deq`: what the engine ran from two rows up before), weights cycled past L2 as in
the table. `--gguf-only`: the table's bf16 and GGUF rows alone. `Q4_K-int8x`, `Q6_K-int8x`,
`Q8_0-int8x` (one row): x rounded to int8 (gguf_q4k_int8x.py, gguf_q6k_int8x.py,
gguf_q8_0_int8x.py, `gguf_int8_activations`); `--int8x-sweep` their launches.

    python benchmarks/quantized_gemv.py [--rows 1 8 32] [--sweep | --sweep-only]
        [--gemm-sweep [--gemm-grid]] [--gguf-only] [--int8x-sweep]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

# (name, out features, in features) of the 8B shape's matmuls in a decode step
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336), ("lm_head", 128256, 4096)]
CALLS_PER_GRAPH = 20
L2_BYTES = 50 * 2**20  # the H100's


def cycling(fns: list[Callable[[], torch.Tensor]]) -> Callable[[], torch.Tensor]:
    """A callable that runs the next of `fns` each call: the calls captured in a graph
    take weights in turn, as a step's layers do, so that their bytes come from memory (one
    weight called CALLS_PER_GRAPH times would be read from the L2 cache)."""
    state = {"i": 0}

    def call() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % len(fns)
        return fns[state["i"]]()
    return call


def time_cycled(launch: Callable, x: torch.Tensor, weights: list[torch.Tensor],
                *extra: object, replays: int = 5) -> float:
    """Microseconds per `launch(x, weight, *extra)`, the weights taken in turn."""
    return graph_time_us(cycling([partial(launch, x, w, *extra) for w in weights]),
                         replays=replays)


def graph_time_us(fn: Callable[[], torch.Tensor], replays: int = 20,
                  calls: int = CALLS_PER_GRAPH) -> float:
    """Median microseconds per call of `fn`, replayed in a CUDA graph of `calls`."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def gguf_blocks(rows: int, cols: int, qtype_name: str) -> torch.Tensor:
    import gguf_checkpoint

    rng = np.random.default_rng(0)
    return torch.from_numpy(gguf_checkpoint._random_blocks(rows, cols, qtype_name, rng)).cuda()


def cases(n: int, k: int, gguf_only: bool = False
          ) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """name -> (matmul of x, weight bytes as stored)."""
    from gguf import GGMLQuantizationType as Q

    from infer.kernels.gguf_matmul import gguf_matmul
    from infer.kernels.w8a16_matmul import w8a16_matmul

    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    out = {"bf16": (lambda x: F.linear(x, w16), w16.nbytes)}
    for name in ("Q4_K", "Q6_K", "Q8_0"):
        blocks = gguf_blocks(n, k, name)
        out[name] = (lambda x, b=blocks, q=Q[name]: gguf_matmul(x, b, q, k), blocks.nbytes)
        out[f"{name}-deq"] = (partial(_deq_of, blocks=blocks, qtype=Q[name], cols=k),
                              blocks.nbytes)
        # one row only: x rounded to int8 (its launch included), dp4a
        out[f"{name}-int8x"] = (partial(_int8x_of, blocks=blocks, cols=k, qtype=name),
                                blocks.nbytes)
    if gguf_only:
        return out
    w8 = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
    wf8 = (torch.randn(n, k, device="cuda") * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(n, device="cuda") * 1e-3
    tiles = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 1e-3
    out.update({
        "int8": (lambda x: w8a16_matmul(x, w8, scale.to(x.dtype)), w8.nbytes + n * 2),
        "fp8": (lambda x: w8a16_matmul(x, wf8, scale), wf8.nbytes + n * 4),
        "fp8-block": (lambda x: w8a16_matmul(x, wf8, tiles, (128, 128)),
                      wf8.nbytes + tiles.nbytes),
    })
    return out


def _int8x_of(x: torch.Tensor, *, blocks: torch.Tensor, cols: int, qtype: str,
              **launch) -> torch.Tensor:
    """The engine's one-row Q4_K / Q6_K / Q8_0 path with `gguf_int8_activations` (launch:
    its rule's unless given)."""
    from gguf import GGMLQuantizationType as Q

    from infer.kernels.gguf_gemv import row_words
    from infer.quantization.gguf_gpu import int8x_kernels

    rule, gemv = int8x_kernels()[Q[qtype]]
    words = row_words(blocks)
    return gemv(x, words, cols, **(launch or rule(len(words), cols, x.device)))


def int8x_sweep(copy_gbs: float) -> list[dict]:
    """The x-rounded Q4_K, Q6_K and Q8_0 kernels' launches at one row, per shape: rows a
    program, units (super-blocks; Q8_0 pairs of blocks) a step, K splits; weights cycled
    past L2, x rounded in each call (as the engine does a layer)."""
    from gguf import GGMLQuantizationType as Q

    from infer.kernels.int8_rows import quantize_x
    from infer.quantization.gguf_gpu import int8x_kernels

    results = []
    for (shape, n, k), (qtype, units) in itertools.product(
            SHAPES, (("Q4_K", (1, 2)), ("Q6_K", (2, 4)),  # Q6_K: an even number a step
                     ("Q8_0", (2, 4, 8)))):
        copies = [gguf_blocks(n, k, qtype)
                  for _ in range(max(1, -(-3 * L2_BYTES // (n * k * 9 // 16))))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        rule, _ = int8x_kernels()[Q[qtype]]
        chosen = rule(n, k, x.device)
        configs = [chosen] + [dict(block_n=b, units=u, split=s, num_warps=4)
                              for b, u, s in itertools.product((8, 16, 32, 64, 128), units,
                                                               (1, 2, 4, 8))]
        best = chosen_row = None
        for config in configs:
            try:
                us = graph_time_us(cycling([partial(_int8x_of, x, blocks=b, cols=k,
                                                    qtype=qtype, **config)
                                            for b in copies]), replays=5)
            except Exception as exc:  # a configuration that does not compile: skip it
                print(f"  {shape} {qtype} {config}: {exc!r}"[:200])
                continue
            row = dict(shape=shape, kernel=f"{qtype}-int8x", **config, us=us,
                       frac_copy=copies[0].nbytes / us / 1e3 / copy_gbs,
                       chosen=config is chosen)
            results.append(row)
            chosen_row = chosen_row or row
            if best is None or us < best["us"]:
                best = row
        x_us = graph_time_us(partial(quantize_x, x), replays=5)
        print(f"[int8x sweep] {shape} {qtype}: chosen {chosen_row and chosen_row['us']} us, "
              f"best {best}; rounding x alone {x_us:.1f} us", flush=True)
        del copies
        torch.cuda.empty_cache()
    return results


def _deq_of(x: torch.Tensor, *, blocks: torch.Tensor, qtype, cols: int) -> torch.Tensor:
    return dequantized_matmul(x, blocks, qtype, cols)


def dequantized_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype, cols: int) -> torch.Tensor:
    """The engine's path above its fused rows: the layer dequantized, then cuBLAS."""
    from infer.kernels.gguf_matmul import gguf_dequantize

    return F.linear(x, gguf_dequantize(blocks, qtype, cols, x.dtype))


GEMM_CONFIGS = [dict(block_n=b, num_warps=w) for b, w in ((32, 4), (64, 4), (64, 8), (128, 8))]
# Beside gemm_launch's choice: two units a step, 128 rows of W a program (8 warps), 32;
# and twice its splits of K.
GEMM_VARIANTS = [dict(units=2), dict(block_n=128, num_warps=8), dict(block_n=32)]


def gemm_sweep(rows_list: list[int], args: argparse.Namespace, payload: dict) -> list[dict]:
    """The few-row GGUF kernel's launches at each of `rows_list`, per shape and type:
    gguf_matmul's choice and GEMM_VARIANTS of it (with `--gemm-grid` also GEMM_CONFIGS, K
    split 1, 2, 4 while the programs stay under 2 per multiprocessor), beside bf16 and
    dequantize-then-cuBLAS; weights cycled past L2. Written after every shape."""
    from gguf import GGMLQuantizationType as Q

    from infer.kernels import gguf_matmul as kernel
    from infer.kernels import gluon_hopper
    from infer.kernels.gguf_gemm import gemm_launch

    results = payload.setdefault("gemm_sweep", [])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    order = ["gate_up", "qkv", "down", "o", "lm_head"]
    for shape, n, k in sorted(SHAPES, key=lambda s: order.index(s[0])):
        copies = max(1, -(-3 * L2_BYTES // (n * k)))
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            us = graph_time_us(cycling([partial(F.linear, x, w) for w in w16]), replays=5)
            results.append(dict(shape=shape, rows=rows, qtype="bf16", us=us))
        del w16
        for name in ("Q4_K", "Q6_K", "Q8_0"):
            blocks = [gguf_blocks(n, k, name) for _ in range(max(1, copies // 3))]
            q = Q[name]
            for rows in rows_list:
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                timed = {}
                deq = cycling([partial(dequantized_matmul, x, b, q, k) for b in blocks])
                timed["deq"] = graph_time_us(deq, replays=5)
                chosen = gemm_launch(q, rows, n, k, x.device)
                configs = [chosen] + [dict(chosen, **c) for c in GEMM_VARIANTS]
                configs.append(dict(chosen, split=2 * chosen["split"]))
                if args.gemm_grid:
                    configs += [dict(c, split=s) for c in GEMM_CONFIGS for s in (1, 2, 4)
                                if s == 1 or -(-n // c["block_n"]) * s <= 2 * sms]
                configs = [c for i, c in enumerate(configs) if c not in configs[:i]]
                for config in configs:
                    try:
                        us = graph_time_us(cycling([partial(kernel._gemm, x, b, q, k, **config)
                                                    for b in blocks]), replays=5)
                    except Exception as exc:  # a launch that does not compile: skip it
                        print(f"  {shape} {name} {rows} {config}: {exc!r}"[:300], flush=True)
                        continue
                    label = "chosen" if config is chosen else str(config)
                    timed[label] = us
                    results.append(dict(shape=shape, rows=rows, qtype=name, **config, us=us,
                                        GBps=blocks[0].nbytes / us / 1e3, chosen=config is chosen))
                if q in (Q.Q4_K, Q.Q6_K) and gluon_hopper(x.device, "gguf_wgmma"):
                    from infer.kernels.gguf_gemm import gemm_words
                    from infer.kernels.gguf_wgmma import default_split, gguf_wgmma

                    rule = default_split(rows, n, k, x.device)
                    for split in sorted({max(1, rule // 2), rule, 2 * rule}):
                        us = graph_time_us(cycling([partial(gguf_wgmma, x, gemm_words(b, q, k),
                                                            q, k, split=split) for b in blocks]),
                                           replays=5)
                        timed[f"wgmma split {split}"] = us
                        results.append(dict(shape=shape, rows=rows, qtype=name,
                                            kernel="gguf_wgmma", split=split, us=us,
                                            GBps=blocks[0].nbytes / us / 1e3))
                results.append(dict(shape=shape, rows=rows, qtype=name, kernel="deq",
                                    us=timed["deq"]))
                bf16 = next(r["us"] for r in results if r["shape"] == shape
                            and r["rows"] == rows and r["qtype"] == "bf16")
                best = min((v, c) for c, v in timed.items() if c not in ("deq",))
                print(f"[gemm] {shape} {name} rows {rows}: bf16 {bf16:.1f} deq {timed['deq']:.1f}"
                      f" chosen {timed.get('chosen', float('nan')):.1f} best {best[0]:.1f} "
                      f"{best[1]}", flush=True)
            del blocks
            torch.cuda.empty_cache()
        common.write_results("quantized_gemv", args, payload)
    return results


def sweep(copy_gbs: float) -> list[dict]:
    """Launch configurations at one row, per shape and type: for Q4_K and Q6_K the one-row
    kernel (gguf_gemv.py) beside the generic kernel at its own launch (the path one row
    took before) and gguf_matmul's choice; for Q8_0 (the generic kernel's) the generic
    kernel's. Also the `x` layout kernel of gguf_gemv alone."""
    from gguf import GGMLQuantizationType as Q

    from infer.kernels import gguf_matmul as kernel
    from infer.kernels.gguf_gemv import gemv_launch, gemv_x

    results = []
    for (shape, n, k), name in itertools.product(SHAPES, ("Q4_K", "Q6_K", "Q8_0")):
        blocks = gguf_blocks(n, k, name)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        configs = [dict(block_n=8, units=2, split=1, gemv=False)]
        if name == "Q8_0":
            configs += [dict(block_n=b, units=u, num_warps=w, split=1, gemv=False)
                        for b, u, w in ((16, 2, 4), (32, 2, 4), (16, 4, 4), (32, 1, 4),
                                        (16, 2, 8), (32, 2, 8), (64, 2, 8))]
        else:
            chosen = gemv_launch(Q[name], n, k, x.device)
            configs.append(chosen)
            configs += [dict(block_n=b, units=1, num_warps=w, maxnreg=r, split=s)
                        for (b, w, r), s in itertools.product(
                            ((128, 4, None), (128, 4, 128), (64, 4, None), (256, 8, 128)),
                            (1, 2, 4, 8, 16))
                        if n * s < 300000 and s <= k // 256]
        best = None
        for config in configs:
            try:
                us = graph_time_us(partial(kernel._matmul, x, blocks, Q[name], k, **config),
                                   replays=5)
            except Exception as exc:  # a configuration that does not compile: skip it
                print(f"  {shape} {name} {config}: {exc!r}"[:200])
                continue
            row = dict(shape=shape, qtype=name, **config, us=us,
                       GBps=blocks.nbytes / us / 1e3, frac_copy=blocks.nbytes / us / 1e3 / copy_gbs)
            results.append(row)
            if best is None or us < best["us"]:
                best = row
            if config is configs[1] and name != "Q8_0":
                chosen = row
        first = next(r for r in results if r["shape"] == shape and r["qtype"] == name)
        line = f"[sweep] {shape} {name}: generic {first['us']:.1f} us"
        if name != "Q8_0":
            xs_us = graph_time_us(partial(gemv_x, x, Q[name], k), replays=5)
            results.append(dict(shape=shape, qtype=name, kernel="gemv_x", us=xs_us))
            line += f", chosen {chosen['us']:.1f} us (split {chosen['split']}), x layout " \
                    f"{xs_us:.1f} us"
        print(f"{line}; best {best}", flush=True)
        del blocks
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-only", action="store_true", help="the sweep, no table")
    parser.add_argument("--gemm-sweep", action="store_true",
                        help="the few-row GGUF kernel's launches at --rows (first, no table)")
    parser.add_argument("--gemm-grid", action="store_true",
                        help="--gemm-sweep: also the grid of GEMM_CONFIGS and splits")
    parser.add_argument("--gguf-only", action="store_true", help="table: bf16 and GGUF only")
    parser.add_argument("--int8x-sweep", action="store_true",
                        help="the launches of Q4_K, Q6_K and Q8_0 with x rounded to int8 "
                        "(first, no table)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("quantized_gemv.py times CUDA kernels: no GPU here")
    ceil = common.ceilings()
    payload: dict = {"ceilings": ceil}
    if args.gemm_sweep:
        gemm_sweep(args.rows, args, payload)
        return
    if args.int8x_sweep:
        payload["int8x_sweep"] = int8x_sweep(ceil["copy_GBps"])
        common.write_results("quantized_gemv", args, payload)
        return
    rows_out: list[dict] = []
    payload["rows"] = rows_out
    for shape, n, k in SHAPES * (not args.sweep_only):
        copies = [cases(n, k, args.gguf_only)
                  for _ in range(max(1, -(-3 * L2_BYTES // (n * k))))]
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            bf16_us = None
            for name, (_, weight_bytes) in copies[0].items():
                if name.endswith("-int8x") and rows > 1:
                    continue
                us = graph_time_us(cycling([partial(case[name][0], x) for case in copies]))
                bf16_us = us if name == "bf16" else bf16_us
                moved = weight_bytes + x.nbytes + rows * n * 2
                rows_out.append(dict(shape=shape, n=n, k=k, rows=rows, kernel=name, us=us,
                                     GBps=moved / us / 1e3,
                                     frac_copy=moved / us / 1e3 / ceil["copy_GBps"],
                                     speedup_vs_bf16=bf16_us / us))
            common.write_results("quantized_gemv", args, payload)
        del copies
        torch.cuda.empty_cache()
    rows_out.sort(key=lambda r: (SHAPES.index((r["shape"], r["n"], r["k"])), r["rows"]))
    common.write_results("quantized_gemv", args, payload)
    common.print_table("quantized matmuls, Llama-3.1-8B shapes (us per call in a CUDA graph)",
                       rows_out, [("shape", "shape", ""), ("rows", "rows", ""),
                                  ("kernel", "kernel", ""), ("us", "us", ".1f"),
                                  ("GB/s", "GBps", ".0f"), ("%copyBW", "frac_copy", ".0%"),
                                  ("x bf16", "speedup_vs_bf16", ".2f")])
    if args.sweep or args.sweep_only:
        payload["sweep"] = sweep(ceil["copy_GBps"])
        common.write_results("quantized_gemv", args, payload)


if __name__ == "__main__":
    main()
