"""Where a decode step's time goes: wall time per engine step vs the GPU time of the
forward (graph replay or eager) and of sampling, plus the host functions that cost most
(cProfile). Random weights in a real shape, greedy, ignore_eos.

With --chain, the step's kernels in order (torch.profiler over 48 steps, medians): what
each adds to the step, from the end of the kernel before it to its own end. With
dependent launch a kernel starts before the one before it ends, so its own duration
overstates it; the increments add up to the step. Printed for one layer in the middle
and summed by kernel name.

    PYTHONPATH=src python benchmarks/profile_decode.py [--shape llama-3.2-1b] [--batch 1]
        [--kernels] [--chain] [--gguf Q4_K_M] [--engine NAME=VALUE ...]

--gguf serves the shape as a random GGUF file of that mix (gguf_checkpoint.py; add
`--engine quantization=gguf` to keep its blocks).
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
import gguf_checkpoint


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
    parser.add_argument("--chain", action="store_true",
                        help="also print each kernel's increment of the step, in order")
    parser.add_argument("--kernels", action="store_true",
                        help="also print the GPU kernels' share of the decode steps "
                             "(torch.profiler)")
    parser.add_argument("--gguf", choices=gguf_checkpoint.MIXES, default=None,
                        help="serve the shape as a random GGUF file of this mix")
    common.add_common_args(parser)
    args = parser.parse_args()
    from infer import SamplingParams

    path = common.get_checkpoint(args.shape, args.tiny, args.ckpt_root) if args.gguf is None \
        else gguf_checkpoint.get_gguf(args.shape, args.gguf, args.tiny, args.ckpt_root)
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
    if args.chain:
        for i, p in enumerate(prompts):
            engine.add_request(f"c{i}", [t + 3 for t in p], params)
        prefill(engine)
        print_chain(engine)


def print_chain(engine, steps: int = 48) -> None:
    """The kernels of `steps` decode steps in order; per position in a step, the median
    increment (end minus the end of the kernel before it)."""
    import statistics
    from collections import Counter, defaultdict

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA)
    names = [name for _, _, name in kernels]
    # a step starts at the first kernel of it that runs once a step
    once = [n for n, count in Counter(names).items() if abs(count - steps) <= 2]
    first = min(once, key=names.index)
    runs, run = [], []
    for kernel in kernels:
        if kernel[2] == first and run:
            runs.append(run)
            run = []
        run.append(kernel)
    length = Counter(len(r) for r in runs).most_common(1)[0][0]
    runs = [r for r in runs if len(r) == length][1:]
    chain = [(runs[0][i][2], statistics.median(r[i][1] - (r[i - 1][1] if i else r[i][0])
                                               for r in runs)) for i in range(length)]
    wall = statistics.median(r[-1][1] - r[0][0] for r in runs)
    print(f"\n{length} kernels a step, {wall:.1f} us from the first's start to the last's "
          f"end (median of {len(runs)} steps); increments in us:")
    rope = [i for i, (name, _) in enumerate(chain) if "rope" in name]
    if len(rope) > 2:  # one layer in the middle, from its first norm
        mid, period = rope[len(rope) // 2], rope[1] - rope[0]
        for name, us in chain[mid - 2:mid - 2 + period]:
            print(f"  {us:7.2f}  {name[:80]}")
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, us in chain:
        totals[name][0] += 1
        totals[name][1] += us
    for name, (count, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {count:4d} x {us / count:7.2f} = {us:8.1f}  {name[:70]}")


if __name__ == "__main__":
    main()
