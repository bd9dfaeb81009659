"""Test helper: engines over the real SmolLM2 GGUF, loaded once per session, and
transformers' models loaded from the same GGUF files (the reference)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from hf_gguf import fast_gguf_reads
from real_models import gemma3_gguf, smollm2_gguf

from infer.engine import core_loading
from infer.engine.llm_engine import LLMEngine
from infer.engine.setup import load_model_and_tokenizer
from infer.llm import LLM


@cache
def _loaded(path: str):
    return load_model_and_tokenizer(path, torch.float32, torch.device("cpu"))


def make_llm(path: Path | None = None, **config) -> LLM:
    """An LLM on a real GGUF model (default SmolLM2), sharing one loaded copy of the
    weights between engines (each engine binds its own KV cache to it)."""
    path = path or smollm2_gguf()
    loaded = _loaded(str(path))
    # Engines share one float copy of the weights: a quantized format would convert that
    # copy in place for every engine after, so "auto" (a CLI's default too) means the
    # float weights here, and tests of quantization build engines of their own.
    if config.setdefault("quantization", "none") == "auto":
        config["quantization"] = "none"
    if config["quantization"] != "none":
        raise ValueError("make_llm shares float weights: build an LLM of your own to "
                         "test a quantized format")
    original = core_loading.load_model_and_tokenizer
    core_loading.load_model_and_tokenizer = lambda *args: loaded
    try:
        return LLM(str(path), device="cpu", **config)
    finally:
        core_loading.load_model_and_tokenizer = original


@cache
def hf_model(path: str):
    transformers = pytest.importorskip("transformers")
    p = Path(path)
    with fast_gguf_reads():
        return transformers.AutoModelForCausalLM.from_pretrained(
            p.parent, gguf_file=p.name, dtype=torch.float32
        ).eval()


def hf_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(str(path))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            pad_token_id=model.config.eos_token_id,
        )
    return out[0, len(prompt_ids):].tolist()


__all__ = ["gemma3_gguf", "hf_greedy", "make_llm", "smollm2_gguf"]


def drain(engine: LLMEngine) -> dict:
    """Step until every request has finished: each request's last output, by id."""
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    return outputs
