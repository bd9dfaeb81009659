"""Quantized weights: how a linear layer's weight is stored and multiplied, one
`LinearMethod` per format (`models/linear.py`'s hook).

`quantization` in EngineConfig names the format applied on the fly to a model loaded in
full precision:
- "none": the weights as loaded.
- "int8": weight-only INT8 (W8A16): each output channel's weights scaled to [-127, 127]
  (symmetric, one float scale per channel), activations in 16 bits.
Embeddings, the LM head and norms stay as loaded.
"""

from __future__ import annotations

from torch import nn

from infer.engine.config import QUANTIZATIONS
from infer.models.linear import LinearBase
from infer.quantization.int8 import Int8WeightOnlyLinearMethod


def quantize_model(model: nn.Module, quantization: str) -> int:
    """Every linear layer of `model` converted to `quantization`, in place, one layer at a
    time (so at most one layer's full-precision weight is held beside the quantized ones);
    the number of layers converted."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; "
                         f"got {quantization!r}")
    if quantization == "none":
        return 0
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    for layer in layers:
        Int8WeightOnlyLinearMethod().quantize(layer)
    return len(layers)


__all__ = ["QUANTIZATIONS", "Int8WeightOnlyLinearMethod", "quantize_model"]
