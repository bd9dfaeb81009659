"""Gemma 3 logits vs transformers on tiny random checkpoints, and Gemma 3 config parsing."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import reference_logits, save_random_checkpoint
from paged_runner import run_paged

from infer.config import ConfigError, RopeConfig
from infer.loader import load_hf_dir
from infer.models import config_from_hf

transformers = pytest.importorskip("transformers")

VOCAB = 96
# A window of 5 is shorter than the longer prompts, so sliding layers drop context.
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, sliding_window=5,
            max_position_embeddings=256)


def _text_config(case: str):
    from transformers import Gemma3TextConfig

    if case == "gqa2-mixed-linear-rope":
        # head_dim != hidden / heads; small RoPE bases so both tables matter at short positions.
        return Gemma3TextConfig(
            **BASE, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, query_pre_attn_scalar=20,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            })
    if case == "mqa-softcaps":
        # transformers ignores attn_logit_softcapping for Gemma 3, and so do we; the final
        # cap is small enough to bend the logits of a random model.
        return Gemma3TextConfig(
            **BASE, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
            head_dim=32, layer_types=["full_attention", "sliding_attention"],
            final_logit_softcapping=0.3, attn_logit_softcapping=0.5)
    if case == "mha-untied":
        return Gemma3TextConfig(
            **BASE, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            head_dim=32, layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False)
    raise KeyError(case)


CASES = ["gqa2-mixed-linear-rope", "mqa-softcaps", "mha-untied"]


def batch(seed: int) -> tuple[list[list[int]], list[int]]:
    """Sequences of different lengths; the first `prefill` tokens are the prompt."""
    rng = random.Random(seed)
    prompt_lens, decode = [1, 7, 13, 22], 5
    seqs = [[rng.randrange(VOCAB) for _ in range(n + decode)] for n in prompt_lens]
    return seqs, prompt_lens


def _check(tmp_path, config, seed: int, chunk: int | None) -> None:
    ref_model = save_random_checkpoint(config, tmp_path)
    model, _ = load_hf_dir(tmp_path)
    seqs, prompt_lens = batch(seed)
    ours = run_paged(model, seqs, prompt_lens, block_size=4, chunk=chunk)
    refs = reference_logits(ref_model, seqs)
    for got, want in zip(ours, refs):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", [None, 3])
def test_logits_match_transformers(tmp_path, case, chunk):
    _check(tmp_path, _text_config(case), seed=len(case), chunk=chunk)


def test_multimodal_checkpoint_text_tower(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint: its text tower, vision weights skipped."""
    from transformers import Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=_text_config("gqa2-mixed-linear-rope"),
                          vision_config=vision, mm_tokens_per_image=4)
    _check(tmp_path, config, seed=1, chunk=None)


# A transformers 4.x config.json of a Gemma 3 text model: flat RoPE fields, no layer_types.
LEGACY = {
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "query_pre_attn_scalar": 256,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
    "sliding_window_pattern": 6, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "eos_token_id": [1, 106],
}


def test_legacy_config_parses():
    cfg = config_from_hf(LEGACY)
    assert cfg.architecture == "gemma3" and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.rope == RopeConfig(theta=1e6, kind="linear", factor=8.0)
    assert cfg.rope_local == RopeConfig(theta=1e4)
    assert [cfg.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    assert cfg.layer_types.count("full_attention") == 3
    assert cfg.query_pre_attn_scalar == 256 and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.eos_token_ids == (1, 106)


def test_config_defaults_follow_transformers():
    """Keys a config.json leaves out take Gemma3TextConfig's defaults."""
    sparse = {k: v for k, v in LEGACY.items()
              if k not in ("rope_theta", "query_pre_attn_scalar", "sliding_window",
                           "rope_scaling")}
    cfg = config_from_hf(sparse)
    assert cfg.rope == RopeConfig(theta=1e6)
    assert cfg.query_pre_attn_scalar == 256
    assert cfg.layer_window(0) == 4096


def test_bidirectional_gemma_refused():
    with pytest.raises(ConfigError, match="bidirectional"):
        config_from_hf({**LEGACY, "use_bidirectional_attention": True})
