"""GPU smoke check of the engine's variants: random weights in a real shape, greedy decode
at several batch sizes, for the torch reference backend, the Triton backend eagerly, and
the Triton backend with CUDA graphs. Prints tok/s per variant and batch size, and how many
greedy tokens each variant shares with the reference.

    PYTHONPATH=src python benchmarks/gpu_smoke.py [--shape smollm2|llama-1b]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=131072, tie_word_embeddings=True,
                     rope_theta=500000.0),
}
VARIANTS = {
    "torch": dict(attention_backend="torch", kernel_backend="torch", cuda_graphs=False),
    "triton": dict(attention_backend="triton", kernel_backend="triton", cuda_graphs=False),
    "triton+graphs": dict(attention_backend="triton", kernel_backend="triton",
                          cuda_graphs=True),
    # the same without async scheduling: its tokens must equal the row above exactly
    "triton+graphs sync": dict(attention_backend="triton", kernel_backend="triton",
                               cuda_graphs=True, async_scheduling=False),
}


def write_random_llama(path: Path, **shape) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))


def run_variant(path: str, name: str, flags: dict, vocab: int, batches: list[int]):
    from infer import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(path, max_model_len=2048, num_blocks=8192, **flags)
    setup = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = [[(7 * i + j) % vocab for j in range(100 + i)] for i in range(max(batches))]
    llm.generate(prompts[:2], params, use_tqdm=False)
    rates, tokens = {}, None
    for batch in batches:
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts[:batch], params, use_tqdm=False)
        dt = time.perf_counter() - t
        rates[batch] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
        tokens = [o.outputs[0].token_ids for o in outs]
    capture = llm.engine.graph_capture_seconds
    print(f"{name}: engine start {setup:.1f} s (graph capture {capture:.1f} s)", flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return rates, tokens, capture


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,8,32,64")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    shape = SHAPES[args.shape]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_random_llama(Path(tmp), **shape)
        for name, flags in VARIANTS.items():
            results[name] = run_variant(tmp, name, flags, shape["vocab_size"], batches)
    ref = results["torch"][1]
    print(f"\n{args.shape} on {torch.cuda.get_device_name()}: greedy decode tok/s "
          "(64 new tokens, 100+ token prompts)")
    print("| variant | " + " | ".join(f"b{b}" for b in batches)
          + " | same tokens as torch | same as sync graphs |")
    print("|---|" + "---:|" * (len(batches) + 2))
    sync = results["triton+graphs sync"][1]
    for name, (rates, tokens, _) in results.items():
        print(f"| {name} | " + " | ".join(f"{rates[b]:.0f}" for b in batches)
              + f" | {_same(tokens, ref)} | {_same(tokens, sync)} |")


def _same(tokens: list[list[int]], ref: list[list[int]]) -> str:
    same = sum(a == b for x, y in zip(tokens, ref) for a, b in zip(x, y))
    return f"{same}/{sum(len(x) for x in ref)}"


if __name__ == "__main__":
    main()
