"""Offline throughput, nano-vllm's protocol: infer vs HF transformers continuous batching.

Workload (as nano-vllm's bench.py): `random.seed(0)`; 256 sequences; for each, a prompt
of randint(100, 1024) token ids drawn with randint(0, 10000); then, for each, an output
length randint(100, 1024); ignore_eos, so every sequence produces exactly its length.
Sampling is greedy by default (nano-vllm samples at temperature 0.6; pass
`--temperature 0.6` for that; both engines then sample, HF with top_k=0, top_p=1).
Shapes qwen3-0.6b and llama-3.2-1b, random weights, bf16 on a GPU. `--num-seqs` shrinks
the run; `--max-input/--max-output` shorten the sequences for quick runs (recorded).

All infer runs go first, then the HF peer runs (on --peer-models, default all).
infer runs `LLM.generate` on all prompts at once after a short warm-up; by default the
script lets the whole batch run together (max_num_seqs = number of sequences, 16384
tokens per step as in nano-vllm, max_model_len = longest prompt + output); --engine flags
override these, and --llm-defaults drops them (what `LLM(model)` chooses). The HF peer
is `model.continuous_batching_context_manager` (the machinery
behind `generate_batch`), with per-request max_new_tokens and eos_token_id=-1 (never
stops early), timed from the first add_request until the last result (its CUDA-graph
warm-up, done before, is reported apart). If this transformers has no continuous
batching, the peer row says so and no ratio is given.

Roofline (an estimate, to show how far each engine is from the memory floor): the same
workload is replayed through an idealised scheduler, step by step: at most max_num_seqs
running, FIFO admission, every running sequence that has finished its prompt decodes one
token per step, and prompt tokens fill the rest of the max_num_batched_tokens budget
(chunked). Each step reads
  - every weight once: (all parameters but the embedding table, plus the LM head) x dtype
    bytes, a tied embedding counted once as the LM head;
  - the KV cache of every scheduled token's context: 2 x layers x kv_heads x head_dim x
    dtype bytes x (tokens already cached for that sequence);
and the bytes roofline is sum(step bytes) / measured copy bandwidth. "% bytes roofline" =
that time / measured time. A second estimate, sum over steps of max(bytes / copy BW,
FLOPs / matmul rate) with FLOPs = 2 x step-weight params x tokens + attention, is shown as
"% roofline" (large batches and prefill are compute-bound, so this one is the tighter).
Neither counts sampling, the host, or activation traffic.

    PYTHONPATH=src python benchmarks/throughput.py [--num-seqs 64] [--engine k=v ...]
        [--step-timeline]   # infer's steps bucketed by sequences served: where time goes
        [--gpu-busy]        # the run again, kernels traced: GPU busy vs waiting for the host
    python benchmarks/throughput.py --tiny
"""

from __future__ import annotations

