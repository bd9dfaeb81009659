"""Where a decode step's time goes: wall time per engine step vs the GPU time of the
forward (graph replay or eager) and of sampling, plus the host functions that cost most
(cProfile). Random weights in a real shape, greedy, ignore_eos.

    PYTHONPATH=src python benchmarks/profile_decode.py [--shape llama-3.2-1b] [--batch 1]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def prefill(engine) -> None:
    """Step until every request has its prompt in the cache (only decodes remain)."""
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                   for r in scheduler.running):
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--kernels", action="store_true",
                        help="also print the GPU kernels' share of the decode steps "
                             "(torch.profiler)")
    common.add_common_args(parser)
    args = parser.parse_args()
    from infer import SamplingParams

    path = common.get_checkpoint(args.shape, args.tiny, args.ckpt_root)
    flags = {"max_model_len": args.prompt_len + args.steps + 64,
             "max_num_seqs": max(64, args.batch), **common.parse_engine_flags(args.engine)}
    llm, _ = common.build_llm(path, flags)
    engine, runner = llm.engine, llm.engine.runner
    gpu_ms: list[float] = []
    forward, sample_logits = runner.forward, runner.sample_logits
    started: list[torch.cuda.Event] = []

    def timed_forward(inputs, device_input_ids=None):  # the step's GPU time: forward ...
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        started.append(start)
        return forward(inputs, device_input_ids)

    def timed_sample_logits(hidden, inputs):  # ... to the LM head's end
        out = sample_logits(hidden, inputs)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        gpu_ms.append((started.pop(), end))
        return out

    runner.forward, runner.sample_logits = timed_forward, timed_sample_logits
    host_ms: dict[str, list[float]] = {"_launch_ahead": [], "_finish": []}

    def timed(name):  # host time of a core method (async: does launching ever block?)
        method = getattr(engine.core, name)

        def wrapper(*a, **kw):
            start = time.perf_counter()
            out = method(*a, **kw)
            host_ms[name].append((time.perf_counter() - start) * 1e3)
            return out
        setattr(engine.core, name, wrapper)

    for name in host_ms:
        timed(name)
    vocab = engine.model_config.vocab_size
    prompts = [[(11 * i + j) % vocab for j in range(args.prompt_len)]
               for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", [t + 1 for t in p], params)
    prefill(engine)
    gpu_ms.clear()
    for times in host_ms.values():
        times.clear()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    steps, start = 0, time.perf_counter()
    profiler.enable()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    profiler.disable()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps * 1e3
    gpu_step = sum(s.elapsed_time(e) for s, e in gpu_ms) / len(gpu_ms)
    print(f"{args.shape} batch {args.batch}: {steps} decode steps, {wall:.3f} ms/step wall, "
          f"{gpu_step:.3f} ms/step GPU in forward + LM head, "
          f"graphs={runner.graphs is not None}")
    for name, times in host_ms.items():
        times = sorted(times)
        print(f"  host {name}: median {times[len(times) // 2]:.3f} ms, "
              f"mean {sum(times) / len(times):.3f} ms over {len(times)} calls")
    stats = engine.stats()
    print(f"  steps launched ahead: {stats['num_steps_launched_ahead']} of {stats['num_steps']}")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile

        for i, p in enumerate(prompts):
            engine.add_request(f"k{i}", [t + 2 for t in p], params)
        prefill(engine)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(32):
                engine.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15,
                                        max_name_column_width=60))


if __name__ == "__main__":
    main()
