"""Prefill: time to first token and achieved TFLOP/s, llama-3.1-8b shape, bf16, random
weights, one prompt of 512, 2048 and 8192 random tokens.

TTFT = wall time of `generate(prompt, max_tokens=1)` (tokenised ids in, one token out),
after one warm-up call at the same length; each timed call uses a fresh random prompt (so
the prefix cache never hits); the median of --repeats calls is reported.

FLOPs of one prefill of T tokens:
  2 x body params x T                     (body = all parameters but the embedding table
                                           and the LM head)
  + 2 x vocab x hidden                    (the LM head, for the last token only)
  + 2 x 2 x layers x heads x head_dim x T^2 / 2   (QK^T and PV, causal)
reported as TFLOP/s = FLOPs / TTFT and as a fraction of the bf16 matmul rate measured in the
same run. Also shown: weight bytes / TTFT as a fraction of the measured copy bandwidth.

The script sizes max_model_len to the longest prompt; every other engine setting (e.g. the
token budget per step, max_num_batched_tokens, which splits long prompts into chunks) stays
the engine's default unless given with --engine.

    PYTHONPATH=src python benchmarks/prefill.py [--engine attention_backend=triton ...]
    python benchmarks/prefill.py --tiny
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def prefill_flops(counts: common.ShapeCounts, tokens: int) -> float:
    linear = 2.0 * counts.body_params * tokens + 2.0 * counts.lm_head_params
    attn = counts.attn_flops(tokens, (tokens + 1) / 2)  # causal: mean visible keys
    return linear + attn


def main() -> None:
    from infer import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="default 512 2048 8192 (tiny: 32 128)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.lengths = args.lengths or ([32, 128] if args.tiny else [512, 2048, 8192])
    user_flags = common.parse_engine_flags(args.engine)
    common.setup_cpu_threads()
    ceil = common.ceilings()
    path = common.get_checkpoint(args.model, args.tiny, args.ckpt_root)
    shape = common.load_shape(args.model, args.tiny)
    counts = common.shape_counts(shape)
    defaults = dict(max_model_len=max(args.lengths) + 64, max_num_seqs=1)
    llm, build_s = common.build_llm(path, common.merged_flags(defaults, user_flags))
    nbytes = common.dtype_bytes(llm.engine.dtype)
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows: list[dict] = []
    out = None
    for length in args.lengths:
        def once(length=length) -> float:
            prompt = common.random_prompts(rng, 1, length, shape["vocab_size"])[0]
            common.sync()
            t = time.perf_counter()
            res = llm.generate([prompt], params, use_tqdm=False)
            common.sync()
            assert len(res[0].outputs[0].token_ids) == 1
            return time.perf_counter() - t

        once()  # warm-up at this length
        times = [once() for _ in range(args.repeats)]
        ttft = statistics.median(times)
        flops = prefill_flops(counts, length)
        wbytes = counts.step_weight_params * nbytes
        row = dict(model=args.model, tokens=length, ttft_ms=ttft * 1e3,
                   ttft_all_ms=[t * 1e3 for t in times], tok_per_s=length / ttft,
                   TFLOPs=flops / ttft / 1e12,
                   frac_matmul=flops / ttft / 1e12 / ceil["matmul_TFLOPs"],
                   attn_share=counts.attn_flops(length, (length + 1) / 2) / flops,
                   frac_copy_weights=wbytes / ttft / 1e9 / ceil["copy_GBps"])
        rows.append(row)
        print(f"[infer] {length} tokens: TTFT {row['ttft_ms']:.1f} ms, "
              f"{row['TFLOPs']:.1f} TFLOP/s ({100 * row['frac_matmul']:.1f}% matmul)",
              flush=True)
        out = common.write_results("prefill", args, dict(
            ceilings=ceil, engine_build_s=build_s, engine=common.engine_info(llm),
            body_params=counts.body_params, rows=rows))
    print(f"\nwrote {out}")
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, matmul {ceil['matmul_TFLOPs']:.1f} "
          f"TFLOP/s; {args.model}, body params {counts.body_params / 1e9:.2f}B, engine flags "
          f"{user_flags or '{}'}, median of {args.repeats} after a warm-up")
    common.print_table(
        "prefill (TTFT of one prompt, max_tokens=1)", rows,
        [("model", "model", ""), ("tokens", "tokens", "d"), ("TTFT ms", "ttft_ms", ".1f"),
         ("prompt tok/s", "tok_per_s", ".0f"), ("TFLOP/s", "TFLOPs", ".1f"),
         ("%matmul", "frac_matmul", ".1%"), ("attn share", "attn_share", ".1%"),
         ("%copyBW (weights)", "frac_copy_weights", ".1%")])


if __name__ == "__main__":
    main()
