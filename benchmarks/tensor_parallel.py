"""Tensor parallelism: speed of TP=N against TP=1 on one machine, and TP=N's greedy tokens
against TP=1's, random weights in the llama-3.1-8b shape (bf16 on GPUs).

For each TP size of `--tp` (default 1 2), one engine at a time (`LLM(ckpt,
tensor_parallel_size=N)`; shut down and its memory freed before the next one starts):

- decode step time at batch 1, 8, 32, as decode.py measures it (its `run_infer`): per
  sequence a fresh random 128-token prompt, greedy, ignore_eos; after a warm-up at the same
  batch size, step time = (T(1+N) - T(1)) / N with N = 256 new tokens;
- the nano-vllm throughput protocol, as throughput.py runs it (its `workload` and
  `run_infer`): 256 sequences, prompts of U[100, 1024] random token ids (< 10000), output
  lengths U[100, 1024], temperature 0.6, ignore_eos; output tokens / seconds;
- the correctness check (`--check` runs only it): 64 random 128-token prompts, greedy, 128
  new tokens, `SamplingParams(logprobs=20)` (the most a request may ask: random weights give
  flat distributions, where TP=N's token is often not among TP=1's top two);
- `--parts profile` (not by default): where rank 0's GPU time goes at batch 1 — one
  sequence of 64 greedy tokens under torch.profiler, after a warm-up: the kernels with the
  most device time, all-reduce kernels summed apart, per decode step, against the wall
  time per step (a gap between them: the GPU idles, waiting for the host).

One engine serves all three, sized for the largest (max_num_seqs 256, 16384 tokens a step,
max_model_len the longest sequence + 16); `--engine` flags go on top.

Per-rank bandwidth, per decode step, of rank r of N (every rank reads as much):
  weight bytes = what rank 0's model holds, as decode.py counts it (all but an untied
                 embedding table); when that model is not in this process, the shape's:
                 (body params - norm params - k/v proj params) / N + norm params
                 + k/v proj params x kv_heads_r / kv_heads + ceil(vocab / N) x hidden,
                 x dtype bytes (norms replicated; a KV head replicated on N / kv_heads
                 ranks when kv_heads < N)
  KV bytes     = 2 x layers x kv_heads_r x head_dim x dtype bytes x context, summed over
                 the batch, at the mean context of the N steps (prompt + (N+1)/2),
                 kv_heads_r = kv_heads / N (1 when kv_heads < N)
  %BW/rank     = (weight bytes + KV bytes) / step time / copy bandwidth of GPU 0, measured
                 in the same run before the first engine (common.ceilings: read + write)
Targets (issue): batch-1 decode TP=2 >= 1.7x TP=1 (gpt-fast: 1.59x on A100 NVLink); each
rank >= 75 % of its copy bandwidth.

Correctness: per prompt, the first position where TP=N's token differs from TP=1's; there,
  gap TP1 = TP=1's logprob of its token - its logprob of TP=N's token (logprobs of one
            softmax differ as the logits do, so this is the logit gap; known when TP=N's
            token is among TP=1's top 20),
  gap TPN = the same in TP=N's run, the other way round,
  shift   = gap TP1 + gap TPN: how far the two runs moved that margin apart.
The noise they are judged against is measured in the same run: |top-1 minus top-2 margin
of TP=1 - that of TP=N| at every position before the first difference (same context in
both, same top-2 tokens). A difference counts as rounding when each run's token is among
the other's top 20 and shift <= the largest such noise; the percentile of gap TP1 among all
of TP=1's top-2 gaps shows how close a tie it was.

    # the device run (nvidia-h200-x2): both sizes in one lease, one command; the JSON is
    # rewritten after every row, so a run cut short keeps what it measured
    PYTHONPATH=src python benchmarks/tensor_parallel.py --tp 1 2
    python benchmarks/tensor_parallel.py --check          # only the token comparison
    ... --dump-stacks-after 60    # a part that runs 60 s dumps every rank's stacks
    python benchmarks/tensor_parallel.py --tiny           # CPU check (gloo), seconds
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import math
import multiprocessing
import os
import random
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import decode
import throughput

NAME = "tensor_parallel"
PARTS = ("decode", "throughput", "check", "profile")
TARGET_SPEEDUP, TARGET_BW = 1.7, 0.75  # batch-1 decode TP=2 / TP=1; per-rank copy BW


# -- what one rank reads --------------------------------------------------------------
def norm_params(shape: dict[str, Any]) -> int:
    """Parameters of the norms (replicated on every rank), from the HF model on meta."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(common.hf_config(shape))
    return sum(p.numel() for n, p in model.named_parameters() if "norm" in n)


