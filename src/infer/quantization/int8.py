"""Weight-only INT8 (W8A16): `weight [out, in]` int8 and `weight_scale [out]`, the float
weight being `weight * weight_scale[:, None]`; activations stay in 16 bits on a GPU.

On CUDA the matmul is ours for decode-sized steps (`kernels/w8a16_matmul.py`, Triton;
torch's CUDA `_weight_int8pack_mm` was 7x slower than bfloat16 on the H100; with
`EngineConfig.int8_mma_rows`, steps of a few rows on the int8 tensor cores,
`kernels/int8_x16.py`; with `int8_x16_gemv`, one row the RMSNorm split by dp4a,
`kernels/int8_x16_gemv.py`), and cuBLAS on a dequantized copy of the weight for
prefill-sized ones. On the CPU it is infer's C++ kernel (`kernels/cpu_int8_linear.cpp`,
`EngineConfig.cpu_int8_kernel`): x stays float32, each row's result the same whatever the
step's rows. Without it (off, or not built), torch's `_weight_int8pack_mm`, fed 16-bit
activations: it has no fast float32 path (8x slower than float32 `F.linear` at SmolLM2's
shapes, against 0.67x the time in bfloat16), so a float32 model's activations are rounded
to bfloat16 for each quantized matmul.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from infer.kernels import cpu_extension, cpu_int8_linear
from infer.models.linear import LinearMethod
from infer.models.weights import WeightLoader
from infer.quantization.stored import channel_scale, quantized_as_loaded, stored_weight
from infer.quantization.tables import convert_table

if TYPE_CHECKING:
    from infer.kernels.int8_x16 import Halves

QMAX = 127
# On CUDA, more rows than this (prefill chunks) dequantize the weight for cuBLAS; fewer
# go through the W8A16 kernel, whose speed is in reading fewer bytes.
DEQUANTIZE_ROWS = 64


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8, float32 scale per row: a weight's output channel, a token's activations),
    symmetric, rounded to nearest even: the largest magnitude of each row maps to 127 (a
    row of zeros gets scale 1)."""
    xf = x.float()
    scale = xf.abs().amax(dim=1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


class Int8WeightOnlyLinearMethod(LinearMethod):
    """`from_float`: the layer is built to quantize a float checkpoint's tensors as they
    load (`quantization="int8"`); else to load a checkpoint stored in INT8
    (compressed-tensors, per-channel scales)."""

    format = "int8"

    def __init__(self, from_float: bool = False) -> None:
        self.from_float = from_float

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       weight_loader: WeightLoader) -> None:
        layer.dtype = torch.get_default_dtype()
        layer.compute_dtype = compute_dtype(layer.dtype)
        if self.from_float:
            quantized_as_loaded(layer, torch.int8, quantize_per_row, input_size, output_sizes,
                                layer.compute_dtype, weight_loader)
            return
        stored_weight(layer, torch.int8, input_size, output_sizes, weight_loader)
        channel_scale(layer, "weight_scale", output_sizes, layer.compute_dtype, weight_loader)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float() * layer.weight_scale.float()[:, None]

    def quantize(self, layer: nn.Module) -> None:
        """A loaded full-precision layer (a linear layer, an embedding table, an LM head)
        made INT8 in place (its `weight` replaced; one scale per row)."""
        weight = layer.weight
        q, scale = quantize_per_row(weight.data)
        layer.dtype = weight.dtype
        layer.compute_dtype = compute_dtype(weight.dtype)
        del layer.weight
        layer.register_parameter("weight", nn.Parameter(q, requires_grad=False))
        layer.register_parameter(
            "weight_scale", nn.Parameter(scale.to(layer.compute_dtype), requires_grad=False))
        layer.quant_method = self

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.is_cuda:
            from infer.kernels.int8_x16 import attached_halves

            y = _cuda_matmul(layer, x2, attached_halves(x))
        else:
            y = _cpu_matmul(layer, x2)
        y = y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)
        return y if bias is None else y + bias

    def apply_gate_up(self, layer: nn.Module, x: torch.Tensor, act: str,
                      bias: torch.Tensor | None) -> torch.Tensor | None:
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_cuda or bias is not None:
            return None
        from infer.kernels.int8_x16 import attached_halves

        halves = attached_halves(x)
        if _to_x16_gemv(layer, x2, halves):
            from infer.kernels.int8_x16_gemv import int8_x16_gemv

            y = int8_x16_gemv(x2.to(layer.compute_dtype).contiguous(), layer.weight,
                              layer.weight_scale, act, halves=halves)
            return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
        from infer.kernels.w8a16_matmul import gate_up_gemv

        y = gate_up_gemv(x2.to(layer.compute_dtype).contiguous(), layer.weight,
                         layer.weight_scale, act, getattr(layer, "w8a16_gemv_rows", 0),
                         getattr(layer, "gate_up_rows_apart", False))
        return None if y is None else y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if ids.is_cuda:  # the same rounding in one launch
            from infer.kernels.scaled_rows import scaled_rows

            return scaled_rows(ids, layer.weight, layer.weight_scale, layer.dtype)
        rows = F.embedding(ids, layer.weight).float() * layer.weight_scale[ids, None].float()
        return rows.to(layer.dtype)


