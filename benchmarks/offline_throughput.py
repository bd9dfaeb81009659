"""Offline throughput: infer vs HF transformers `generate` on the same random workload.

Fixed seed, random prompt token ids, random output lengths, ignore_eos. Prints a table and
writes JSON under benchmarks/results/.

    python benchmarks/offline_throughput.py --num-requests 16   # CPU, SmolLM2 (default)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from infer import LLM
from infer.bench.offline import time_generate
from infer.loader.resolve import resolve_model

RESULTS = Path(__file__).parent / "results"


def workload(args, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [
        ([rng.randrange(vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))],
         rng.randint(args.min_output, args.max_output))
        for _ in range(args.num_requests)
    ]


def run_infer(llm: LLM, requests) -> dict:
    result = time_generate(llm, [p for p, _ in requests], [n for _, n in requests])
    assert result["output_tokens"] == result["expected_output_tokens"]
    return {"engine": "infer", "seconds": result["seconds"],
            "output_tokens": result["output_tokens"]}


def run_transformers(args, requests) -> dict:
    from transformers import AutoModelForCausalLM

    source = resolve_model(args.model)
    if source.format == "gguf":
        model = AutoModelForCausalLM.from_pretrained(
            source.path.parent, gguf_file=source.path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    model.eval()
    pad = 0
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(requests), args.max_num_seqs):
        batch = requests[i:i + args.max_num_seqs]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(n for _, n in batch)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
        useful += sum(n for _, n in batch)
    elapsed = time.perf_counter() - start
    return {"engine": "transformers", "seconds": elapsed, "output_tokens": useful}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-peer", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, device=args.device, max_num_seqs=args.max_num_seqs,
              num_blocks=args.num_blocks)
    requests = workload(args, llm.engine.model_config.vocab_size)
    rows = [run_infer(llm, requests)]
    del llm
    if not args.skip_peer:
        rows.append(run_transformers(args, requests))
    for row in rows:
        row["output_tok_per_s"] = row["output_tokens"] / row["seconds"]
    if len(rows) == 2:
        rows[0]["ratio_vs_transformers"] = rows[0]["output_tok_per_s"] / rows[1][
            "output_tok_per_s"]
    result = {
        "benchmark": "offline_throughput", "args": vars(args), "rows": rows,
        "host": platform.processor() or platform.machine(), "torch": torch.__version__,
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"offline_throughput_{args.device}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"\n{'engine':<14}{'seconds':>10}{'out tokens':>12}{'tok/s':>10}")
    for row in rows:
        print(f"{row['engine']:<14}{row['seconds']:>10.2f}{row['output_tokens']:>12}"
              f"{row['output_tok_per_s']:>10.1f}")
    if len(rows) == 2:
        print(f"infer / transformers: {rows[0]['ratio_vs_transformers']:.2f}x")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
