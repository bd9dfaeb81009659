"""Weight-only INT4 in groups along the input dim on the CPU, `w = q * a + b` per group:
the 4-bit GGUF weights (Q4_0, Q4_1, Q4_K) as they are stored, in groups of 32
(`gguf_blocks.int4_groups`), and `quantization="int4"`'s (`int4_weights.py`).

On the CPU through PyTorch's `_weight_int4pack_mm_for_cpu`, which computes
`(q - 8) * scale + zero` per group: `scale = a`, `zero = b + 8 a`, kept in bfloat16 (the
kernel's fast path takes bfloat16 activations; its float32 path is 20-30x slower at
SmolLM2's shapes), so a float32 model's activations are rounded to bfloat16 for each
quantized matmul, as with INT8.

Steps of many rows (long prompts) instead dequantize the layer's weight to float32 and
use `F.linear`: the kernel is compute-bound there, and on an AVX2 CPU (no AVX-512) the
float32 GEMM measured about twice as fast from a few hundred rows on (docs/performance.md,
"Long prompts on the CPU"). Dequantizing reads the packed weight back, whose layout is
torch's and differs by CPU (tiles of 32 rows with AVX2, of 64 with AVX-512, other tiles
for the rows left over): `unpack_order` learns where each value's nibble lies from torch's
own packing of the layer's shape, and checks it on random values, before any layer takes
that path.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from infer.models.linear import LinearMethod
from infer.quantization.gguf_blocks import GROUP

INNER_K_TILES = 2  # the packing's inner tiling (2, 4 or 8; the kernel reads any)
# Steps of at least this many rows dequantize and use F.linear (see above): where the
# float32 GEMM overtakes torch's INT4 kernel, on SmolLM2's shapes with one thread
# (benchmarks/int4_rows.py). With AVX-512 the kernel is 1.4-2.2x faster at 128 rows, about
# even at 512, and the GEMM wins from 640; with AVX2 it wins from about 128.
DEQUANTIZE_ROWS = 640 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 128


def int4_packable(rows: int, cols: int, group: int = GROUP) -> bool:
    """Whether PyTorch's CPU INT4 packing takes a `[rows, cols]` weight in groups of
    `group`."""
    return rows % 16 == 0 and cols % group == 0


class Int4GroupLinearMethod(LinearMethod):
    format = "gguf-4bit"

    def load(self, layer: nn.Module, q: torch.Tensor, a: torch.Tensor, b: torch.Tensor
             ) -> None:
        """`layer`'s weight replaced by `q` (uint8 `[out, in]`, 0..15) with the per-group
        `a`, `b` (`[out, in // group]`, a group 32 to 256 values)."""
        weight = layer.weight
        if weight.device.type != "cpu":
            raise ValueError("torch's packed INT4 layout runs on the CPU only (on CUDA: "
                             "int4_weights.py's)")
        packed = _pack(q.to(torch.int32))
        scales_and_zeros = torch.stack([a, b + 8 * a], dim=-1).transpose(0, 1).contiguous()
        layer.compute_dtype = torch.bfloat16
        layer.out_features = q.shape[0]
        layer.int4_group = q.shape[1] // a.shape[1]
        del layer.weight
        layer.register_parameter("weight", nn.Parameter(packed, requires_grad=False))
        layer.register_parameter("weight_scales_and_zeros", nn.Parameter(
            scales_and_zeros.to(torch.bfloat16), requires_grad=False))
        layer.quant_method = self

    def dequantizable(self, layer: nn.Module) -> bool:
        """Whether the layer's packed weight can be read back (learned at the first step
        that wants it, once per shape: a large layer's takes seconds)."""
        return unpack_order(layer.out_features, layer.weight.shape[1] * 2) is not None

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """What the kernel computes with: `(q - 8) * scale + zero` per group, in float32."""
        rows, cols = layer.out_features, layer.weight.shape[1] * 2
        order = unpack_order(rows, cols)
        if order is None:
            raise NotImplementedError(f"torch's INT4 packing of a [{rows}, {cols}] weight "
                                      "is not a layout unpack_order can learn")
        group = layer.int4_group
        q = unpack_int4(layer.weight, order, rows, cols).view(rows, cols // group, group)
        scale, zero = layer.weight_scales_and_zeros.float().permute(2, 1, 0).unsqueeze(-1)
        return ((q.float() - 8) * scale + zero).view(rows, cols)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        # The models' activations are 2-D already: no reshape calls then (each costs
        # microseconds on a CPU, 120 of them per SmolLM2 token).
        flat = x.dim() == 2
        x2 = x if flat else x.reshape(-1, x.shape[-1])
        x2 = x2.to(layer.compute_dtype)  # the same rounding on both paths
        if len(x2) >= DEQUANTIZE_ROWS and self.dequantizable(layer):
            y = F.linear(x2.float(), self.dequantize(layer))
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, layer.weight, layer.int4_group,
                                                          layer.weight_scales_and_zeros)
        if not flat:
            y = y.reshape(*x.shape[:-1], layer.out_features)
        y = y.to(x.dtype)
        return y if bias is None else y + bias


def unpack_int4(packed: torch.Tensor, order: torch.Tensor, rows: int, cols: int
                ) -> torch.Tensor:
    """The uint8 `[rows, cols]` values 0..15 that `_convert_weight_to_int4pack_for_cpu`
    packed into `packed`, `order` being `unpack_order(rows, cols)`."""
    return _nibbles(packed)[order].view(rows, cols)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 `[2 * bytes]`: each byte's low nibble, then its high one."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).view(-1)


def _pack(values: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, INNER_K_TILES)


@cache
def unpack_order(rows: int, cols: int) -> torch.Tensor | None:
    """For each value of a `[rows, cols]` weight (row-major), the place of its nibble in
    this torch's packing (byte * 2, + 1 for the high nibble): the packing of each value's
    own index, four bits at a time, says where it went. None where the packing is not a
    reordering of nibbles (checked on random values too)."""
    n = rows * cols
    if not int4_packable(rows, cols) or n >= 2**31:
        return None
    index = torch.arange(n, dtype=torch.int32)
    source = torch.zeros(n, dtype=torch.int32)  # per nibble place, the value it holds
    for shift in range(0, max(n - 1, 1).bit_length(), 4):
        packed = _pack(((index >> shift) & 0xF).view(rows, cols))
        if packed.numel() * 2 != n:
            return None
        source |= _nibbles(packed).to(torch.int32) << shift
    if int(source.max()) >= n:
        return None
    order = torch.full((n,), -1, dtype=torch.int32)  # int32: half the memory, kept per shape
    order[source.long()] = index
    if bool((order < 0).any()):  # two places held the same value: not a reordering
        return None
    values = torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(0),
                           dtype=torch.int32)
    if not torch.equal(unpack_int4(_pack(values), order, rows, cols).to(torch.int32), values):
        return None
    return order
