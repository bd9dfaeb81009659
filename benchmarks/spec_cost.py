"""The cost side of speculative decoding on random weights (8B target, 1B draft shapes,
Llama-3 vocabulary): what a verify step, a draft round and the whole loop cost, and the
speed-up they predict at a given acceptance rate.

Random weights accept almost no drafts, so the costs are measured apart and combined:

- T_1: a decode step of the target alone, `LLM(model)` defaults (async scheduling, graphs),
  from (T(1 + N) - T(1)) / N at batch 1.
- T_verify(k): an engine step whose sequence brings k drafts (a fixed drafter proposes
  k tokens; random weights reject them, so each step is one verify), through the same
  engine path as real drafts: the target's forward over k + 1 positions and the
  verification, host work included.
- T_round(k): the draft model's proposal round for k drafts (timed around the drafter;
  it ends by reading the drafts on the host).
- Predicted speed-up at acceptance a (each draft accepted with probability a, given the
  ones before): tokens per round E = (1 - a^(k+1)) / (1 - a); speed-up =
  E x T_1 / (T_verify(k) + T_round(k)).
- "Queued": a step of the engine's own drafted decoding, its drafts left on the device
  and the verify step planned and queued while the round runs, timed twice: every draft
  rejected (random weights), and every draft accepted (the verdict overruled after it is
  worked out: `accepting_every_draft`, three small launches more). A round after a verdict
  that accepted all k also computes the draft's KV of the last draft (only then: its first
  forward's catch-up row), so at acceptance a the step costs
  T_q = (1 - a^k) T_rejected + a^k T_accepted, and the speed-up is E x T_1 / T_q.
- With `--profile-round`: where a draft round's time goes (k = --k-e2e): the GPU's busy
  time inside the rounds (kernels that ran between a round's start and its read-back)
  against their wall time, and the kernels that took most of it.
- With `--profile-steps`: whole steps under torch.profiler (the plain target's, a fixed
  drafter's verify, the engine's own drafted step at k = --k-e2e): per step the wall
  time from first kernel to last, the time some kernel ran, the idle rest, the kernels
  that took most, and the idle time by the pair of kernels around it (where the device
  waited for the host).
- End to end, the target as its own draft model: drafts accepted as often as bf16 lets
  one- and multi-token forwards agree; the measured speed-up against the plain engine in
  the same run, beside what the formula predicts from this run's own T_verify, T_round
  and acceptance.

    python benchmarks/spec_cost.py [--ks 1 2 3 4 5 6 7 8] [--new-tokens 128]
    python benchmarks/spec_cost.py --ks 4 --draft-quantization none int8 --profile-round
    python benchmarks/spec_cost.py --ks 4 --draft-quantization int8 --profile-steps
    python benchmarks/spec_cost.py --ks 4 --draft-gguf Q4_K_M --skip-own-draft  # a GGUF draft
    python benchmarks/spec_cost.py --tiny     # CPU check, tiny shapes

Prints the tables and writes benchmarks/results/spec_cost_<device>.json.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import gguf_checkpoint

ACCEPTANCE = (0.6, 0.7, 0.8, 0.9)
ROUND = "draft_round"  # the profiler's name of a proposal round


class FixedDrafter:
    """Proposes `k` copies of one token for every sequence (random weights reject them)."""

    own_cache = False
    on_device = False

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, requests):
        return [[7] * min(self.k, r.max_new_tokens - len(r.output_token_ids) - 1)
                for r in requests]

    def mirror(self, out, requests, device_input_ids=None) -> None:
        pass


class TimedDrafter:
    """Wraps a drafter and adds up the wall time of its proposal rounds."""

    on_device = False  # the round timed to its drafts on the host

    def __init__(self, inner) -> None:
        self.inner, self.own_cache = inner, inner.own_cache
        self.seconds, self.rounds = 0.0, 0

    def propose(self, requests):
        common.sync()
        start = time.perf_counter()
        with torch.profiler.record_function(ROUND):
            drafts = self.inner.propose(requests)  # ends reading the drafts on the host
        self.seconds += time.perf_counter() - start
        self.rounds += 1
        return drafts

    def mirror(self, out, requests, device_input_ids=None) -> None:
        self.inner.mirror(out, requests, device_input_ids)


@contextmanager
def accepting_every_draft():
    """Within: every verify step's verdict (worked out as usual) replaced by one that
    accepts all its drafts, then the target's first token as the last (any token would do:
    random weights)."""
    import infer.engine.engine_core as engine_core
    from infer.spec.rejection import Verified

    verify = engine_core.verify_drafts

    def overruled(logits, batch, counts, drafts, greedy, seeds, positions, on_device=None):
        verdict = verify(logits, batch, counts, drafts, greedy, seeds, positions, on_device)
        tokens = verdict.token_ids
        k = tokens.shape[1] - 1
        if all(c == k + 1 for c in counts) and on_device and all(d is not None
                                                                 for d in on_device):
            # (the steps timed: three small launches)
            tokens[:, k] = tokens[:, 0]
            tokens[:, :k] = on_device[0][None] if len(on_device) == 1 else torch.stack(on_device)
            return Verified(tokens, verdict.num_tokens.fill_(k + 1))
        for i, count in enumerate(counts):  # fewer drafts near a sequence's end
            taken = (on_device[i] if on_device and on_device[i] is not None
                     else torch.tensor(drafts[i], device=tokens.device))
            tokens[i, count - 1] = tokens[i, 0].clone()
            tokens[i, :count - 1] = taken[:count - 1]
        num_tokens = torch.tensor(counts, device=tokens.device)
        return Verified(tokens, num_tokens)

    engine_core.verify_drafts = overruled
    try:
        yield
    finally:
        engine_core.verify_drafts = verify


def warm(llm, timed: TimedDrafter) -> None:
    """One short generation through the drafter, then its clock from zero."""
    from infer import SamplingParams

    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    timed.seconds, timed.rounds = 0.0, 0


def round_profile(llm, timed: TimedDrafter, rng, vocab: int, prompt_len: int,
                  new_tokens: int) -> dict:
    """GPU kernel time inside the draft rounds of one decode run, per round, and the
    kernels that took most of it. A round starts after a device sync and ends reading
    the drafts, so every kernel that ran inside its wall-clock span is the round's."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    warm(llm, timed)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode_run(llm, rng, vocab, prompt_len, new_tokens)
    events = prof.events()
    # The round's range is also drawn on the GPU's timeline (an annotation): the host's.
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.name == ROUND and e.device_type == DeviceType.CPU)
    busy_us, kernels = 0.0, {}
    for e in events:
        if e.device_type != DeviceType.CUDA or e.name == ROUND:
            continue
        start, end = e.time_range.start, e.time_range.end
        if not any(a <= start and end <= b for a, b in spans):
            continue
        busy_us += end - start
        count, total = kernels.get(e.name, (0, 0.0))
        kernels[e.name] = (count + 1, total + end - start)
    rounds = max(len(spans), 1)
    wall_us = sum(b - a for a, b in spans)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]
    return dict(rounds=len(spans), wall_ms=wall_us / rounds / 1e3,
                gpu_busy_ms=busy_us / rounds / 1e3,
                kernels_per_round=sum(c for c, _ in kernels.values()) / rounds,
                top=[dict(name=name[:90], per_round=c / rounds, ms_per_round=t / rounds / 1e3)
                     for name, (c, t) in top])


