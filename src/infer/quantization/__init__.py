"""Quantized weights: how a linear layer's weight is stored and multiplied, one
`LinearMethod` per format (`models/linear.py`'s hook).

`quantization` in EngineConfig:
- "auto" (the default): the checkpoint's own format. A GGUF file's quantized weights stay
  quantized where this device has kernels for them (`gguf.py`); anything else as loaded.
- "none": every weight dequantized to the model's dtype at load.
- "int8": weight-only INT8 (W8A16) made on the fly: each output channel's weights scaled
  to [-127, 127] (symmetric, one float scale per channel), activations in 16 bits;
  embeddings, the LM head and norms stay as loaded.
- "fp8": FP8 (e4m3) weights, one float scale per output channel, made on the fly; the
  activations of large steps quantized to FP8 per token for an FP8 GEMM (`fp8.py`).
"""

from __future__ import annotations

from torch import nn

from infer.engine.config import QUANTIZATIONS
from infer.models.linear import LinearBase, UnquantizedLinearMethod
from infer.quantization.fp8 import Fp8LinearMethod
from infer.quantization.gguf import keep_gguf_quantized
from infer.quantization.gguf_blocks import GGUFBlocks
from infer.quantization.int4 import Int4GroupLinearMethod
from infer.quantization.int8 import Int8WeightOnlyLinearMethod


def quantize_model(model: nn.Module, quantization: str,
                   gguf_blocks: dict[str, GGUFBlocks] | None = None) -> str:
    """Convert `model` in place, one layer at a time (so at most one layer's
    full-precision weight is held beside the quantized ones), as `quantization` asks;
    `gguf_blocks`: the quantized weights of the GGUF file it was loaded from. The format
    in effect: "none", "int8", "fp8" or "gguf"."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; "
                         f"got {quantization!r}")
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    if quantization != "none" and any(
            not isinstance(m.quant_method, UnquantizedLinearMethod) for m in linears):
        raise ValueError("the model's weights are converted already (a model is quantized "
                         "once, from the weights as loaded)")
    if quantization in ("int8", "fp8"):
        method = Int8WeightOnlyLinearMethod if quantization == "int8" else Fp8LinearMethod
        for layer in linears:
            method().quantize(layer)
        return quantization
    if quantization == "auto" and gguf_blocks and keep_gguf_quantized(model, gguf_blocks):
        return "gguf"
    return "none"


__all__ = ["QUANTIZATIONS", "Fp8LinearMethod", "Int4GroupLinearMethod",
           "Int8WeightOnlyLinearMethod", "quantize_model"]
