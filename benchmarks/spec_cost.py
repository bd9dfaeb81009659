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
- End to end, the target as its own draft model: drafts accepted as often as bf16 lets
  one- and multi-token forwards agree; the measured speed-up against the plain engine in
  the same run, beside what the formula predicts from this run's own T_verify, T_round
  and acceptance.

    python benchmarks/spec_cost.py [--ks 1 2 3 4 5 6 7 8] [--new-tokens 128]
    python benchmarks/spec_cost.py --tiny     # CPU check, tiny shapes

Prints the tables and writes benchmarks/results/spec_cost_<device>.json.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

ACCEPTANCE = (0.6, 0.7, 0.8, 0.9)


class FixedDrafter:
    """Proposes `k` copies of one token for every sequence (random weights reject them)."""

    own_cache = False

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, requests):
        return [[7] * min(self.k, r.max_new_tokens - len(r.output_token_ids) - 1)
                for r in requests]

    def mirror(self, out, requests, device_input_ids=None) -> None:
        pass


class TimedDrafter:
    """Wraps a drafter and adds up the wall time of its proposal rounds."""

    def __init__(self, inner) -> None:
        self.inner, self.own_cache = inner, inner.own_cache
        self.seconds, self.rounds = 0.0, 0

    def propose(self, requests):
        common.sync()
        start = time.perf_counter()
        drafts = self.inner.propose(requests)  # ends reading the drafts on the host
        self.seconds += time.perf_counter() - start
        self.rounds += 1
        return drafts

    def mirror(self, out, requests, device_input_ids=None) -> None:
        self.inner.mirror(out, requests, device_input_ids)


def warm(llm, timed: TimedDrafter) -> None:
    """One short generation through the drafter, then its clock from zero."""
    from infer import SamplingParams

    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    timed.seconds, timed.rounds = 0.0, 0


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

    timed(8)  # warm-up
    t1, s1, n1 = timed(1)
    tn, sn, nn = timed(1 + new_tokens)
    seconds, steps, tokens = max(tn - t1, 1e-9), sn - s1, nn - n1
    return dict(step_ms=seconds / steps * 1e3, ms_per_token=seconds / tokens * 1e3 * batch,
                steps=steps, tokens=tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="llama-3.1-8b")
    p.add_argument("--draft", default="llama-3.2-1b")
    p.add_argument("--ks", type=int, nargs="+", default=None, help="default 1..8")
    p.add_argument("--draft-quantization", default="auto",
                   help="the draft model's weights (auto, none, int8, fp8, gguf); the "
                   "end-to-end run's draft (the target itself) stays in the target's format")
    p.add_argument("--k-e2e", type=int, default=4)
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
    draft = common.get_checkpoint(args.draft, tiny, args.ckpt_root)
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
    del llm

    llm, _ = common.build_llm(target, {**flags, "speculative_method": "draft",
                                       "draft_model": str(draft),
                                       "draft_quantization": args.draft_quantization,
                                       "num_speculative_tokens": max(ks)})
    core = llm.engine.core
    model_drafter = core.drafter
    rows = []
    for k in ks:
        core.drafter = FixedDrafter(k)
        verify = decode_run(llm, rng, vocab, prompt_len, new_tokens)
        model_drafter.k = k
        core.drafter = timed = TimedDrafter(model_drafter)
        warm(llm, timed)
        drafted = decode_run(llm, rng, vocab, prompt_len, new_tokens)
        round_ms = timed.seconds / timed.rounds * 1e3
        row = dict(k=k, verify_ms=verify["step_ms"], verify_x=verify["step_ms"] / t1,
                   round_ms=round_ms, round_x=round_ms / t1,
                   draft_forward_ms=round_ms / k,
                   spec_step_ms=drafted["step_ms"])
        cost = verify["step_ms"] + round_ms
        for a in ACCEPTANCE:
            row[f"pred_{a}"] = expected_tokens(a, k) * t1 / cost
        rows.append(row)
        print(f"[k={k}] {row}", flush=True)
        result["costs"] = rows
        common.write_results("spec_cost", args, result)
    del llm, core, model_drafter

    k = args.k_e2e
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
    e2e = dict(k=k, acceptance=accepted / max(drafts, 1), tokens_per_round=tokens_per_round,
               ms_per_token=own["ms_per_token"], plain_ms_per_token=t1,
               measured_x=t1 / own["ms_per_token"], round_ms=round_ms, verify_ms=verify_ms)
    if verify_ms is not None:
        e2e["predicted_x"] = tokens_per_round * t1 / (verify_ms + round_ms)
    result["own_draft"] = e2e
    common.write_results("spec_cost", args, result)

    common.print_table(f"speculative decoding cost, batch 1: {args.target} target, "
                       f"{args.draft} draft (T_1 = {t1:.3f} ms)", rows, [
                           ("k", "k", "d"), ("verify ms", "verify_ms", ".3f"),
                           ("x T_1", "verify_x", ".2f"), ("draft round ms", "round_ms", ".3f"),
                           ("x T_1", "round_x", ".2f"),
                           ("per draft ms", "draft_forward_ms", ".3f"),
                           *[(f"pred a={a}", f"pred_{a}", ".2f") for a in ACCEPTANCE]])
    common.print_table(f"end to end, {args.target} as its own draft (k = {k}, batch 1)",
                       [e2e], [("acceptance", "acceptance", ".1%"),
                               ("tok/round", "tokens_per_round", ".2f"),
                               ("ms/token", "ms_per_token", ".3f"),
                               ("plain ms", "plain_ms_per_token", ".3f"),
                               ("measured x", "measured_x", ".2f"),
                               ("predicted x", "predicted_x", ".2f")])


if __name__ == "__main__":
    main()
