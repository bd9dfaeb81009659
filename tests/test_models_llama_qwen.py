"""Llama, Mistral-style, Qwen2 and Qwen3 logits vs transformers on tiny random checkpoints."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import reference_logits, save_random_checkpoint
from paged_runner import run_paged

from infer.loader import load_hf_dir

transformers = pytest.importorskip("transformers")

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=256)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama-gqa4-untied": LlamaConfig(**BASE, num_attention_heads=8, num_key_value_heads=2,
                                         tie_word_embeddings=False),
        "llama-mha-tied": LlamaConfig(**BASE, num_attention_heads=4, num_key_value_heads=4,
                                      tie_word_embeddings=True),
        "llama3-rope-scaling": LlamaConfig(
            **BASE, num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        "llama-linear-rope-odd-head-dim": LlamaConfig(
            **{**BASE, "hidden_size": 60}, num_attention_heads=3, num_key_value_heads=3,
            head_dim=18,
            rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "mistral-sliding-window": MistralConfig(
            **BASE, num_attention_heads=4, num_key_value_heads=2, sliding_window=5),
        "qwen2-bias": Qwen2Config(**BASE, num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=True),
        "qwen3-qk-norm": Qwen3Config(**BASE, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=24, tie_word_embeddings=False),
    }


CASES = [
    "llama-gqa4-untied", "llama-mha-tied", "llama3-rope-scaling",
    "llama-linear-rope-odd-head-dim", "mistral-sliding-window", "qwen2-bias", "qwen3-qk-norm",
]


def batch(seed: int) -> tuple[list[list[int]], list[int]]:
    """Sequences of different lengths; the first `prefill` tokens are the prompt."""
    rng = random.Random(seed)
    prompt_lens, decode = [1, 7, 13, 22], 5
    seqs = [[rng.randrange(VOCAB) for _ in range(n + decode)] for n in prompt_lens]
    return seqs, prompt_lens


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", [None, 3])
def test_logits_match_transformers(tmp_path, case, chunk):
    config = _configs()[case]
    ref_model = save_random_checkpoint(config, tmp_path)
    model, _ = load_hf_dir(tmp_path)
    seqs, prompt_lens = batch(seed=len(case))
    ours = run_paged(model, seqs, prompt_lens, block_size=4, chunk=chunk)
    refs = reference_logits(ref_model, seqs)
    for got, want in zip(ours, refs):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
