"""Weight-only INT8 (W8A16): `weight [out, in]` int8 and `weight_scale [out]`, the float
weight being `weight * weight_scale[:, None]`; activations stay in 16 bits.

On CUDA the matmul is ours for decode-sized steps (`kernels/w8a16_matmul.py`, Triton;
torch's CUDA `_weight_int8pack_mm` was 7x slower than bfloat16 on the H100), and cuBLAS on
a dequantized copy of the weight for prefill-sized ones. On the CPU it is torch's
`_weight_int8pack_mm`, fed 16-bit activations: it has no fast float32 path (8x slower than
float32 `F.linear` at SmolLM2's shapes, against 0.67x the time in bfloat16), so a float32
model's activations are rounded to bfloat16 for each quantized matmul, which is what A16
means.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infer.models.linear import LinearMethod

QMAX = 127
# On CUDA, more rows than this (prefill chunks) dequantize the weight for cuBLAS; fewer
# go through the W8A16 kernel, whose speed is in reading fewer bytes.
DEQUANTIZE_ROWS = 64


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per output row), symmetric: the largest magnitude of
    each row maps to 127 (a row of zeros gets scale 1)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


class Int8WeightOnlyLinearMethod(LinearMethod):
    def quantize(self, layer: nn.Module) -> None:
        """A loaded full-precision layer (a linear layer, an embedding table, an LM head)
        made INT8 in place (its `weight` replaced; one scale per row)."""
        weight = layer.weight
        q, scale = quantize_per_channel(weight.data)
        layer.dtype = weight.dtype
        layer.compute_dtype = torch.bfloat16 if weight.dtype == torch.float32 else weight.dtype
        del layer.weight
        layer.register_parameter("weight", nn.Parameter(q, requires_grad=False))
        layer.register_parameter(
            "weight_scale", nn.Parameter(scale.to(layer.compute_dtype), requires_grad=False))
        layer.quant_method = self

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(layer.compute_dtype)
        if x2.is_cuda and len(x2) > DEQUANTIZE_ROWS:  # compute-bound: cuBLAS on a copy
            y = F.linear(x2, layer.weight.to(x2.dtype)) * layer.weight_scale
        elif x2.is_cuda:
            from infer.kernels.w8a16_matmul import w8a16_matmul

            y = w8a16_matmul(x2.contiguous(), layer.weight, layer.weight_scale)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, layer.weight, layer.weight_scale)
        y = y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)
        return y if bias is None else y + bias

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, layer.weight).float() * layer.weight_scale[ids, None].float()
        return rows.to(layer.dtype)
