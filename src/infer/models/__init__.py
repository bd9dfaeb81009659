"""Model architectures: the registry, one `ArchitectureEntry` per `ModelConfig.architecture`.

Adding an architecture is one model file ending with its entry, plus its line here.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from infer.config import ConfigError, ModelConfig
from infer.models import gemma3, gpt2, llama
from infer.models.registry import ArchitectureEntry

REGISTRY: dict[str, ArchitectureEntry] = {
    entry.name: entry for entry in (*llama.ENTRIES, gemma3.ENTRY, gpt2.ENTRY)
}
# architecture name -> model class
ARCHITECTURES: dict[str, type[nn.Module]] = {name: e.model for name, e in REGISTRY.items()}
# HF config.json model_type -> entry
MODEL_TYPES: dict[str, ArchitectureEntry] = {
    model_type: entry for entry in REGISTRY.values() for model_type in entry.model_types
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return ARCHITECTURES[cfg.architecture]
    except KeyError:
        raise ValueError(f"no model code for architecture {cfg.architecture!r}") from None


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a `config.json` dict, by the entry serving its `model_type`."""
    model_type = cfg.get("model_type")
    entry = MODEL_TYPES.get(model_type or "")
    if entry is None:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}"
        )
    try:
        return entry.from_hf(cfg)
    except KeyError as exc:
        raise ConfigError(f"config.json lacks the field {exc.args[0]!r}") from None
