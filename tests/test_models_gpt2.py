"""GPT-2 logits vs transformers on tiny random checkpoints, and GPT-2 config/layout handling."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from checkpoints import reference_logits, save_random_checkpoint
from paged_runner import run_paged
from safetensors.torch import load_file, save_file

from infer.loader import ModelLoadError, load_hf_dir

transformers = pytest.importorskip("transformers")

VOCAB = 96
BASE = dict(vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2, n_positions=64,
            bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)


def _configs():
    from transformers import GPT2Config

    return {
        "gpt2-tied": GPT2Config(**BASE),
        "gpt2-odd-head-dim-n-inner": GPT2Config(**{**BASE, "n_embd": 60}, n_inner=80),
        "gpt2-untied-exact-gelu-upcast": GPT2Config(
            **BASE, tie_word_embeddings=False, activation_function="gelu",
            reorder_and_upcast_attn=True),
    }


CASES = ["gpt2-tied", "gpt2-odd-head-dim-n-inner", "gpt2-untied-exact-gelu-upcast"]


def batch(seed: int) -> tuple[list[list[int]], list[int]]:
    """Sequences of different lengths; the first `prefill` tokens are the prompt."""
    rng = random.Random(seed)
    prompt_lens, decode = [1, 7, 13, 22], 5
    seqs = [[rng.randrange(VOCAB) for _ in range(n + decode)] for n in prompt_lens]
    return seqs, prompt_lens


def _assert_matches(model, ref_model, seed: int, chunk: int | None) -> None:
    seqs, prompt_lens = batch(seed)
    ours = run_paged(model, seqs, prompt_lens, block_size=4, chunk=chunk)
    for got, want in zip(ours, reference_logits(ref_model, seqs)):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", [None, 3])
def test_logits_match_transformers(tmp_path, case, chunk):
    ref_model = save_random_checkpoint(_configs()[case], tmp_path)
    model, cfg = load_hf_dir(tmp_path)
    assert cfg.architecture == "gpt2"
    assert cfg.tie_word_embeddings == (case != "gpt2-untied-exact-gelu-upcast")
    _assert_matches(model, ref_model, seed=len(case), chunk=chunk)


def test_openai_layout_loads(tmp_path):
    """The original checkpoints: no `transformer.` prefix, causal-mask buffers saved beside
    the parameters, no `lm_head.weight`."""
    hf_dir, openai_dir = tmp_path / "hf", tmp_path / "openai"
    ref_model = save_random_checkpoint(_configs()["gpt2-tied"], hf_dir)
    tensors = {
        name.removeprefix("transformer."): tensor
        for name, tensor in load_file(hf_dir / "model.safetensors").items()
        if name != "lm_head.weight"
    }
    n = BASE["n_positions"]
    for layer in range(BASE["n_layer"]):
        tensors[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(1, 1, n, n))
        tensors[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    openai_dir.mkdir()
    save_file(tensors, openai_dir / "model.safetensors")
    shutil.copy(hf_dir / "config.json", openai_dir / "config.json")
    model, _ = load_hf_dir(openai_dir)
    _assert_matches(model, ref_model, seed=1, chunk=None)


@pytest.mark.parametrize("option", [
    {"scale_attn_by_inverse_layer_idx": True},
    {"scale_attn_weights": False},
    {"add_cross_attention": True},
    {"n_embd": 62},
])
def test_unsupported_config_rejected(tmp_path, option):
    config = {"model_type": "gpt2", **BASE, **option}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        load_hf_dir(tmp_path)
    assert "config.json" in str(info.value)
    assert next(iter(option)) in str(info.value)