def kv_heads_per_rank(counts: common.ShapeCounts, tp: int) -> int:
    return counts.kv_heads // tp if counts.kv_heads >= tp else 1


def rank_weight_params(counts: common.ShapeCounts, norms: int, tp: int) -> int:
    """Weight parameters one of `tp` ranks reads per step (the docstring's formula)."""
    kv_proj = 2 * counts.layers * counts.kv_heads * counts.head_dim * counts.hidden
    split = counts.body_params - norms - kv_proj
    return (split // tp + norms + kv_proj * kv_heads_per_rank(counts, tp) // counts.kv_heads
            + math.ceil(counts.vocab / tp) * counts.hidden)


def rank_metrics(row: dict, weight_bytes: int, kv_token_bytes: int, mean_ctx: float,
                 copy_gbs: float) -> None:
    step = row["step_ms"] / 1e3
    kv = kv_token_bytes * mean_ctx * row["batch"]
    gbs = (weight_bytes + kv) / step / 1e9
    row.update(tok_per_s=row["batch"] / step, rank_weight_MB=weight_bytes / 1e6,
               rank_kv_MB=kv / 1e6, rank_GBps=gbs, rank_frac_copy=gbs / copy_gbs)


# -- correctness ------------------------------------------------------------------------
def greedy_topk(llm, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """Per prompt: the greedy tokens and, per token, the MAX_LOGPROBS most likely
    (id, logprob), best first."""
    from infer import SamplingParams
    from infer.sampling_params import MAX_LOGPROBS

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                            logprobs=MAX_LOGPROBS)
    runs = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        c = out.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        top = [sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda x: -x[1])
               for entry in c.logprobs]
        runs.append(dict(tokens=list(c.token_ids), top=top))
    return runs


def margin(top: list[tuple[int, float]]) -> float:
    return top[0][1] - top[1][1]


