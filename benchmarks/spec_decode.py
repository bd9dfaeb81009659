"""Speculative decoding with real weights: the embedded SmolLM2 (or --model) over a fixed
prompt set of the kinds where drafts pay or do not (chat answers, code edits, summaries
that copy from the prompt), greedy, each `--method` against none in the same run, at
batch 1 (prompts one after another) and batch 8 (all together). Reports the drafts'
acceptance rate, tokens per target forward, and tok/s.

    python benchmarks/spec_decode.py [--methods ngram self self=8 draft=PATH]
        [--batches 1 8] [--max-tokens 96] [--engine num_speculative_tokens=4]
        [--engine device=cuda]

A method is `ngram`, `self` (half the layers), `self=L` (the first L layers) or
`draft=PATH` (a draft model).

Prints one table and writes benchmarks/results/spec_decode_<device>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)
'''
ARTICLE = ("The city council met on Tuesday to discuss the new bus routes. The council "
           "agreed to add two routes to the north side of the city, where residents had "
           "asked for better service for years. The new routes will start in March and "
           "will run every fifteen minutes during the day.")
PROMPTS = {
    "chat": ["What are three good habits for staying healthy? Answer briefly.",
             "Explain what a prime number is to a child.",
             "Give me a short recipe for pancakes."],
    "code edit": [f"Rewrite this function so that it returns 0 for an empty list:\n{CODE}\n",
                  f"Add a docstring to this function and repeat the whole function:\n{CODE}\n",
                  f"Rename the variable total to acc in this code:\n{CODE}\n"],
    "summary": [f"{ARTICLE}\n\nSummarise the article in one sentence, using its words:",
                f"{ARTICLE}\n\nWhat did the council agree to? Quote the article.",
                f"{ARTICLE}\n\nRepeat the last sentence of the article."],
}


def method_flags(method: str) -> dict:
    name, _, value = method.partition("=")
    if name == "self" and value:
        return {"speculative_method": "self", "self_draft_layers": int(value)}
    if name == "draft":
        return {"speculative_method": "draft", "draft_model": value}
    return {"speculative_method": name}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--methods", nargs="+", default=["ngram"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--completion", action="store_true",
                   help="prompts as plain text, not chat (base models without a template)")
    common.add_common_args(p)
    args = p.parse_args()
    from infer import LLM, SamplingParams

    flags = {"device": "cpu", **common.parse_engine_flags(args.engine)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    chats = {kind: [[{"role": "user", "content": text}] for text in texts]
             for kind, texts in PROMPTS.items()}
    rows, texts = [], {}
    for method in ["none", *args.methods]:
        llm = LLM(args.model, **method_flags(method), **flags)
        llm.generate("Hello", SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        core = llm.engine.core
        for kind, messages in chats.items():
            for batch in args.batches:
                before = (core.num_steps, core.num_draft_tokens, core.num_accepted_tokens)
                start = time.perf_counter()
                outs = []
                for i in range(0, len(messages), batch):
                    part = messages[i:i + batch]
                    outs += (llm.generate([m[0]["content"] for m in part], params,
                                          use_tqdm=False) if args.completion
                             else llm.chat(part, params, use_tqdm=False))
                seconds = time.perf_counter() - start
                steps, drafts, accepted = (now - then for now, then in zip(
                    (core.num_steps, core.num_draft_tokens, core.num_accepted_tokens), before))
                generated = sum(len(o.outputs[0].token_ids) for o in outs)
                texts[(kind, batch, method)] = [o.outputs[0].token_ids for o in outs]
                rows.append(dict(
                    method=method, kind=kind, batch=batch, generated=generated,
                    tok_per_s=generated / seconds, steps=steps,
                    tokens_per_forward=generated / steps / min(batch, len(messages)),
                    drafts=drafts, acceptance=accepted / drafts if drafts else None,
                    same_text=texts[(kind, batch, method)] == texts.get((kind, batch, "none"))))
                common.write_results("spec_decode", args, {"rows": rows})
        del llm
    base = {(r["kind"], r["batch"]): r["tok_per_s"] for r in rows if r["method"] == "none"}
    for r in rows:
        r["speedup"] = r["tok_per_s"] / base[(r["kind"], r["batch"])]
    common.write_results("spec_decode", args, {"rows": rows})
    common.print_table("speculative decoding (greedy, chat template)", rows, [
        ("method", "method", ""), ("prompts", "kind", ""), ("batch", "batch", "d"),
        ("tok/s", "tok_per_s", ".1f"), ("x none", "speedup", ".2f"),
        ("tok/seq/step", "tokens_per_forward", ".2f"), ("drafts", "drafts", "d"),
        ("accepted", "acceptance", ".0%"), ("same text", "same_text", "")])


if __name__ == "__main__":
    main()
