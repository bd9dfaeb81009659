"""The sampler on the GPU: one temperature-sampled token per row of logits, through the
fused race kernel (`sample`, what the engine runs on CUDA) and through the torch path it
replaces (temperature, noise tensor, clamp, log, subtract, argmax), unseeded and seeded
rows, at the batch x vocabulary sizes of the throughput and decode benchmarks. The logits
are float32, as the model's `compute_logits` hands them to the sampler (`--dtype bf16`:
the LM head's own output).
Time per call with the host's launches in it (50 calls, one sync), and the fused call
against the time to read the logits once at the copy bandwidth measured in the same run.

    PYTHONPATH=src python benchmarks/sampling.py

Prints a table; writes benchmarks/results/sampling_<device>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

SHAPES = [(256, 151936), (32, 128256), (1, 128256)]  # Qwen3 throughput, Llama-3 decode
CALLS = 50


def _per_call_ms(fn) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results-dir", default=str(common.RESULTS))
    p.add_argument("--suffix", default="")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.set_defaults(tiny=False)
    args = p.parse_args()
    from infer.engine.sampler import SamplingBatch, _race, filter_logits, sample
    from infer.sampling_params import SamplingParams

    copy_gbs = common.copy_bandwidth_gbs()
    rows = []
    for b, v in SHAPES:
        dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
        logits = torch.randn(b, v, device="cuda", dtype=dtype)
        kinds = {"unseeded": [SamplingParams(temperature=0.6)] * b,
                 "seeded": [SamplingParams(temperature=0.8, seed=i) for i in range(b)]}
        for kind, params in kinds.items():
            batch = SamplingBatch.build(params, [[]] * b, [[]] * b, v, "cuda")
            torch_ms = _per_call_ms(lambda x=logits, batch=batch: _race(
                filter_logits(x.float(), batch), batch))
            fused_ms = _per_call_ms(lambda x=logits, batch=batch: sample(x, batch).token_ids)
            read_ms = logits.numel() * logits.element_size() / copy_gbs / 1e6
            rows.append({"batch": b, "vocab": v, "dtype": args.dtype, "rows": kind,
                         "torch_path_ms": torch_ms,
                         "fused_ms": fused_ms, "speedup": torch_ms / fused_ms,
                         "logits_read_at_copy_bw_ms": read_ms})
    print(f"copy bandwidth {copy_gbs:,.0f} GB/s\n| batch x vocab | rows | torch path ms | "
          "fused ms | speed-up | one read of the logits ms |\n|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} x {r['vocab']:,} | {r['rows']} | {r['torch_path_ms']:.3f} "
              f"| {r['fused_ms']:.3f} | {r['speedup']:.2f}x "
              f"| {r['logits_read_at_copy_bw_ms']:.3f} |")
    common.write_results("sampling", args, {"copy_gbs": copy_gbs, "rows": rows})


if __name__ == "__main__":
    main()
