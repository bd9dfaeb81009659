"""What an architecture brings: one `ArchitectureEntry`, at the bottom of its model file.

`infer.models.REGISTRY` collects the entries; the config parsers (HF and GGUF), the GGUF
tensor loader and the model builder all look an architecture up there and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from infer.config import ModelConfig
    from infer.loader.gguf_metadata import GGUFMetadata


@dataclass(frozen=True)
class GGUFTensorMap:
    """llama.cpp tensor names -> HF names: `top` for whole-model modules, `layer` for the
    modules of block N (`blk.N.<key>` -> `<layer_prefix>.N.<value>`)."""

    top: dict[str, str]
    layer: dict[str, str]
    layer_prefix: str = "model.layers"

    def hf_name(self, gguf_name: str) -> tuple[str, str] | None:
        """(HF tensor name, GGUF module key) of a GGUF tensor name, or None if unknown."""
        module, _, suffix = gguf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            return None
        if module in self.top:
            return f"{self.top[module]}.{suffix}", module
        parts = module.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in self.layer:
            return f"{self.layer_prefix}.{parts[1]}.{self.layer[parts[2]]}.{suffix}", parts[2]
        return None


@dataclass(frozen=True)
class ArchitectureEntry:
    # `ModelConfig.architecture`, and the GGUF `general.architecture` it reads.
    name: str
    # The HF `config.json` `model_type`s it serves.
    model_types: tuple[str, ...]
    # Built as `model(cfg)`; has `forward`, `compute_logits` and `load_weights`.
    model: type[nn.Module]
    from_hf: Callable[[dict[str, Any]], ModelConfig]
    from_gguf: Callable[[GGUFMetadata], ModelConfig]
    gguf_tensors: GGUFTensorMap
    # A dequantised GGUF tensor in llama.cpp's layout -> the HF layout `model` loads, given
    # its GGUF module key (undoing llama.cpp's q/k permutation, Gemma's stored `1 + w`, ...).
    gguf_fixup: Callable[[str, torch.Tensor, ModelConfig], torch.Tensor] | None = None
