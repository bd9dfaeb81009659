"""Weight-only INT4 in groups of 32 along the input dim: the 4-bit GGUF weights (Q4_0,
Q4_1, Q4_K) as they are stored, `w = q * a + b` per group (`gguf_blocks.int4_groups`).

On the CPU through PyTorch's `_weight_int4pack_mm_for_cpu`, which computes
`(q - 8) * scale + zero` per group: `scale = a`, `zero = b + 8 a`, kept in bfloat16 (the
kernel's fast path takes bfloat16 activations; its float32 path is 20-30x slower at
SmolLM2's shapes), so a float32 model's activations are rounded to bfloat16 for each
quantized matmul, as with INT8.

Steps of many rows (long prompts) instead dequantize the layer's weight to float32 and
use `F.linear`: the kernel is compute-bound there, and on an AVX2 CPU (no AVX-512) the
float32 GEMM measured about twice as fast from a few hundred rows on (docs/performance.md,
"Long prompts on the CPU"). Dequantizing reads the packed weight back, whose layout is
torch's: `unpack_int4` is checked against torch's own packing of the layer's shape before
any layer takes that path (`unpack_round_trips`).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from infer.models.linear import LinearMethod
from infer.quantization.gguf_blocks import GROUP

INNER_K_TILES = 2  # the packing's inner tiling (2, 4 or 8; the kernel reads any)
# Steps of at least this many rows dequantize and use F.linear (see above).
DEQUANTIZE_ROWS = 128


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
        layer.dequantizable = unpack_round_trips(*q.shape)
        layer.quant_method = self

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """What the kernel computes with: `(q - 8) * scale + zero` per group, in float32."""
        rows, cols = layer.out_features, layer.weight.shape[1] * 2
        if not layer.dequantizable:
            raise NotImplementedError(f"torch's INT4 packing of a [{rows}, {cols}] weight "
                                      "is not the layout unpack_int4 reads")
        q = unpack_int4(layer.weight, rows, cols).view(rows, cols // GROUP, GROUP)
        scale, zero = layer.weight_scales_and_zeros.float().permute(2, 1, 0).unsqueeze(-1)
        return ((q.float() - 8) * scale + zero).view(rows, cols)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        # The models' activations are 2-D already: no reshape calls then (each costs
        # microseconds on a CPU, 120 of them per SmolLM2 token).
        flat = x.dim() == 2
        x2 = x if flat else x.reshape(-1, x.shape[-1])
        x2 = x2.to(layer.compute_dtype)  # the same rounding on both paths
        if len(x2) >= DEQUANTIZE_ROWS and layer.dequantizable:
            y = F.linear(x2.float(), self.dequantize(layer))
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, layer.weight, GROUP,
                                                          layer.weight_scales_and_zeros)
        if not flat:
            y = y.reshape(*x.shape[:-1], layer.out_features)
        y = y.to(x.dtype)
        return y if bias is None else y + bias


def unpack_int4(packed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The uint8 `[rows, cols]` values 0..15 that `_convert_weight_to_int4pack_for_cpu`
    packed (inner k-tiles 2, rows a multiple of 32), as observed of torch 2.13: tiles of 32
    rows, each `[cols / 2, 32]` bytes; byte `[c // 2, r % 16 + 16 (c % 2)]` of row tile
    `r // 32` holds row `r`'s value at column `c`, in its low nibble for `r % 32 < 16`."""
    tiles = packed.view(rows // 32, cols // 2, 32)
    nibbles = torch.stack([tiles & 0xF, tiles >> 4], dim=1)  # [tile, r%32 // 16, c//2, 32]
    nibbles = nibbles.view(rows // 32, 2, cols // 2, 2, 16)  # ..., c % 2, r % 16
    return nibbles.permute(0, 1, 4, 2, 3).reshape(rows, cols)


@cache
def unpack_round_trips(rows: int, cols: int) -> bool:
    """Whether `unpack_int4` reads back what this torch packs for a `[rows, cols]` weight
    (checked once per shape on random values)."""
    if rows % 32 or cols % GROUP:
        return False
    values = torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(0),
                           dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, INNER_K_TILES)
    return packed.shape == (rows, cols // 2) and torch.equal(
        unpack_int4(packed, rows, cols).to(torch.int32), values)