def quantize_table(table: nn.Module, model: nn.Module) -> None:
    """An embedding table or LM head of `model` to INT8 per row, in place, with the module
    that shares its weight (a tied LM head, its embedding)."""
    convert_table(table, model, Int8WeightOnlyLinearMethod().quantize)


class Int8W8A8LinearMethod(Int8WeightOnlyLinearMethod):
    """Compressed-tensors W8A8 checkpoints (per-channel INT8 weights, dynamic per-token INT8
    activations): steps larger than a decode step quantize each row of activations to INT8
    and multiply in integers (`torch._int_mm`, INT8 tensor cores on CUDA); decode-sized
    steps on CUDA read the weight through the W8A16 kernel, like weight-only INT8 (the
    bytes read bound them; 16-bit activations lose nothing)."""

    format = "w8a8-int8"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        n, k = layer.weight.shape
        if x2.is_cuda and (len(x2) <= DEQUANTIZE_ROWS or n % 8 or k % 8):
            return super().apply(layer, x, bias)
        xq, x_scale = quantize_per_row(x2)
        y = torch._int_mm(xq, layer.weight.t()).float() * x_scale[:, None] \
            * layer.weight_scale.float()
        y = y.reshape(*shape[:-1], n).to(x.dtype)
        return y if bias is None else y + bias


def _cuda_matmul(layer: nn.Module, x: torch.Tensor, halves: Halves | None = None
                 ) -> torch.Tensor:
    """`x [rows, in]` times the layer's weight on CUDA, by the step's rows (the module's
    docstring); `halves`: x's rows split into int8 halves, where the RMSNorm that made x
    made them."""
    x = x.to(layer.compute_dtype)
    gemv_rows = getattr(layer, "w8a16_gemv_rows", 0)
    if len(x) > DEQUANTIZE_ROWS:  # compute-bound: cuBLAS on a copy
        return F.linear(x, layer.weight.to(x.dtype)) * layer.weight_scale
    if _to_x16_gemv(layer, x, halves):
        from infer.kernels.int8_x16_gemv import int8_x16_gemv

        return int8_x16_gemv(x.contiguous(), layer.weight, layer.weight_scale, halves=halves)
    if _to_int8_mma(layer, len(x)):
        if getattr(layer, "w8_wgmma", False) and x.shape[1] % 16 == 0:
            from infer.kernels.int8_x16 import split_rows
            from infer.kernels.w8_wgmma import w8_wgmma

            q, x_scale = halves or split_rows(x.contiguous())
            return w8_wgmma(q, x_scale, layer.weight, layer.weight_scale, x.dtype)
        from infer.kernels.int8_x16 import int8_x16_matmul

        return int8_x16_matmul(x.contiguous(), layer.weight, layer.weight_scale, halves)
    from infer.kernels.w8a16_matmul import w8a16_matmul

    return w8a16_matmul(x.contiguous(), layer.weight, layer.weight_scale,
                        tensor_core_rows=getattr(layer, "w8a16_tensor_core_rows", 0),
                        gemv_rows=gemv_rows)


def _cpu_matmul(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`x [rows, in]` times the layer's weight on the CPU: infer's kernel, x in float32,
    where the layer takes it (`cpu_int8_kernel`, set by the engine) and it is built; else
    PyTorch's, x rounded to 16 bits."""
    if getattr(layer, "cpu_int8_kernel", False) and cpu_extension.available():
        return cpu_int8_linear.int8_linear(x.float(), layer.weight, layer.weight_scale)
    return torch.ops.aten._weight_int8pack_mm(x.to(layer.compute_dtype), layer.weight,
                                              layer.weight_scale)


def _to_int8_mma(layer: nn.Module, rows: int) -> bool:
    """Whether a CUDA step of `rows` rows takes the int8 tensor cores (`kernels/int8_x16.py`):
    2 to `int8_mma_rows` rows the GEMV does not take."""
    return (1 < rows <= getattr(layer, "int8_mma_rows", 0)
            and not _to_gemv(rows, layer.weight.shape[0], getattr(layer, "w8a16_gemv_rows", 0)))


def _to_x16_gemv(layer: nn.Module, x: torch.Tensor, halves: Halves | None) -> bool:
    """Whether one row `x` multiplies by dp4a on its int8 halves
    (`kernels/int8_x16_gemv.py`): with `int8_x16_gemv` (`set_8bit_kernels`), where x comes
    split already (`halves`, made by the RMSNorm that made x) and the kernel takes the
    weight. A row that would need a split launch of its own (the o and down projections'
    inputs) takes the float GEMV: on an H100 the 8B step was 2.98 ms that way against 3.05
    with the 64 split launches."""
    if halves is None or not getattr(layer, "int8_x16_gemv", False):
        return False
    from infer.kernels.int8_x16_gemv import takes

    return takes(x, layer.weight)


def _to_gemv(rows: int, n: int, gemv_rows: int) -> bool:
    from infer.kernels.w8a16_matmul import gemv_takes

    return gemv_takes(rows, n, gemv_rows)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activations' dtype for the INT8 kernels: 16 bits (see the module's docstring)."""
    return torch.bfloat16 if dtype == torch.float32 else dtype
