"""A real GGUF file kept quantized against its dequantized float32 model, as `LLM` runs them:
greedy text of a fixed prompt set, and every decode position teacher-forced (one row a
step, the reference's continuation fed back) to count where the argmax agrees. Where a
text parts from the reference, the reference's margin between the two tokens against the
kept model's logit error at that position says whether the parting is within the
quantized path's error. Each `--variant` (engine flags, comma-separated) is one kept run.

    python benchmarks/gguf_greedy.py --gguf FILE.gguf \\
        --variant gguf_int8_activations=true --variant gguf_int8_activations=false

Prints one table and writes benchmarks/results/gguf_greedy_<device>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import common

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colors are", "Water boils at", "List three fruits:",
           "Translate to French: good morning", "The largest planet in the solar system is"]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _decode_logits(model: torch.nn.Module, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Float64 logits at every position, the tokens past `prompt_len` fed one a step."""
    from paged_runner import run_paged
    return run_paged(model, [tokens], [prompt_len])[0].double()


def _compare(ref_model: torch.nn.Module, kept, want: list, params) -> dict:
    got = kept.generate(PROMPTS, params, use_tqdm=False)
    partings, agree, total, errors = [], 0, 0, []
    for w, g in zip(want, got):
        a, b = list(w.outputs[0].token_ids), list(g.outputs[0].token_ids)
        seq, p = w.prompt_token_ids + a, len(w.prompt_token_ids)
        r = _decode_logits(ref_model, seq, p)
        k = _decode_logits(kept.engine.model, seq, p)
        agree += int((r[p - 1:-1].argmax(-1) == k[p - 1:-1].argmax(-1)).sum())
        total += len(a)
        errors.append(((k[p - 1:] - r[p - 1:]).abs().max() / r[p - 1:].abs().max()).item())
        i = _first_difference(a, b)
        if i is not None:
            at = p - 1 + i  # the logits that chose token i
            margin = (r[at, a[i]] - r[at, b[i]]).item()
            error = (k[at] - r[at]).abs().max().item()
            partings.append({"prompt": w.prompt, "token": i, "reference": a[i], "kept": b[i],
                             "margin": margin, "logit_error": error,
                             "within_error": 0 <= margin <= error})
    return {"identical": len(PROMPTS) - len(partings), "agree": agree, "positions": total,
            "max_rel_error": max(errors), "min_rel_error": min(errors), "partings": partings}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True, help="a GGUF file")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE,...",
                   help="engine flags of one kept-quantized run (repeatable; none: defaults)")
    common.add_common_args(p)
    args = p.parse_args()
    from infer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4 if args.tiny else args.tokens,
                            ignore_eos=True)
    small = {"max_model_len": 512, "num_blocks": 256}
    ref = LLM(args.gguf, quantization="none", dtype="float32", **small)
    want = ref.generate(PROMPTS, params, use_tqdm=False)
    rows, payload = [], {"prompts": PROMPTS, "tokens": params.max_tokens, "runs": []}
    for variant in args.variant or [""]:
        flags = common.parse_engine_flags([f for f in variant.split(",") if f])
        start = time.perf_counter()
        kept = LLM(args.gguf, **{"quantization": "gguf", **small, **flags})
        run = {"flags": flags, "dtype": str(kept.engine.dtype),
               **_compare(ref.engine.model, kept, want, params)}
        run["seconds"] = time.perf_counter() - start
        for part in run["partings"]:
            print(f"  {variant or 'defaults'}: {part['prompt']!r} parts at token "
                  f"{part['token']} ({part['reference']} vs {part['kept']}): reference margin "
                  f"{part['margin']:.3f}, kept model's logit error {part['logit_error']:.3f}")
        payload["runs"].append(run)
        rows.append({"variant": variant or "defaults", "dtype": run["dtype"],
                     "identical": f"{run['identical']}/{len(PROMPTS)}",
                     "agree": f"{run['agree']}/{run['positions']}",
                     "error": f"{run['min_rel_error']:.1%}-{run['max_rel_error']:.1%}",
                     "within": all(x["within_error"] for x in run["partings"])})
        common.write_results("gguf_greedy", args, payload)
        del kept
        common.free_memory()
    common.print_table(
        f"{Path(args.gguf).name} kept quantized vs dequantized float32, greedy, "
        f"{len(PROMPTS)} prompts x {params.max_tokens} tokens",
        rows, [("variant", "variant", ""), ("dtype", "dtype", ""),
               ("texts identical", "identical", ""), ("decode argmax agree", "agree", ""),
               ("max logit error", "error", ""), ("partings within error", "within", "")])
    print(f"wrote {common.results_path('gguf_greedy', args)}")


if __name__ == "__main__":
    main()
