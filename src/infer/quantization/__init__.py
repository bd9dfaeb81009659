"""Quantized weights: how a linear layer's weight is stored and multiplied, one
`LinearMethod` per format (`models/linear.py`'s hook).

`quantization` in EngineConfig:
- "auto" (the default): the checkpoint's own format. A checkpoint stored quantized (FP8,
  INT8: `checkpoint.py`) runs as stored; a GGUF file's quantized weights stay quantized
  on the CPU (`gguf.py`) and are dequantized on CUDA, where our kernels reading the
  file's blocks are still slower than the dequantized model; anything else as loaded.
- "gguf": a GGUF file's quantized weights kept as stored on any device (on CUDA the
  file's blocks, `gguf_gpu.py`: 3-4x less memory than bfloat16).
- "none": every weight dequantized to the model's dtype at load.
- "int8": weight-only INT8 (W8A16) made on the fly: each output channel's weights scaled
  to [-127, 127] (symmetric, one float scale per channel), activations in 16 bits.
- "fp8": FP8 (e4m3) weights, one float scale per output channel, made on the fly; the
  activations of large steps quantized to FP8 per token for an FP8 GEMM (`fp8.py`).
- "int4": weight-only INT4 made on the fly, in groups of up to 128 inputs, a 16-bit scale
  and zero each (`int4_weights.py`).
In all three, the LM head (and the embedding table it is tied to) goes to INT8 per row: it is
the largest single matrix a decode step reads (1 GB in bfloat16 on Llama-3.1-8B). Norms
and an untied embedding table (whose rows are gathered, not read whole) stay as loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from infer.engine.config import QUANTIZATIONS
from infer.kernels import cpu_block_linear
from infer.models.layers import activation_dtype
from infer.models.linear import (
    LinearBase,
    LinearMethod,
    ParallelLMHead,
    UnquantizedLinearMethod,
)
from infer.quantization.fp8 import Fp8LinearMethod
from infer.quantization.gguf import keep_gguf_quantized
from infer.quantization.gguf_blocks import GGUFBlocks
from infer.quantization.int4 import Int4GroupLinearMethod
from infer.quantization.int4_weights import Int4WeightOnlyLinearMethod
from infer.quantization.int8 import Int8WeightOnlyLinearMethod, quantize_table

log = logging.getLogger(__name__)


def quantize_model(model: nn.Module, quantization: str,
                   gguf_blocks: dict[str, GGUFBlocks] | None = None,
                   cpu_int8_activations: bool | None = None) -> str:
    """Convert `model` in place, one layer at a time (so at most one layer's
    full-precision weight is held beside the quantized ones), as `quantization` asks;
    `gguf_blocks`: the quantized weights of the GGUF file it was loaded from;
    `cpu_int8_activations`: EngineConfig's (None: `cpu_block_linear.on_by_default`). The format
    in effect: "none", "int8", "fp8", "gguf", or the format the weights came in
    ("fp8-block", "w8a8-int8", ...: `LinearMethod.format`)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; "
                         f"got {quantization!r}")
    if quantization == "gguf" and gguf_blocks is None:
        raise ValueError("quantization='gguf' keeps a GGUF file's quantized weights; this "
                         "model was not loaded from a GGUF file")
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    stored = sorted({m.quant_method.format for m in linears} - {"none"})
    if quantization in ("int8", "fp8", "int4") and set(stored) <= {quantization}:
        # the linear layers made at load (`method_made_at_load`) or now; the LM head now
        method = {"int8": Int8WeightOnlyLinearMethod, "fp8": Fp8LinearMethod,
                  "int4": Int4WeightOnlyLinearMethod}[quantization]
        for layer in linears:
            if layer.quant_method.format == "none":
                method().quantize(layer)
            elif getattr(layer, "int4_unpacked", False):
                layer.quant_method.finish(layer)
        for head in [m for m in model.modules() if isinstance(m, ParallelLMHead)]:
            if head.quant_method is None:
                quantize_table(head, model)
        return quantization
    if stored:
        return _stored_quantized(model, linears, quantization, ", ".join(stored))
    if gguf_blocks and quantization in ("auto", "gguf"):
        if quantization == "auto" and next(model.parameters()).is_cuda:
            log.info("GGUF weights: dequantized on CUDA (faster for prefill and for more "
                     "than 64 sequences a step); quantization='gguf' keeps the blocks: 3-4x "
                     "less memory, faster decode up to a few sequences")
            return "none"
        if cpu_int8_activations is None:
            cpu_int8_activations = cpu_block_linear.on_by_default()
        if keep_gguf_quantized(model, gguf_blocks, cpu_int8_activations=cpu_int8_activations):
            return "gguf"
    return "none"


def method_made_at_load(quantization: str) -> Callable[[], LinearMethod]:
    """How to build the linear layers of a float checkpoint loaded for `quantization`:
    int8, fp8 and int4 quantize each tensor as it loads (the model never holds its float
    weights: an 8B model in FP8 loads within 9 GB, not 16); the other formats load as
    stored and convert afterwards, if at all."""
    if quantization == "int8":
        return partial(Int8WeightOnlyLinearMethod, from_float=True)
    if quantization == "fp8":
        return partial(Fp8LinearMethod, from_float=True)
    if quantization == "int4":
        return partial(Int4WeightOnlyLinearMethod, from_float=True)
    return UnquantizedLinearMethod


def _stored_quantized(model: nn.Module, linears: list[LinearBase], quantization: str,
                      stored: str) -> str:
    """A model whose weights came quantized (from its checkpoint, or converted already)."""
    if quantization == "none":
        dtype = activation_dtype(model)
        for layer in linears:
            if not isinstance(layer.quant_method, UnquantizedLinearMethod):
                _dequantize(layer, dtype)
        return "none"
    if quantization == "auto" or stored.startswith(quantization):
        return stored
    raise ValueError(f"the weights are stored in {stored} already; quantization="
                     f"{quantization!r} would quantize them again (use 'auto' to run them as "
                     "stored, or 'none' to dequantize them)")


def _dequantize(layer: LinearBase, dtype: torch.dtype) -> None:
    """`layer` back to a plain weight in `dtype`."""
    weight = layer.quant_method.dequantize(layer)
    for name, _ in list(layer.named_parameters(recurse=False)):
        if name != "bias":
            delattr(layer, name)
    layer.quant_method = UnquantizedLinearMethod()
    layer.register_parameter("weight", nn.Parameter(
        weight.to(dtype), requires_grad=False))


__all__ = ["QUANTIZATIONS", "Fp8LinearMethod", "Int4GroupLinearMethod",
           "Int4WeightOnlyLinearMethod", "Int8WeightOnlyLinearMethod", "method_made_at_load",
           "quantize_model"]
