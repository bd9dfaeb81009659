"""Weight-only INT8 (W8A16): `weight [out, in]` int8 and `weight_scale [out]`, the float
weight being `weight * weight_scale[:, None]`; activations stay in 16 bits.

The matmul is torch's `_weight_int8pack_mm` (a kernel that reads the int8 weight as it
is), fed 16-bit activations: on the CPU it has no fast float32 path (8x slower than
float32 `F.linear` at SmolLM2's shapes, against 0.67x the time in bfloat16), so a float32
model's activations are rounded to bfloat16 for each quantized matmul, which is what A16
means. Its CUDA kernel was 7x slower than bfloat16 on the H100, so the engine refuses int8
on CUDA until a Triton kernel of ours takes its place.
"""

from __future__ import annotations

import torch
from torch import nn

from infer.models.linear import LinearMethod

QMAX = 127


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
        """A loaded full-precision layer made INT8 in place (its `weight` replaced)."""
        weight = layer.weight
        q, scale = quantize_per_channel(weight.data)
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
        y = torch.ops.aten._weight_int8pack_mm(x2, layer.weight, layer.weight_scale)
        y = y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)
        return y if bias is None else y + bias
