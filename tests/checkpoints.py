"""Test helper: tiny random HF checkpoints written by transformers itself."""

from __future__ import annotations

from pathlib import Path

import torch


def save_random_checkpoint(config, path: Path, seed: int = 0):
    """Build the transformers model for `config` with random weights (norm weights and
    biases randomised too, so a wrong offset or a missing bias shows) and save it.
    Returns the transformers model in float32 eval mode, the reference."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.startswith("ln_") or ".ln_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def reference_logits(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Full-sequence float32 logits from transformers, one sequence at a time, no cache."""
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            out.append(model(input_ids=ids, use_cache=False).logits[0].float())
    return out


def save_word_tokenizer(path: Path, vocab_size: int, eos: int = 2) -> None:
    """A word-level tokenizer `t0 .. t{vocab_size-1}` beside a checkpoint, so an engine can
    load the directory; tests then prompt with token ids."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{eos}"}))