import argparse
import inspect
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def workload(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py draw order: all prompts first, then all output lengths."""
    rng = random.Random(args.seed)
    top = min(10000, vocab - 1)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(args.min_input, args.max_input))]
               for _ in range(args.num_seqs)]
    outputs = [rng.randint(args.min_output, args.max_output) for _ in range(args.num_seqs)]
    return prompts, outputs


def roofline(prompt_lens: list[int], out_lens: list[int], max_seqs: int, budget: int,
             counts: common.ShapeCounts, nbytes: int, ceil: dict) -> dict:
    """Replay the workload through the idealised scheduler of the module docstring."""
    w_bytes = counts.step_weight_params * nbytes
    kv_tok = counts.kv_bytes_per_token(nbytes)
    bw = ceil["copy_GBps"] * 1e9
    rate = ceil["matmul_TFLOPs"] * 1e12
    waiting = list(range(len(prompt_lens)))
    waiting.reverse()
    running: list[list[int]] = []  # [seq, prompt tokens done, tokens generated]
    steps = t_bytes = t_max = total_bytes = 0.0
    while waiting or running:
        while waiting and len(running) < max_seqs:
            running.append([waiting.pop(), 0, 0])
        left = budget
        kv_read = flops = 0.0
        for item in running:  # decodes first
            seq, done, gen = item
            if done == prompt_lens[seq] and left > 0:
                kv_read += done + gen
                flops += counts.attn_flops(1, done + gen + 1)
                item[2] += 1
                left -= 1
        for item in running:  # then prompt chunks
            seq, done, gen = item
            if done < prompt_lens[seq] and left > 0:
                n = min(prompt_lens[seq] - done, left)
                kv_read += done
                flops += counts.attn_flops(n, done + (n + 1) / 2)
                item[1] += n
                left -= n
                if item[1] == prompt_lens[seq]:
                    item[2] += 1  # the prompt's last step samples the first token
        tokens = budget - left
        flops += 2.0 * counts.step_weight_params * tokens
        step_bytes = w_bytes + kv_read * kv_tok
        total_bytes += step_bytes
        t_bytes += step_bytes / bw
        t_max += max(step_bytes / bw, flops / rate)
        steps += 1
        running = [it for it in running if it[2] < out_lens[it[0]]]
    return dict(steps=int(steps), bytes_GB=total_bytes / 1e9, roofline_bytes_s=t_bytes,
                roofline_max_s=t_max)


def record_steps(llm) -> list[list[tuple[float, int]]]:
    """Per `generate` call, each core step's wall time and how many sequences got tokens
    in it (their outputs), filled in as the engine steps."""
    core, calls = llm.engine.core, []
    step, generate = core.step, llm.generate

    def timed_step():
        t = time.perf_counter()
        outputs = step()
        calls[-1].append((time.perf_counter() - t, len(outputs)))
        return outputs

    def timed_generate(*args, **kwargs):
        calls.append([])
        return generate(*args, **kwargs)

    core.step, llm.generate = timed_step, timed_generate
    return calls


BUCKETS = [(0, 0), (1, 8), (9, 32), (33, 64), (65, 128), (129, 192), (193, 256),
           (257, 1 << 30)]  # sequences that got tokens in a step, inclusive
TIMELINE_COLUMNS = [("sequences", "sequences", ""), ("steps", "steps", "d"),
                    ("seconds", "seconds", ".2f"), ("ms/step", "ms_per_step", ".2f"),
                    ("tokens", "tokens", "d"), ("share of time", "share", ".1%")]


def timeline(calls: list[list[tuple[float, int]]]) -> list[dict]:
    """The timed call's steps in buckets of how many sequences got a token."""
    steps = [s for call in calls for s in call]
    total = sum(dt for dt, _ in steps) or 1.0
    rows = []
    for lo, hi in BUCKETS:
        inside = [(dt, n) for dt, n in steps if lo <= n <= hi]
        if inside:
            seconds = sum(dt for dt, _ in inside)
            label = str(lo) if lo == hi else f"{lo}-{hi}" if hi < BUCKETS[-1][1] else f">= {lo}"
            rows.append(dict(sequences=label,
                             steps=len(inside), seconds=seconds,
                             ms_per_step=seconds / len(inside) * 1e3,
                             tokens=sum(n for _, n in inside), share=seconds / total))
    return rows


def gpu_busy(llm, prompts, outs, temperature) -> dict:
    """The same `generate` once more, its kernels traced (CUPTI, no host-side op
    recording): how long the GPU ran any kernel (the union of their spans) against the
    call's wall time; the rest it waited for the host."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        seconds = run_infer(llm, prompts, outs, temperature)["seconds"]
    spans = sorted((e.start_ns(), e.start_ns() + e.duration_ns())
                   for e in prof.profiler.kineto_results.events()
                   if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0)
    busy_ns, end = 0, None
    for lo, hi in spans:
        if end is None or lo > end:
            busy_ns, end = busy_ns + hi - lo, hi
        elif hi > end:
            busy_ns, end = busy_ns + hi - end, hi
    first, last = (spans[0][0], max(hi for _, hi in spans)) if spans else (0, 0)
    return {"wall_s": seconds, "gpu_busy_s": busy_ns / 1e9,
            "gpu_span_s": (last - first) / 1e9, "kernels": float(len(spans))}


def run_infer(llm, prompts, outs, temperature) -> dict:
    from infer.bench.offline import time_generate

    result = time_generate(llm, prompts, outs, temperature)
    produced = result["output_tokens"]
    assert produced == sum(outs), (produced, sum(outs))
    return dict(engine="infer", seconds=result["seconds"], output_tokens=produced)


def run_hf_cb(path: Path, dtype, prompts, outs, temperature) -> dict:
    """HF continuous batching, per-request lengths; a row with 'error' if unavailable."""
    import transformers
    from transformers import GenerationConfig

    model = common.load_hf(path, dtype)
    if not hasattr(model, "continuous_batching_context_manager"):
        return dict(engine="hf-cb", error="transformers "
                    f"{transformers.__version__} has no continuous batching")
    gen_kwargs: dict = dict(max_new_tokens=max(outs), eos_token_id=-1, pad_token_id=0)
    if temperature > 0:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        gen_kwargs.update(do_sample=False)
    config = GenerationConfig(**gen_kwargs)
    cm_kwargs: dict = dict(generation_config=config, block=True, timeout=30)
    cm_params = inspect.signature(model.continuous_batching_context_manager).parameters
    if "workload_hints" in cm_params:
        try:
            from transformers.generation.continuous_batching.utils import WorkloadHints

            cm_kwargs["workload_hints"] = WorkloadHints(
                max_prompt_length=max(len(p) for p in prompts),
                max_generated_length=max(outs), num_requests=len(prompts))
        except Exception as exc:  # hints are optional
            print(f"[hf] no workload hints: {exc}", flush=True)
    t0 = time.perf_counter()
    results = {}
    with model.continuous_batching_context_manager(**cm_kwargs) as manager:
        warm_s = time.perf_counter() - t0
        common.sync()
        t = time.perf_counter()
        want = {}
        for p, n in zip(prompts, outs):
            rid = manager.add_request(p, max_new_tokens=n, eos_token_id=-1)
            want[rid] = n
        while len(results) < len(want):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
            elif r is None and not manager.is_running():
                break
        common.sync()
        dt = time.perf_counter() - t
    errors = [r.error for r in results.values() if getattr(r, "error", None)]
    produced = sum(len(r.generated_tokens) for r in results.values())
    row = dict(engine="hf-cb", seconds=dt, output_tokens=produced, hf_warmup_s=warm_s)
    if len(results) < len(want) or errors or produced != sum(outs):
        row["error"] = (f"{len(results)}/{len(want)} finished, {produced}/{sum(outs)} tokens, "
                        f"errors {errors[:3]}")
    del model
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.2-1b"])
    parser.add_argument("--num-seqs", type=int, default=None, help="default 256 (tiny 8)")
    parser.add_argument("--min-input", type=int, default=None, help="default 100 (tiny 8)")
    parser.add_argument("--max-input", type=int, default=None, help="default 1024 (tiny 32)")
    parser.add_argument("--min-output", type=int, default=None, help="default 100 (tiny 8)")
    parser.add_argument("--max-output", type=int, default=None, help="default 1024 (tiny 32)")
    parser.add_argument("--peer-models", nargs="+", default=None,
                        help="models the HF peer runs on (default: all of --models)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-timeline", action="store_true",
                        help="time each engine step of infer's run and print them bucketed "
                        "by how many sequences got a token (where a run's time goes)")
    parser.add_argument("--gpu-busy", action="store_true",
                        help="then run infer's workload again with its kernels traced: how "
                        "much of the run the GPU was busy (the rest it waited for the host)")
    parser.add_argument("--llm-defaults", action="store_true",
                        help="LLM(model) as it comes (no sizing flags of this script's; "
                        "--engine flags still apply)")
    args = parser.parse_args()
    tiny = args.tiny
    for name, full, small in (("num_seqs", 256, 8), ("min_input", 100, 8),
                              ("max_input", 1024, 32), ("min_output", 100, 8),
                              ("max_output", 1024, 32)):
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else full)
    user_flags = common.parse_engine_flags(args.engine)
    common.setup_cpu_threads()
    ceil = common.ceilings()
    rows: list[dict] = []
    out = None

    def save() -> None:
        nonlocal out
        out = common.write_results("throughput", args, {"ceilings": ceil, "rows": rows})

    def finish(row: dict, base: dict) -> dict:
        row = {**base, **row}
        if "error" not in row:
            row["tok_per_s"] = row["output_tokens"] / row["seconds"]
            row["frac_bytes_roofline"] = row["roofline_bytes_s"] / row["seconds"]
            row["frac_roofline"] = row["roofline_max_s"] / row["seconds"]
        rows.append(row)
        save()
        print(f"[{row['engine']}] {row['model']}: " + (
            f"{row['output_tokens']} tokens in {row['seconds']:.1f} s = "
            f"{row['tok_per_s']:.0f} tok/s" if "error" not in row else row["error"]),
            flush=True)
        return row

    # Every infer run first, then the peers: a peer cut short by a time limit then costs
    # only its own row.
    done: dict[str, tuple] = {}
    for name in args.models:
        path = common.get_checkpoint(name, tiny, args.ckpt_root)
        shape = common.load_shape(name, tiny)
        counts = common.shape_counts(shape)
        prompts, outs = workload(args, shape["vocab_size"])
        defaults = {} if args.llm_defaults else dict(
            max_num_seqs=args.num_seqs, max_num_batched_tokens=16384,
            max_model_len=max(len(p) + n for p, n in zip(prompts, outs)) + 16)
        flags = common.merged_flags(defaults, user_flags)
        llm, build_s = common.build_llm(path, flags)
        dtype = llm.engine.dtype
        info = llm.engine.info  # the batch sizes as the engine chose them
        roof = roofline([len(p) for p in prompts], outs, info.max_num_seqs,
                        info.max_num_batched_tokens, counts, common.dtype_bytes(dtype), ceil)
        base = dict(model=name, num_seqs=args.num_seqs, prompt_tokens=sum(map(len, prompts)),
                    dtype=str(dtype).replace("torch.", ""), **roof)
        steps = record_steps(llm) if args.step_timeline else None
        mine = finish({**run_infer(llm, prompts, outs, args.temperature),
                       "engine_build_s": build_s, "engine_info": common.engine_info(llm)}, base)
        if steps is not None:
            mine["step_timeline"] = timeline(steps[1:])  # [0]: the warm-up's
            save()
            common.print_table(f"{name}: engine steps by sequences that got tokens",
                               mine["step_timeline"], TIMELINE_COLUMNS)
        if args.gpu_busy and torch.cuda.is_available():
            # other token ids, the same lengths: no prefix of the first run's is cached
            fresh = [[(t + 1) % shape["vocab_size"] for t in p] for p in prompts]
            mine["gpu_busy"] = gpu_busy(llm, fresh, outs, args.temperature)
            print(f"[infer] {name}, again with other prompt ids, its kernels traced: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in mine["gpu_busy"].items()), flush=True)
            if steps is not None:
                mine["gpu_busy_step_timeline"] = timeline(steps[3:])  # [2]: its warm-up's
                common.print_table(f"{name}: that run's steps", mine["gpu_busy_step_timeline"],
                                   TIMELINE_COLUMNS)
            save()
        done[name] = (path, dtype, prompts, outs, base, mine)
        del llm
        common.free_memory()

    peers = [] if args.skip_peer else (args.peer_models or args.models)
    for name in peers:
        if name not in done:
            print(f"[hf] {name} is not in --models; skipped", flush=True)
            continue
        path, dtype, prompts, outs, base, mine = done[name]
        try:
            peer = finish(run_hf_cb(path, dtype, prompts, outs, args.temperature), base)
        except Exception as exc:  # the peer must not sink the run; say why
            peer = finish(dict(engine="hf-cb", error=f"{type(exc).__name__}: {exc}"), base)
        if "error" not in peer:
            mine["ratio_vs_hf"] = mine["tok_per_s"] / peer["tok_per_s"]
            save()
        common.free_memory()

    print(f"\nwrote {out}")
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, matmul {ceil['matmul_TFLOPs']:.1f} "
          f"TFLOP/s; {args.num_seqs} seqs, input [{args.min_input}, {args.max_input}], "
          f"output [{args.min_output}, {args.max_output}], temperature {args.temperature}, "
          f"engine flags {user_flags or '{}'}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']} {r['engine']}: {r['error']}")
    common.print_table(
        "throughput (output tokens; roofline = idealised schedule, see the docstring)",
        [r for r in rows if "error" not in r],
        [("model", "model", ""), ("engine", "engine", ""), ("seqs", "num_seqs", "d"),
         ("out tokens", "output_tokens", "d"), ("seconds", "seconds", ".1f"),
         ("tok/s", "tok_per_s", ".0f"), ("roof steps", "steps", "d"),
         ("bytes roof s", "roofline_bytes_s", ".2f"),
         ("%bytes roof", "frac_bytes_roofline", ".1%"), ("roof s", "roofline_max_s", ".2f"),
         ("%roof", "frac_roofline", ".1%"), ("x HF", "ratio_vs_hf", ".2f")])


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
