"""Model architectures: a dict from architecture name to class (see ModelConfig.architecture)."""

from __future__ import annotations

from torch import nn

from infer.config import ModelConfig
from infer.models.gemma3 import Gemma3ForCausalLM
from infer.models.gpt2 import GPT2LMHeadModel
from infer.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "gpt2": GPT2LMHeadModel,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return ARCHITECTURES[cfg.architecture]
    except KeyError:
        raise ValueError(f"no model code for architecture {cfg.architecture!r}") from None
