"""GPU smoke check of the engine: random weights in a real shape, auto-sized KV pool,
greedy decode, the reference torch backend. Prints what it measured.

    PYTHONPATH=src python benchmarks/gpu_smoke.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch


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


def main() -> None:
    from infer import LLM, SamplingParams

    shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                 num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 max_position_embeddings=8192, tie_word_embeddings=True)
    with tempfile.TemporaryDirectory() as tmp:
        write_random_llama(Path(tmp), **shape)
        start = time.perf_counter()
        llm = LLM(tmp, max_model_len=2048)
        print(f"engine start {time.perf_counter() - start:.1f} s, device {llm.engine.device}, "
              f"dtype {llm.engine.dtype}, pool {llm.engine.kv.pool.num_blocks} blocks of "
              f"{llm.engine.block_size}")
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        prompts = [[(7 * i + j) % 49152 for j in range(100 + i)] for i in range(32)]
        llm.generate(prompts[:2], params, use_tqdm=False)
        for batch in (1, 8, 32):
            torch.cuda.synchronize()
            t = time.perf_counter()
            outs = llm.generate(prompts[:batch], params, use_tqdm=False)
            dt = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"batch {batch:3d}: {n} tokens in {dt:.2f} s = {n / dt:.0f} tok/s")
        alone = llm.generate(prompts[3], params, use_tqdm=False)[0].outputs[0].token_ids
        together = outs[3].outputs[0].token_ids
        same = sum(a == b for a, b in zip(alone, together))
        print(f"greedy alone vs in batch of 32: {same}/{len(alone)} tokens equal")
        print("stats", llm.engine.stats())
    sys.exit(0)


if __name__ == "__main__":
    main()
