"""What a step that carries prompt tokens costs, by how it runs (`mixed_step_graphs`: off,
piecewise, full): `--decodes` sequences decoding, then one long prompt arrives and goes
in chunks of `--chunk` tokens beside them. Each step is timed with a device sync around
it; one more round runs under torch.profiler to sum the step's kernel time, so a
host-bound step shows as wall >> kernels.

    python benchmarks/mixed_steps.py [--modes off piecewise full] [--chunks 512 2048]

Prints one table and writes benchmarks/results/mixed_steps_<device>.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def _timed_step(engine) -> float:
    common.sync()
    t = time.perf_counter()
    engine.step()
    common.sync()
    return (time.perf_counter() - t) * 1e3


def _kernel_ms(engine, steps: int) -> float | None:
    """Mean kernel time of the next `steps` steps (None without a GPU)."""
    if not torch.cuda.is_available():
        return None
    common.sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        common.sync()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default="llama-3.2-1b")
    p.add_argument("--modes", nargs="+", default=["off", "piecewise", "full"])
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--decodes", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    common.add_common_args(p)
    args = p.parse_args()
    from infer import SamplingParams
    from infer.engine.llm_engine import LLMEngine

    if args.tiny:
        args.decodes, args.prompt_len, args.chunks = 2, 40, [16]
    path = common.get_checkpoint(args.model_shape, args.tiny, args.ckpt_root)
    vocab = common.load_shape(args.model_shape, args.tiny)["vocab_size"]
    rng = random.Random(0)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0)
    rows = []
    for chunk in args.chunks:
        for mode in args.modes:
            common.free_memory()
            flags = {"max_num_seqs": 256, "prefill_chunk_size": chunk, "prefix_caching": False,
                     "max_model_len": args.prompt_len + 1024, "mixed_step_graphs": mode,
                     **common.parse_engine_flags(args.engine)}
            engine = LLMEngine(model=str(path), **flags)
            decode, mixed, kernels = [], [], None
            chunks = -(-args.prompt_len // chunk)
            for r in range(args.rounds + 2):  # round 0 warms up, the last is profiled
                ids = [f"d{r}-{i}" for i in range(args.decodes)]
                for rid in ids:
                    engine.add_request(rid, [rng.randrange(10, vocab) for _ in range(100)],
                                       params)
                for _ in range(10):
                    engine.step()
                if 0 < r <= args.rounds:
                    decode += [_timed_step(engine) for _ in range(10)]
                engine.add_request(f"long{r}", [rng.randrange(10, vocab)
                                                for _ in range(args.prompt_len)], params)
                engine.step()  # the step launched ahead of the prompt's arrival
                if r <= args.rounds:
                    times = [_timed_step(engine) for _ in range(chunks)]
                    mixed += times if r else []
                else:
                    kernels = _kernel_ms(engine, chunks)
                for rid in [*ids, f"long{r}"]:
                    engine.abort_request(rid)
                while engine.has_unfinished_requests():
                    engine.step()
            rows.append({"chunk": chunk, "mode": mode, "decode_ms": statistics.median(decode),
                         "mixed_ms": statistics.median(mixed), "mixed_all_ms": mixed,
                         "mixed_kernel_ms": kernels,
                         "capture_s": engine.info.graph_capture_seconds})
            print(f"[{mode} chunk {chunk}] mixed step {rows[-1]['mixed_ms']:.2f} ms "
                  f"(kernels {common.fmt(kernels, '.2f')})", flush=True)
            common.write_results("mixed_steps", args, {"rows": rows})
            engine.shutdown()
            del engine
    common.print_table(
        f"Steps with a {args.prompt_len}-token prompt's chunk beside {args.decodes} decodes "
        f"({args.model_shape}, medians of {args.rounds} rounds)", rows,
        [("chunk", "chunk", "d"), ("mixed_step_graphs", "mode", "s"),
         ("decode step ms", "decode_ms", ".2f"), ("mixed step ms", "mixed_ms", ".2f"),
         ("its kernels ms", "mixed_kernel_ms", ".2f"), ("capture s", "capture_s", ".1f")])


if __name__ == "__main__":
    main()
