"""Weight-only INT4 in groups of 32 along the input dim: the 4-bit GGUF weights (Q4_0,
Q4_1, Q4_K) as they are stored, `w = q * a + b` per group (`gguf_blocks.int4_groups`).

On the CPU through PyTorch's `_weight_int4pack_mm_for_cpu`, which computes
`(q - 8) * scale + zero` per group: `scale = a`, `zero = b + 8 a`, kept in bfloat16 (the
kernel's fast path takes bfloat16 activations; its float32 path is 20-30x slower at
SmolLM2's shapes), so a float32 model's activations are rounded to bfloat16 for each
quantized matmul, as with INT8.
"""

from __future__ import annotations

import torch
from torch import nn

from infer.models.linear import LinearMethod
from infer.quantization.gguf_blocks import GROUP

INNER_K_TILES = 2  # the packing's inner tiling (2, 4 or 8; the kernel reads any)


def int4_packable(rows: int, cols: int) -> bool:
    """Whether PyTorch's CPU INT4 packing takes a `[rows, cols]` weight."""
    return rows % 16 == 0 and cols % GROUP == 0


class Int4GroupLinearMethod(LinearMethod):
    format = "gguf-4bit"

    def load(self, layer: nn.Module, q: torch.Tensor, a: torch.Tensor, b: torch.Tensor
             ) -> None:
        """`layer`'s weight replaced by `q` (uint8 `[out, in]`, 0..15) with the per-group
        `a`, `b` (`[out, in // 32]`)."""
        weight = layer.weight
        if weight.device.type != "cpu":
            raise ValueError("INT4 group weights run on the CPU only (no GPU kernel yet)")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32),
                                                                    INNER_K_TILES)
        scales_and_zeros = torch.stack([a, b + 8 * a], dim=-1).transpose(0, 1).contiguous()
        layer.compute_dtype = torch.bfloat16
        layer.out_features = q.shape[0]
        del layer.weight
        layer.register_parameter("weight", nn.Parameter(packed, requires_grad=False))
        layer.register_parameter("weight_scales_and_zeros", nn.Parameter(
            scales_and_zeros.to(torch.bfloat16), requires_grad=False))
        layer.quant_method = self

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        # The models' activations are 2-D already: no reshape calls then (each costs
        # microseconds on a CPU, 120 of them per SmolLM2 token).
        flat = x.dim() == 2
        x2 = x if flat else x.reshape(-1, x.shape[-1])
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(layer.compute_dtype),
                                                      layer.weight, GROUP,
                                                      layer.weight_scales_and_zeros)
        if not flat:
            y = y.reshape(*x.shape[:-1], layer.out_features)
        y = y.to(x.dtype)
        return y if bias is None else y + bias
