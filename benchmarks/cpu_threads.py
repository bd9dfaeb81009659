"""Decode speed on the CPU by torch thread count, alone and beside one busy process: what
EngineConfig.threads' default rests on. The embedded SmolLM2 (or --model), greedy,
`ignore_eos`, batch 1 and 8.

    python benchmarks/cpu_threads.py [--threads 1 2] [--output-len 48]

Prints one table and writes benchmarks/results/cpu_threads_<device>.json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--output-len", type=int, default=48)
    common.add_common_args(p)
    args = p.parse_args()
    import torch

    from infer import LLM, SamplingParams

    llm = LLM(args.model, device="cpu", threads=min(args.threads),
              **common.parse_engine_flags(args.engine))
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)

    def rate(batch: int) -> float:
        llm.generate(["Hello"] * batch, SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(["Once upon a time"] * batch, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    rows = []
    for busy in (False, True):
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            for threads in args.threads:
                torch.set_num_threads(threads)
                for batch in args.batches:
                    rows.append({"busy_neighbour": busy, "threads": threads, "batch": batch,
                                 "tok_per_s": rate(batch)})
                    common.write_results("cpu_threads", args, {"rows": rows})
        finally:
            if hog is not None:
                hog.kill()
    print("| threads | batch | tok/s alone | tok/s beside a busy process |\n|---:|---:|---:|---:|")
    for r in rows:
        if not r["busy_neighbour"]:
            busy = next(b for b in rows if b["busy_neighbour"] and b["threads"] == r["threads"]
                        and b["batch"] == r["batch"])
            print(f"| {r['threads']} | {r['batch']} | {r['tok_per_s']:.1f} "
                  f"| {busy['tok_per_s']:.1f} |")


if __name__ == "__main__":
    main()