def compare(base: list[dict], other: list[dict], tp: int) -> dict:
    """TP=1's run (`base`) against TP=`tp`'s: the module docstring's gaps and noise."""
    noise: list[float] = []
    base_margins = [margin(t) for run in base for t in run["top"]]
    diffs = []
    for i, (a, b) in enumerate(zip(base, other)):
        first = next((k for k, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
                     None)
        for k in range(len(a["tokens"]) if first is None else first):
            ta, tb = a["top"][k][:2], b["top"][k][:2]
            if [t for t, _ in ta] == [t for t, _ in tb]:
                noise.append(abs(margin(ta) - margin(tb)))
        if first is None:
            continue
        tok_a, tok_b = a["tokens"][first], b["tokens"][first]
        la, lb = dict(a["top"][first]), dict(b["top"][first])
        gap_a = la[tok_a] - la[tok_b] if tok_b in la else None
        gap_b = lb[tok_b] - lb[tok_a] if tok_a in lb else None
        diffs.append(dict(prompt=i, position=first, token_tp1=tok_a, token_tpn=tok_b,
                          gap_tp1=gap_a, gap_tpn=gap_b, top2_gap_tp1=margin(a["top"][first]),
                          shift=None if gap_a is None or gap_b is None else gap_a + gap_b))
    noise_max = max(noise, default=0.0)
    for d in diffs:
        g = d["gap_tp1"]
        d["gap_percentile"] = None if g is None else \
            sum(m <= g for m in base_margins) / len(base_margins)
        d["within_noise"] = d["shift"] is not None and d["shift"] <= noise_max
    return dict(
        tp=tp, prompts=len(base), tokens_per_prompt=len(base[0]["tokens"]) if base else 0,
        identical=len(base) - len(diffs), differing=len(diffs),
        noise_positions=len(noise), noise_median=statistics.median(noise) if noise else None,
        noise_p99=sorted(noise)[int(0.99 * (len(noise) - 1))] if noise else None,
        noise_max=noise_max if noise else None, diffs=diffs,
        all_within_noise=all(d["within_noise"] for d in diffs))


def print_check(c: dict) -> None:
    verdict = "identical" if not c["differing"] else (
        "every difference within the run's rounding noise" if c["all_within_noise"]
        else "SOME DIFFERENCES EXCEED the run's rounding noise")
    print(f"\ncheck TP={c['tp']} vs TP=1: {c['prompts']} prompts x {c['tokens_per_prompt']} "
          f"greedy tokens: {c['identical']} identical, {c['differing']} differ -> {verdict}")
    if c["noise_positions"]:
        print(f"  noise |margin TP1 - margin TP{c['tp']}| over {c['noise_positions']} agreeing "
              f"positions: median {c['noise_median']:.2e}, p99 {c['noise_p99']:.2e}, "
              f"max {c['noise_max']:.2e}")
    if c["diffs"]:
        common.print_table(
            f"first differences (logit gaps; shift = gap TP1 + gap TP{c['tp']})", c["diffs"],
            [("prompt", "prompt", "d"), ("pos", "position", "d"), ("tok TP1", "token_tp1", "d"),
             (f"tok TP{c['tp']}", "token_tpn", "d"), ("gap TP1", "gap_tp1", ".4f"),
             (f"gap TP{c['tp']}", "gap_tpn", ".4f"), ("shift", "shift", ".4f"),
             ("pctile", "gap_percentile", ".2%"), ("<= noise", "within_noise", "")])


# -- where the time goes -----------------------------------------------------------------
class Phases:
    """Each part's start and end printed with its time; with `dump_after_s`, a part still
    running that long has the stacks of this process's threads dumped to stderr, and each
    worker rank (a child process) asked for its own (SIGUSR1: `distributed/worker.py`;
    not while an engine is built), again every `dump_after_s` while it runs: where a run
    that hangs waits."""

    def __init__(self, dump_after_s: float | None) -> None:
        self.name: str | None = None
        self.since = 0.0
        if dump_after_s:
            threading.Thread(target=self._watch, args=(dump_after_s,), daemon=True,
                             name="stack-dumps").start()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.monotonic()
        print(f"[phase] {name}: started", flush=True)
        self.name, self.since = name, t
        try:
            yield
        finally:
            self.name = None
            print(f"[phase] {name}: {time.monotonic() - t:.1f} s", flush=True)

    def _watch(self, after: float) -> None:
        while True:
            time.sleep(1.0)
            name = self.name
            if name is None or time.monotonic() - self.since < after:
                continue
            self.since = time.monotonic()
            print(f"[phase] {name}: still running after {after:.0f} s more; stacks follow",
                  file=sys.stderr, flush=True)
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
            if name.endswith("build"):
                continue  # a worker still starting has no handler: SIGUSR1 would end it
            for child in multiprocessing.active_children():
                with contextlib.suppress(OSError):
                    os.kill(child.pid, signal.SIGUSR1)


# -- one engine -------------------------------------------------------------------------
def why_not(tp: int) -> str | None:
    """Why TP=`tp` cannot run here (None: it can)."""
    if tp == 1:
        return None
    from infer.engine.config import EngineConfig

    if "tensor_parallel_size" not in EngineConfig.field_names():
        return "this engine has no EngineConfig.tensor_parallel_size yet"
    if torch.cuda.is_available() and torch.cuda.device_count() < tp:
        return f"{torch.cuda.device_count()} GPU(s) visible, TP={tp} needs {tp}"
    return None


def dispose(llm) -> None:
    """Stop the engine's worker processes (if it has any) before the next engine starts."""
    for obj in (llm, llm.engine):
        stop = getattr(obj, "shutdown", None)
        if callable(stop):
            stop()
            return


def run_tp(tp: int, llm, args, shape: dict, counts: common.ShapeCounts, norms: int,
           ceil: dict, check_prompts: list[list[int]], emit, phase: Phases
           ) -> list[dict] | None:
    """Every part on the engine of TP=`tp`; rows go to `emit(kind, row)`. Returns the
    check's runs (None when the check is not part of this run)."""
    dtype = llm.engine.dtype
    nbytes = common.dtype_bytes(dtype)
    formula_w = rank_weight_params(counts, norms, tp) * nbytes
    model = getattr(llm.engine, "model", None)  # None with core_process
    stored_w = decode.step_weight_bytes(model) if model is not None else None
    if stored_w is not None and abs(stored_w - formula_w) > 0.02 * formula_w:
        print(f"[tp={tp}] rank 0 holds {stored_w / 1e6:.1f} MB of step weights, the shape's "
              f"formula says {formula_w / 1e6:.1f} MB (quantized? the stored bytes are used)",
              flush=True)
    weight_bytes = stored_w if stored_w is not None else formula_w
    kv_token = 2 * counts.layers * kv_heads_per_rank(counts, tp) * counts.head_dim * nbytes
    base = dict(tp=tp, dtype=str(dtype).replace("torch.", ""),
                rank_weight_MB_formula=formula_w / 1e6,
                rank0_stored_weight_MB=None if stored_w is None else stored_w / 1e6)
    vocab = shape["vocab_size"]
    if "decode" in args.parts:
        mean_ctx = args.prompt_len + (args.new_tokens + 1) / 2

        def decode_row(row: dict) -> None:
            row = {**base, **row}
            rank_metrics(row, weight_bytes, kv_token, mean_ctx, ceil["copy_GBps"])
            print(f"[tp={tp}] batch {row['batch']}: {row['step_ms']:.2f} ms/step "
                  f"{row['tok_per_s']:.0f} tok/s, {100 * row['rank_frac_copy']:.1f}% copy BW "
                  f"per rank", flush=True)
            emit("decode", row)

        with phase(f"tp={tp} decode"):
            decode.run_infer(llm, args.batches, args.prompt_len, args.new_tokens, vocab,
                             random.Random(args.seed), args.repeats, decode_row)
    if "throughput" in args.parts:
        prompts, outs = throughput.workload(args, vocab)
        with phase(f"tp={tp} throughput"):
            got = throughput.run_infer(llm, prompts, outs, args.temperature)
        row = {**base, **got, "num_seqs": args.num_seqs,
               "prompt_tokens": sum(map(len, prompts))}
        row["tok_per_s"] = row["output_tokens"] / row["seconds"]
        print(f"[tp={tp}] throughput: {row['output_tokens']} tokens in {row['seconds']:.1f} s "
              f"= {row['tok_per_s']:.0f} tok/s", flush=True)
        emit("throughput", row)
    if "profile" in args.parts and torch.cuda.is_available():
        with phase(f"tp={tp} profile"):
            emit("profile", {"tp": tp, **profile_decode(llm, args.prompt_len, vocab, tp)})
    if "check" in args.parts:
        with phase(f"tp={tp} check"):
            return greedy_topk(llm, check_prompts, args.check_tokens)
    return None


IDLE_LONG_US = 20.0  # a longer gap between two kernels: the GPU waited for the host


def idle_per_step(events: Any, steps: int) -> dict[str, float]:
    """GPU idle time between consecutive kernels, per step: short gaps (launch latency
    inside a graph) apart from long ones (between steps: the host's work)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    short = long = 0.0
    count = 0
    last_end = spans[0][1] if spans else 0.0
    for start, end in spans[1:]:
        gap = start - last_end
        if gap >= IDLE_LONG_US:
            long, count = long + gap, count + 1
        elif gap > 0:
            short += gap
        last_end = max(last_end, end)
    return dict(idle_short_ms_per_step=short / steps / 1e3,
                idle_long_ms_per_step=long / steps / 1e3, idle_long_per_step=count / steps)


def profile_decode(llm, prompt_len: int, vocab: int, tp: int, new_tokens: int = 64
                   ) -> dict[str, Any]:
    """Rank 0's kernels over one batch-1 run of `new_tokens` greedy tokens (the prompt's
    prefill is one step of it, amortised in the per-step figures)."""
    from torch.profiler import ProfilerActivity, profile

    from infer import SamplingParams

    prompt = {"prompt_token_ids": common.random_prompts(random.Random(7), 1, prompt_len,
                                                         vocab)[0]}
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - t
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0
               and e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.device_time_total)

    def ms_per_step(total_us: float) -> float:
        return total_us / new_tokens / 1e3

    def is_all_reduce(name: str) -> bool:
        return "allreduce" in name.replace("_", "").lower()

    out = dict(new_tokens=new_tokens, wall_ms_per_step=wall * 1e3 / new_tokens,
               **idle_per_step(prof.events(), new_tokens),
               kernel_ms_per_step=ms_per_step(sum(e.device_time_total for e in kernels)),
               all_reduce_ms_per_step=ms_per_step(sum(e.device_time_total for e in kernels
                                                      if is_all_reduce(e.key))),
               top=[dict(kernel=e.key[:90], calls_per_step=e.count / new_tokens,
                         us_per_step=e.device_time_total / new_tokens)
                    for e in kernels[:15]])
    print(f"[tp={tp}] profile, batch 1, per step: wall {out['wall_ms_per_step']:.2f} ms, "
          f"kernels {out['kernel_ms_per_step']:.2f} ms, of which all-reduce "
          f"{out['all_reduce_ms_per_step']:.2f} ms; GPU idle {out['idle_short_ms_per_step']:.2f}"
          f" ms in gaps < {IDLE_LONG_US:.0f} us, {out['idle_long_ms_per_step']:.2f} ms in "
          f"{out['idle_long_per_step']:.1f} longer ones", flush=True)
    for row in out["top"]:
        print(f"    {row['us_per_step']:8.1f} us  x{row['calls_per_step']:5.1f}  "
              f"{row['kernel']}", flush=True)
    return out


# -- the table ------------------------------------------------------------------------------
def summary(tps: list[int], decode_rows: list[dict], tput_rows: list[dict],
            batches: list[int]) -> tuple[list[dict], list[tuple[str, str, str]]]:
    """One row per workload, columns per TP size, ratios against the first TP size."""
    ref = tps[0]
    rows = []
    for batch in batches:
        row: dict[str, Any] = {"workload": f"decode batch {batch}"}
        for r in decode_rows:
            if r["batch"] == batch:
                row.update({f"ms_{r['tp']}": r["step_ms"], f"tps_{r['tp']}": r["tok_per_s"],
                            f"bw_{r['tp']}": r["rank_frac_copy"]})
        if len(row) > 1:
            rows.append(row)
    if tput_rows:
        row = {"workload": f"throughput {tput_rows[0]['num_seqs']} seqs"}
        row.update({f"tps_{r['tp']}": r["tok_per_s"] for r in tput_rows})
        rows.append(row)
    for row in rows:
        for tp in tps[1:]:
            if row.get(f"tps_{tp}") and row.get(f"tps_{ref}"):
                row[f"x_{tp}"] = row[f"tps_{tp}"] / row[f"tps_{ref}"]
    cols = [("workload", "workload", "")]
    for tp in tps:
        cols += [(f"TP={tp} ms/step", f"ms_{tp}", ".2f"), (f"TP={tp} tok/s", f"tps_{tp}", ".0f"),
                 (f"TP={tp} %BW/rank", f"bw_{tp}", ".1%")]
    cols += [(f"TP{tp}/TP{ref}", f"x_{tp}", ".2f") for tp in tps[1:]]
    return rows, cols


def targets(rows: list[dict]) -> list[str]:
    b1 = next((r for r in rows if r["workload"] == "decode batch 1"), None)
    if b1 is None or "x_2" not in b1:
        return []
    lines = [f"batch-1 decode TP=2 / TP=1 = {b1['x_2']:.2f}x (target >= {TARGET_SPEEDUP}x): "
             + ("met" if b1["x_2"] >= TARGET_SPEEDUP else "NOT met")]
    for tp in (1, 2):
        if f"bw_{tp}" in b1:
            lines.append(f"batch-1 decode TP={tp}: {b1[f'bw_{tp}']:.1%} of copy BW per rank "
                         f"(target >= {TARGET_BW:.0%}): "
                         + ("met" if b1[f"bw_{tp}"] >= TARGET_BW else "NOT met"))
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--model", default="llama-3.1-8b", help="a shape of benchmarks/configs")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2],
                        help="tensor-parallel sizes, one engine each, in this order; ratios "
                             "are against the first")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--check", action="store_true", help="only the correctness check "
                        "(same as --parts check)")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="decode batch sizes, default 1 8 32 (tiny: 1 4)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128 (tiny 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256 (tiny 16)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed decode runs per batch size; the median is reported")
    parser.add_argument("--num-seqs", type=int, default=None, help="default 256 (tiny 8)")
    parser.add_argument("--min-input", type=int, default=None, help="default 100 (tiny 8)")
    parser.add_argument("--max-input", type=int, default=None, help="default 1024 (tiny 32)")
    parser.add_argument("--min-output", type=int, default=None, help="default 100 (tiny 8)")
    parser.add_argument("--max-output", type=int, default=None, help="default 1024 (tiny 32)")
    parser.add_argument("--temperature", type=float, default=0.6,
                        help="throughput sampling temperature (nano-vllm's 0.6)")
    parser.add_argument("--check-prompts", type=int, default=None, help="default 64 (tiny 8)")
    parser.add_argument("--check-tokens", type=int, default=None, help="default 128 (tiny 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dump-stacks-after", type=float, default=None, metavar="S",
                        help="a part still running after S seconds dumps every rank's "
                             "stacks to stderr (again every S seconds)")
    args = parser.parse_args()
    if args.check:
        args.parts = ["check"]
    if len(set(args.tp)) != len(args.tp) or min(args.tp) < 1:
        parser.error(f"--tp takes distinct sizes >= 1, got {args.tp}")
    for name, full, small in (("batches", [1, 8, 32], [1, 4]), ("prompt_len", 128, 16),
                              ("new_tokens", 256, 16), ("num_seqs", 256, 8),
                              ("min_input", 100, 8), ("max_input", 1024, 32),
                              ("min_output", 100, 8), ("max_output", 1024, 32),
                              ("check_prompts", 64, 8), ("check_tokens", 128, 16)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.tiny else full)
    return args


def main() -> None:
    args = parse_args()
    user_flags = common.parse_engine_flags(args.engine)
    if "tensor_parallel_size" in user_flags:
        raise SystemExit("pass the sizes with --tp, not --engine tensor_parallel_size=...")
    common.setup_cpu_threads()
    ceil = common.ceilings()  # GPU 0, before any engine holds memory
    path = common.get_checkpoint(args.model, args.tiny, args.ckpt_root)
    shape = common.load_shape(args.model, args.tiny)
    counts = common.shape_counts(shape)
    norms = norm_params(shape)
    check_prompts = common.random_prompts(random.Random(args.seed + 1), args.check_prompts,
                                          args.prompt_len, shape["vocab_size"])
    tput_max = args.max_input + args.max_output
    defaults = dict(
        max_model_len=max(args.prompt_len + max(args.new_tokens, args.check_tokens),
                          tput_max if "throughput" in args.parts else 0) + 16,
        max_num_seqs=max(args.batches + [args.check_prompts]
                         + ([args.num_seqs] if "throughput" in args.parts else [])),
        max_num_batched_tokens=16384)
    flags = common.merged_flags(defaults, user_flags)
    res: dict[str, Any] = dict(model=args.model, ceilings=ceil, decode=[], throughput=[],
                               check=[], profile=[], errors={}, engines={})
    out = None

    def save() -> None:
        nonlocal out
        out = common.write_results(NAME, args, res)

    def emit(kind: str, row: dict) -> None:
        res[kind].append(row)
        save()

    runs: dict[int, list[dict]] = {}
    phase = Phases(args.dump_stacks_after)
    for tp in args.tp:
        reason = why_not(tp)
        if reason:
            print(f"[tp={tp}] skipped: {reason}", flush=True)
            res["errors"][str(tp)] = reason
            save()
            continue
        llm = None
        try:
            with phase(f"tp={tp} build"):
                llm, build_s = common.build_llm(
                    path, {**flags, **({"tensor_parallel_size": tp} if tp != 1 else {})})
            res["engines"][str(tp)] = {"build_s": build_s, **common.engine_info(llm)}
            got = run_tp(tp, llm, args, shape, counts, norms, ceil, check_prompts, emit,
                         phase)
            if got is not None:
                runs[tp] = got
                if tp != 1 and 1 in runs:  # saved now: a shutdown that hangs cannot lose it
                    emit("check", compare(runs[1], got, tp))
        except Exception as exc:  # one TP size failing must not sink the others; say why
            traceback.print_exc()
            res["errors"][str(tp)] = f"{type(exc).__name__}: {exc}"
        finally:
            if llm is not None:
                with phase(f"tp={tp} shutdown"):
                    dispose(llm)
            llm = None
            common.free_memory()
        save()

    done = [tp for tp in args.tp if str(tp) not in res["errors"]]
    rows, cols = summary(done, res["decode"], res["throughput"], args.batches) if done \
        else ([], [])
    res["summary"] = rows
    res["targets"] = targets(rows)
    save()

    print(f"\nwrote {out}")
    where = "GPU 0" if torch.cuda.is_available() else "the CPU"
    parts = {"decode": f"decode prompt {args.prompt_len}, {args.new_tokens} steps timed",
             "throughput": f"throughput {args.num_seqs} seqs, input [{args.min_input}, "
                           f"{args.max_input}], output [{args.min_output}, {args.max_output}], "
                           f"temperature {args.temperature}",
             "check": f"check {args.check_prompts} prompts x {args.check_tokens} tokens",
             "profile": "profile: batch 1, 64 tokens"}
    print(f"{args.model}{' (tiny)' if args.tiny else ''} on {common.device_name()}: copy "
          f"{ceil['copy_GBps']:.0f} GB/s on {where}; "
          + "; ".join(parts[p] for p in PARTS if p in args.parts) + f"; engine flags {flags}")
    for tp, why in res["errors"].items():
        print(f"TP={tp}: {why}")
    for c in res["check"]:
        print_check(c)
    if rows:  # none with --check alone
        common.print_table("tensor parallel (decode per step, bytes per rank; throughput in "
                           "output tokens)", rows, cols)
    for line in res["targets"]:
        print(line + (" [tiny shapes: not meaningful]" if args.tiny else ""))
    if res["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