def step_profile(llm, rng, vocab: int, prompt_len: int, new_tokens: int,
                 timeline_ms: float = 0.0) -> dict:
    """Where a decode step's time goes on the GPU: one run of `new_tokens` under the
    profiler, from its first kernel to its last; per step the wall time, the time some
    kernel ran (overlapping kernels counted once), the idle rest, the kernels that took
    most of it, and the idle time by the pair of kernels around it. `timeline_ms`: also
    every kernel of that long a stretch from the middle of the run, as [start µs from the
    stretch's first, duration µs, name]."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from infer import SamplingParams

    core = llm.engine.core
    prompts = common.random_prompts(rng, 1, prompt_len, vocab)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm
    common.sync()
    steps = core.num_steps
    # on a CPU (--tiny) the operators stand for the kernels
    gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        common.sync()
    steps = max(core.num_steps - steps, 1)
    kind = DeviceType.CUDA if gpu else DeviceType.CPU
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == kind and (gpu or e.name.startswith("aten::")))
    busy, kernels, gaps, reach, last = 0.0, {}, {}, None, ""
    for start, end, name in spans:
        count, total = kernels.get(name, (0, 0.0))
        kernels[name] = (count + 1, total + end - start)
        if reach is not None and start > reach:  # idle since the kernel that ended last
            pair = f"{last[:40]} -> {name[:40]}"
            count, total = gaps.get(pair, (0, 0.0))
            gaps[pair] = (count + 1, total + start - reach)
        if reach is None or start >= reach:
            busy += end - start
        elif end > reach:
            busy += end - reach
        if reach is None or end >= reach:
            reach, last = end, name
    wall = reach - spans[0][0] if spans else 0.0

    def per_step(table: dict) -> list[dict]:
        return [dict(name=name[:90], per_step=c / steps, ms_per_step=t / steps / 1e3)
                for name, (c, t) in sorted(table.items(), key=lambda kv: -kv[1][1])[:16]]

    result = dict(steps=steps, wall_ms=wall / steps / 1e3, gpu_busy_ms=busy / steps / 1e3,
                  idle_ms=(wall - busy) / steps / 1e3,
                  kernels_per_step=sum(c for c, _ in kernels.values()) / steps,
                  top=per_step(kernels), idle=per_step(gaps))
    if timeline_ms and spans:
        first = (spans[0][0] + reach) / 2
        window = [s for s in spans if first <= s[0] < first + timeline_ms * 1e3]
        result["timeline"] = [[round(start - window[0][0], 2), round(end - start, 2), name[:60]]
                              for start, end, name in window]
    return result


def expected_tokens(a: float, k: int) -> float:
    return k + 1.0 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def decode_run(llm, rng, vocab: int, prompt_len: int, new_tokens: int, batch: int = 1
               ) -> dict:
    """ms per decode step and per token, from T(1 + N) - T(1) on fresh random prompts."""
    from infer import SamplingParams

    core = llm.engine.core

    def timed(max_tokens: int) -> tuple[float, int, int]:
        prompts = common.random_prompts(rng, batch, prompt_len, vocab)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        steps = core.num_steps
        common.sync()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        common.sync()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return time.perf_counter() - start, core.num_steps - steps, tokens

    timed(min(32, new_tokens))  # warm-up, long enough for rounds queued ahead (2k + 1)
    for _ in range(3):  # a noisy machine can make the short run the slower: time again
        t1, s1, n1 = timed(1)
        tn, sn, nn = timed(1 + new_tokens)
        if tn > t1:
            break
    else:
        raise SystemExit(f"{new_tokens} more tokens never took longer than one: the timings "
                         "are noise here (more --new-tokens?)")
    seconds, steps, tokens = tn - t1, sn - s1, nn - n1
    return dict(step_ms=seconds / steps * 1e3, ms_per_token=seconds / tokens * 1e3 * batch,
                steps=steps, tokens=tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="llama-3.1-8b")
    p.add_argument("--draft", default="llama-3.2-1b")
    p.add_argument("--ks", type=int, nargs="+", default=None, help="default 1..8")
    p.add_argument("--draft-quantization", nargs="+", default=["auto"],
                   help="the draft model's weights (auto, none, int8, fp8, int4, gguf), each in "
                   "turn; the end-to-end run's draft (the target itself) stays in the "
                   "target's format")
    p.add_argument("--draft-gguf", choices=gguf_checkpoint.MIXES, default=None,
                   help="the draft as a random GGUF file of this mix (gguf_checkpoint.py), "
                   "kept quantized: with --draft-quantization auto or gguf")
    p.add_argument("--profile-round", action="store_true",
                   help="also profile the draft rounds at k = --k-e2e (torch.profiler)")
    p.add_argument("--profile-steps", action="store_true",
                   help="also profile whole steps (torch.profiler): the plain target's, the "
                   "fixed drafts' verify and the engine's own drafted step, at k = --k-e2e")
    p.add_argument("--timeline-ms", type=float, default=0.0,
                   help="with --profile-steps: also every kernel of that many ms from the "
                        "middle of each profiled run")
    p.add_argument("--k-e2e", type=int, default=4)
    p.add_argument("--skip-own-draft", action="store_true",
                   help="skip the end-to-end run with the target as its own draft")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (tiny 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (tiny 16)")
    common.add_common_args(p)
    args = p.parse_args()
    tiny = args.tiny
    ks = args.ks or ([1, 2, 4] if tiny else list(range(1, 9)))
    prompt_len = args.prompt_len or (16 if tiny else 128)
    new_tokens = args.new_tokens or (16 if tiny else 128)
    flags = {"max_num_seqs": 8, **common.parse_engine_flags(args.engine)}
    if tiny:
        flags.setdefault("device", "cpu")
    target = common.get_checkpoint(args.target, tiny, args.ckpt_root)
    draft = (common.get_checkpoint(args.draft, tiny, args.ckpt_root) if args.draft_gguf is None
             else gguf_checkpoint.get_gguf(args.draft, args.draft_gguf, tiny, args.ckpt_root))
    vocab = common.load_shape(args.target, tiny)["vocab_size"]
    if common.load_shape(args.draft, tiny)["vocab_size"] != vocab:
        raise SystemExit("--draft must have the target's vocabulary size")
    rng = random.Random(0)
    result: dict = {"ceilings": common.ceilings(), "flags": flags}

    llm, _ = common.build_llm(target, flags)
    plain = decode_run(llm, rng, vocab, prompt_len, new_tokens)
    result["plain"] = plain
    t1 = plain["step_ms"]
    print(f"[plain] target decode {t1:.3f} ms/step", flush=True)
    step_profiles = {}
    if args.profile_steps:
        step_profiles["plain"] = step_profile(llm, rng, vocab, prompt_len, new_tokens,
                                              args.timeline_ms)
    del llm

    rows, profiles = [], {}
    for quantization in args.draft_quantization:
        llm, _ = common.build_llm(target, {**flags, "speculative_method": "draft",
                                           "draft_model": str(draft),
                                           "draft_quantization": quantization,
                                           "num_speculative_tokens": max(ks)})
        core = llm.engine.core
        model_drafter = core.drafter
        label = quantization if args.draft_gguf is None else f"{quantization} ({args.draft_gguf})"
        for k in ks:
            core.drafter = FixedDrafter(k)
            verify = decode_run(llm, rng, vocab, prompt_len, new_tokens)
            model_drafter.k = k
            core.drafter = timed = TimedDrafter(model_drafter)
            warm(llm, timed)
            drafted = decode_run(llm, rng, vocab, prompt_len, new_tokens)
            round_ms = timed.seconds / timed.rounds * 1e3
            # The engine's own way: the drafts left on the device, the verify step queued
            # behind the round (every draft rejected: one round and one verify a step).
            core.drafter = model_drafter
            ahead = model_drafter.num_rounds_ahead
            queued = decode_run(llm, rng, vocab, prompt_len, new_tokens)
            rounds_ahead = model_drafter.num_rounds_ahead - ahead
            with accepting_every_draft():
                accepted = decode_run(llm, rng, vocab, prompt_len, new_tokens)
            row = dict(draft_quantization=label, k=k, verify_ms=verify["step_ms"],
                       verify_x=verify["step_ms"] / t1, round_ms=round_ms,
                       round_x=round_ms / t1, draft_forward_ms=round_ms / k,
                       spec_step_ms=drafted["step_ms"], queued_step_ms=queued["step_ms"],
                       # of the queued run's rounds, those queued behind their verify step
                       queued_rounds_ahead=rounds_ahead, queued_steps=queued["steps"],
                       queued_accepted_step_ms=accepted["step_ms"],
                       queued_accepted_tokens_per_step=accepted["tokens"] / accepted["steps"])
            cost = verify["step_ms"] + round_ms
            for a in ACCEPTANCE:
                row[f"pred_{a}"] = expected_tokens(a, k) * t1 / cost
                every = a ** k  # the verdict before accepted all k: the round catches up
                step = (1 - every) * queued["step_ms"] + every * accepted["step_ms"]
                row[f"pred_queued_{a}"] = expected_tokens(a, k) * t1 / step
            rows.append(row)
            print(f"[{label} k={k}] {row}", flush=True)
            result["costs"] = rows
            common.write_results("spec_cost", args, result)
        if args.profile_steps:
            core.drafter = FixedDrafter(args.k_e2e)
            step_profiles[f"verify k={args.k_e2e}"] = step_profile(
                llm, rng, vocab, prompt_len, new_tokens, args.timeline_ms)
            model_drafter.k = args.k_e2e
            core.drafter = model_drafter
            step_profiles[f"{label} drafted k={args.k_e2e}"] = step_profile(
                llm, rng, vocab, prompt_len, new_tokens, args.timeline_ms)
            result["step_profiles"] = step_profiles
            common.write_results("spec_cost", args, result)
        if args.profile_round:
            model_drafter.k = args.k_e2e
            core.drafter = timed = TimedDrafter(model_drafter)
            profiles[quantization] = round_profile(llm, timed, rng, vocab, prompt_len,
                                                   new_tokens)
            print(f"[{quantization} k={args.k_e2e} round profile] {profiles[quantization]}",
                  flush=True)
            result["round_profiles"] = profiles
            common.write_results("spec_cost", args, result)
        del llm, core, model_drafter

    k = args.k_e2e
    e2e = None
    if not args.skip_own_draft:
        llm, _ = common.build_llm(target, {**flags, "speculative_method": "draft",
                                           "draft_model": str(target),
                                           "num_speculative_tokens": k})
        core = llm.engine.core
        verify_ms = next((r["verify_ms"] for r in rows if r["k"] == k), None)
        core.drafter = timed = TimedDrafter(core.drafter)
        warm(llm, timed)
        before = core.num_draft_tokens, core.num_accepted_tokens
        own = decode_run(llm, rng, vocab, prompt_len, new_tokens)
        drafts = core.num_draft_tokens - before[0]
        accepted = core.num_accepted_tokens - before[1]
        # per-position acceptance, as the formula's a: E = tokens per verify row
        tokens_per_round = own["tokens"] / own["steps"]
        round_ms = timed.seconds / timed.rounds * 1e3
        core.drafter = timed.inner  # the engine's own way (drafts on the device), untimed
        queued = decode_run(llm, rng, vocab, prompt_len, new_tokens)
        e2e = dict(k=k, acceptance=accepted / max(drafts, 1), tokens_per_round=tokens_per_round,
                   ms_per_token=own["ms_per_token"], plain_ms_per_token=t1,
                   measured_x=t1 / own["ms_per_token"], round_ms=round_ms, verify_ms=verify_ms,
                   queued_ms_per_token=queued["ms_per_token"],
                   measured_queued_x=t1 / queued["ms_per_token"])
        if verify_ms is not None:
            e2e["predicted_x"] = tokens_per_round * t1 / (verify_ms + round_ms)
        result["own_draft"] = e2e
        common.write_results("spec_cost", args, result)

    common.print_table(f"speculative decoding cost, batch 1: {args.target} target, "
                       f"{args.draft} draft (T_1 = {t1:.3f} ms)", rows, [
                           ("draft", "draft_quantization", "s"), ("k", "k", "d"),
                           ("verify ms", "verify_ms", ".3f"),
                           ("x T_1", "verify_x", ".2f"), ("draft round ms", "round_ms", ".3f"),
                           ("x T_1", "round_x", ".2f"),
                           ("per draft ms", "draft_forward_ms", ".3f"),
                           *[(f"pred a={a}", f"pred_{a}", ".2f") for a in ACCEPTANCE],
                           ("queued step ms", "queued_step_ms", ".3f"),
                           ("all accepted", "queued_accepted_step_ms", ".3f"),
                           *[(f"queued a={a}", f"pred_queued_{a}", ".2f")
                             for a in ACCEPTANCE]])
    if e2e is not None:
        common.print_table(f"end to end, {args.target} as its own draft (k = {k}, batch 1)",
                           [e2e], [("acceptance", "acceptance", ".1%"),
                                   ("tok/round", "tokens_per_round", ".2f"),
                                   ("ms/token", "ms_per_token", ".3f"),
                                   ("plain ms", "plain_ms_per_token", ".3f"),
                                   ("measured x", "measured_x", ".2f"),
                                   ("predicted x", "predicted_x", ".2f"),
                                   ("queued ms/token", "queued_ms_per_token", ".3f"),
                                   ("measured x, queued", "measured_queued_x", ".2f")])
    for mode, prof in step_profiles.items():
        common.print_table(
            f"{mode}: {prof['wall_ms']:.3f} ms a step, {prof['gpu_busy_ms']:.3f} ms of "
            f"kernels, {prof['idle_ms']:.3f} ms idle, {prof['kernels_per_step']:.0f} kernels",
            prof["top"], [("kernel", "name", "s"), ("per step", "per_step", ".1f"),
                          ("ms/step", "ms_per_step", ".3f")])
        common.print_table(f"{mode}: where the GPU waited (idle between the kernel that "
                           "ended last and the next to start)", prof["idle"], [
                               ("kernels", "name", "s"), ("per step", "per_step", ".1f"),
                               ("idle ms/step", "ms_per_step", ".3f")])
    for quantization, prof in profiles.items():
        common.print_table(
            f"draft round ({quantization}, k = {args.k_e2e}): {prof['wall_ms']:.3f} ms wall, "
            f"{prof['gpu_busy_ms']:.3f} ms of kernels, {prof['kernels_per_round']:.0f} "
            "kernels a round", prof["top"], [("kernel", "name", "s"),
                                             ("per round", "per_round", ".1f"),
                                             ("ms/round", "ms_per_round", ".3f")])


if __name__ == "__main__":
    main()
