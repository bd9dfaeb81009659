"""Does a quantized 8B model serve within a small memory budget? The Llama-3.1-8B shape
(random bf16 checkpoint) loaded with `quantization=fp8` (or another format) under
`gpu_memory_utilization` set to `--budget-gib` of this GPU, `max_model_len=4096`, then one
request with a ~4,000-token prompt. Reports the weights' bytes on the device, the peak
memory allocated while loading (before the KV cache), the KV cache's size, and the peak
over the whole run.

    python benchmarks/memory_budget.py [--budget-gib 16] [--engine quantization=fp8]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--budget-gib", type=float, default=16.0)
    parser.add_argument("--prompt-len", type=int, default=4000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("memory_budget.py measures GPU memory: no GPU here")
    from infer import SamplingParams
    from infer.engine.setup import load_model_and_tokenizer

    path = common.get_checkpoint(args.model, args.tiny, args.ckpt_root)
    flags = common.merged_flags({"quantization": "fp8"}, common.parse_engine_flags(args.engine))
    total = torch.cuda.get_device_properties(0).total_memory
    common.free_memory()
    torch.cuda.reset_peak_memory_stats()
    model, *_ = load_model_and_tokenizer(str(path), torch.bfloat16, torch.device("cuda"),
                                         flags["quantization"])
    load_peak = torch.cuda.max_memory_allocated()
    del model
    common.free_memory()
    torch.cuda.reset_peak_memory_stats()
    flags.update(gpu_memory_utilization=args.budget_gib * 2**30 / total, max_model_len=4096)
    llm, build_s = common.build_llm(path, flags)
    engine = llm.engine
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    stats = engine.stats()
    vocab = common.load_shape(args.model, args.tiny)["vocab_size"]
    prompt = common.random_prompts(random.Random(0), 1, args.prompt_len, vocab)
    t = time.perf_counter()
    [out] = llm.generate(prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
                         use_tqdm=False)
    seconds = time.perf_counter() - t
    row = dict(model=args.model, quantization=flags["quantization"],
               budget_GiB=args.budget_gib, weights_GB=weights / 1e9,
               load_peak_GB=load_peak / 1e9, run_peak_GB=torch.cuda.max_memory_allocated() / 1e9,
               kv_blocks=stats.get("kv_blocks_total"), prompt_tokens=args.prompt_len,
               generated=len(out.outputs[0].token_ids), request_s=seconds,
               engine_build_s=build_s, stats=stats)
    common.write_results("memory_budget", args, {"rows": [row]})
    common.print_table(f"{args.model} in a {args.budget_gib:g} GiB budget", [row], [
        ("quantization", "quantization", ""), ("weights GB", "weights_GB", ".2f"),
        ("load peak GB", "load_peak_GB", ".2f"), ("run peak GB", "run_peak_GB", ".2f"),
        ("KV blocks", "kv_blocks", ""), ("prompt", "prompt_tokens", ""),
        ("generated", "generated", ""), ("request s", "request_s", ".2f")])


if __name__ == "__main__":
    main()
