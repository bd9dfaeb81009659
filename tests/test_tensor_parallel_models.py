"""Tensor parallelism, model side: every architecture's logits on N ranks (a gloo world of
CPU processes) equal its logits on one, through chunked prefill (later chunks read the
paged cache) and decode, on tiny random checkpoints written by transformers.

One world per size runs every case of that size (a spawn costs more than a case): each rank
loops over the cases and returns all their logits (or a case's traceback, so one broken
case fails only its own test).
"""

from __future__ import annotations

import random
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import save_random_checkpoint
from paged_runner import run_paged
from tp_ranks import run_ranks

pytest.importorskip("transformers")

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=256)
PROMPT_LENS, DECODE, CHUNK = [1, 7, 13, 22], 5, 3
ATOL, RTOL = 1e-4, 1e-4
CASES = ["llama-gqa-untied", "llama-kv-replicated", "llama-tied-odd-vocab", "qwen2-bias",
         "qwen3-qk-norm", "mistral-sliding-window", "gemma3-mixed-softcap", "gemma3-mqa-untied",
         "gpt2-tied", "gpt2-untied-odd-vocab", "smollm2-like", "llama-kv-replicated-3",
         "qwen2-bias-3", "gemma3-3", "gpt2-3"]


def _configs() -> dict[str, tuple[int, Any]]:
    """case -> (tensor_parallel_size, transformers config)."""
    from transformers import (
        Gemma3TextConfig,
        GPT2Config,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    odd = {**BASE, "vocab_size": VOCAB + 1}  # rows split unevenly: the last part padded
    gemma = dict(BASE, sliding_window=5)
    return {
        "llama-gqa-untied": (2, LlamaConfig(**BASE, num_attention_heads=8,
                                            num_key_value_heads=2, tie_word_embeddings=False)),
        "llama-kv-replicated": (2, LlamaConfig(**BASE, num_attention_heads=8,
                                               num_key_value_heads=1,
                                               tie_word_embeddings=False)),
        "llama-tied-odd-vocab": (2, LlamaConfig(**odd, num_attention_heads=4,
                                                num_key_value_heads=4, tie_word_embeddings=True)),
        "qwen2-bias": (2, Qwen2Config(**odd, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True)),
        "qwen3-qk-norm": (2, Qwen3Config(**BASE, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=24, tie_word_embeddings=False)),
        "mistral-sliding-window": (2, MistralConfig(**BASE, num_attention_heads=4,
                                                    num_key_value_heads=2, sliding_window=5)),
        # sliding and global layers with their own RoPE, q/k norms, four norms a layer, the
        # embedding scale, the final soft-cap (large enough to leave the logits apart)
        "gemma3-mixed-softcap": (2, Gemma3TextConfig(
            **gemma | {"num_hidden_layers": 3}, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, query_pre_attn_scalar=20, final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            })),
        "gemma3-mqa-untied": (2, Gemma3TextConfig(
            **gemma, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
            layer_types=["full_attention", "sliding_attention"], tie_word_embeddings=False)),
        "gpt2-tied": (2, GPT2Config(vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2,
                                    n_positions=64)),
        "gpt2-untied-odd-vocab": (2, GPT2Config(vocab_size=VOCAB + 1, n_embd=64, n_head=4,
                                                n_layer=2, n_positions=64,
                                                tie_word_embeddings=False)),
        # SmolLM2's head layout (9 query heads, 3 KV heads, tied) split three ways
        "smollm2-like": (3, LlamaConfig(**odd | {"hidden_size": 72}, num_attention_heads=9,
                                        num_key_value_heads=3, tie_word_embeddings=True)),
        "llama-kv-replicated-3": (3, LlamaConfig(**odd | {"hidden_size": 72}, num_attention_heads=6,
                                                 num_key_value_heads=1,
                                                 tie_word_embeddings=False)),
        "qwen2-bias-3": (3, Qwen2Config(**BASE | {"hidden_size": 72}, num_attention_heads=6,
                                        num_key_value_heads=3, tie_word_embeddings=True)),
        "gemma3-3": (3, Gemma3TextConfig(
            **gemma | {"hidden_size": 72}, num_attention_heads=3, num_key_value_heads=1,
            head_dim=32, final_logit_softcapping=3.0,
            layer_types=["sliding_attention", "full_attention"])),
        "gpt2-3": (3, GPT2Config(vocab_size=VOCAB + 1, n_embd=48, n_head=6, n_layer=2,
                                 n_positions=64)),
    }


def batch(vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n + DECODE)] for n in PROMPT_LENS], PROMPT_LENS


def _logits(path: str) -> tuple[list[torch.Tensor], tuple[int, int, int]]:
    """One case on this process (within a `tensor_parallel` context on a rank): the logits,
    and how much of the model this process holds (embedding rows, query and KV heads of
    the first layer)."""
    from infer.loader import load_hf_dir

    model, cfg = load_hf_dir(path)
    seqs, lens = batch(cfg.vocab_size, seed=len(path))
    attn = model.model.layers[0]
    qkv = (attn.self_attn if hasattr(attn, "self_attn") else attn.attn).qkv_proj
    held = (model.model.embed_tokens.weight.shape[0], qkv.num_heads, qkv.num_kv_heads)
    return run_paged(model, seqs, lens, block_size=4, chunk=CHUNK), held


def _rank_cases(group, paths: dict[str, str]) -> dict[str, Any]:
    """On each rank: every case's logits, or the traceback of a case that failed."""
    from infer.distributed.group import tensor_parallel

    out: dict[str, Any] = {}
    for name, path in paths.items():
        try:
            with tensor_parallel(group):
                out[name] = _logits(path)
        except Exception:
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[int, Path]]:
    root = tmp_path_factory.mktemp("tp_models")
    out = {}
    for name, (size, config) in _configs().items():
        save_random_checkpoint(config, root / name)
        out[name] = (size, root / name)
    return out


@pytest.fixture(scope="module")
def tp_results(checkpoints) -> dict[str, list[Any]]:
    """case -> every rank's result, one world per size."""
    results = {}
    for size in sorted({s for s, _ in checkpoints.values()}):
        paths = {n: str(p) for n, (s, p) in checkpoints.items() if s == size}
        ranks = run_ranks(_rank_cases, size, paths)
        for name in paths:
            results[name] = [r[name] for r in ranks]
    return results


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_logits_equal_one_rank(checkpoints, tp_results, case):
    size, path = checkpoints[case]
    want, (vocab, heads, kv_heads) = _logits(str(path))
    for rank, result in enumerate(tp_results[case]):
        assert not isinstance(result, str), f"rank {rank} failed:\n{result}"
        got, held = result
        assert held == (-(-vocab // size), heads // size, max(kv_heads // size, 1))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)
