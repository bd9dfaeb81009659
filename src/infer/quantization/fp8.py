"""FP8 (e4m3) weights: `weight [out, in]` float8_e4m3fn and `weight_scale [out]` float32,
the float weight being `weight * weight_scale[:, None]`; made at load from a
full-precision model (`quantization="fp8"`: each output channel's largest magnitude maps
to e4m3's largest, 448), or read from a checkpoint stored so (compressed-tensors FP8 with
per-channel or per-tensor weight scales; `checkpoint.py`).

Decode-sized steps on CUDA read the FP8 weight as stored through our W8A16 kernel
(`kernels/w8a16_matmul.py`; 16-bit activations: the bytes read are what bounds a decode
step). Larger steps, and the CPU, quantize the activations too, one scale per token
(dynamic: the row's largest magnitude maps to 448; on CUDA in one kernel,
`kernels/fp8_quant.py`), and multiply in FP8 with `torch._scaled_mm` (per-row activation
and per-column weight scales, float32 in the product): Hopper's FP8 tensor cores run it at
twice the bfloat16 rate. On CUDA, FP8 by FP8 steps of up to `EngineConfig.fp8_mma_rows`
rows, and decode-sized ones with `fp8_decode_activations`, multiply in infer's FP8 x FP8
tensor-core kernel (`kernels/rows_mma.py` with `x_scale`) instead. With
`EngineConfig.fp8_wgmma_rows` on a Hopper GPU, steps of up to that many bfloat16 rows multiply
the FP8 weights by x as it is on the tensor cores (`kernels/fp8_wgmma.py`) instead of all
these, a gated MLP's activation stored from the gate_up projection's own launch.
"""

from __future__ import annotations

import torch
from torch import nn

from infer.models.linear import LinearMethod
from infer.models.weights import WeightLoader
from infer.quantization.stored import channel_scale, quantized_as_loaded, stored_weight

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# On CUDA, steps of at most this many rows read the weight through the W8A16 kernel
# (8B shape on the H100: faster than the FP8 GEMM at 1 row, slower at 32).
WEIGHT_ONLY_ROWS = 16


def reads_weight_only(x2: torch.Tensor, tensor_core_rows: int) -> bool:
    """Whether a step of rows `x2` reads the FP8 weight as stored (the W8A16 kernels, on
    CUDA): up to WEIGHT_ONLY_ROWS rows, or up to `tensor_core_rows` where the layer sends
    more to the tensor cores."""
    return x2.is_cuda and len(x2) <= max(WEIGHT_ONLY_ROWS, tensor_core_rows)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [rows, cols]` as (float8_e4m3fn, float32 scale per row): each row's largest
    magnitude maps to 448 (a row of zeros gets scale 1)."""
    xf = x.float()
    scale = xf.abs().amax(dim=1) * (1 / FP8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (xf * (1 / scale)[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8LinearMethod(LinearMethod):
    """`from_float`: the layer is built to quantize a float checkpoint's tensors as they
    load (`quantization="fp8"`); else to load a checkpoint stored in FP8."""

    format = "fp8"

    def __init__(self, from_float: bool = False) -> None:
        self.from_float = from_float

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       weight_loader: WeightLoader) -> None:
        if self.from_float:
            quantized_as_loaded(layer, FP8, quantize_fp8, input_size, output_sizes,
                                torch.float32, weight_loader)
            return
        stored_weight(layer, FP8, input_size, output_sizes, weight_loader)
        channel_scale(layer, "weight_scale", output_sizes, torch.float32, weight_loader)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float() * layer.weight_scale.float()[:, None]

    def quantize(self, layer: nn.Module) -> None:
        """A loaded full-precision linear layer made FP8 in place (its `weight` replaced)."""
        weight = layer.weight
        q, scale = quantize_fp8(weight.data)
        del layer.weight
        layer.register_parameter("weight", nn.Parameter(q, requires_grad=False))
        layer.register_parameter("weight_scale", nn.Parameter(scale, requires_grad=False))
        layer.quant_method = self

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out_dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
        tensor_core_rows = getattr(layer, "w8a16_tensor_core_rows", 0)
        weight_only = reads_weight_only(x2, tensor_core_rows)
        fp8_at_decode = weight_only and getattr(layer, "fp8_decode_activations", False)
        if _to_fp8_wgmma(layer, x2):
            from infer.kernels.fp8_wgmma import fp8_wgmma

            y = fp8_wgmma(x2, layer.weight, layer.weight_scale)
        elif weight_only and not fp8_at_decode:
            from infer.kernels.w8a16_matmul import w8a16_matmul

            y = w8a16_matmul(x2.contiguous(), layer.weight, layer.weight_scale,
                             tensor_core_rows=tensor_core_rows,
                             gemv_rows=getattr(layer, "w8a16_gemv_rows", 0))
        elif x2.is_cuda:
            from infer.kernels.fp8_quant import attached_fp8_rows, fp8_quantize_rows

            # the rows the launch that made x quantized, if it did (an RMSNorm's,
            # `set_fp8_norms`, or a gated activation's, `set_fp8_activations`)
            xq, x_scale = attached_fp8_rows(x) or fp8_quantize_rows(x2.contiguous())
            mma_rows = 0 < len(x2) <= getattr(layer, "fp8_mma_rows", 0)
            if mma_rows and getattr(layer, "w8_wgmma", False) and x2.shape[1] % 16 == 0:
                from infer.kernels.w8_wgmma import w8_wgmma

                y = w8_wgmma(xq, x_scale, layer.weight, layer.weight_scale, out_dtype)
            elif fp8_at_decode or mma_rows:
                from infer.kernels.rows_mma import fp8_x_launch, rows_mma

                y = rows_mma(xq, layer.weight, layer.weight_scale, x_scale=x_scale,
                             out_dtype=out_dtype, **fp8_x_launch(*layer.weight.shape, x2.device))
            else:
                y = _scaled_mm(xq, x_scale, layer, out_dtype)
        else:
            y = _scaled_mm(*quantize_fp8(x2), layer, out_dtype)
        y = y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)
        return y if bias is None else y + bias

    def apply_gate_up(self, layer: nn.Module, x: torch.Tensor, act: str,
                      bias: torch.Tensor | None) -> torch.Tensor | None:
        x2 = x.reshape(-1, x.shape[-1])
        if bias is not None or getattr(layer, "fp8_decode_activations", False):
            return None
        if _to_fp8_wgmma(layer, x2):
            from infer.kernels.fp8_wgmma import fp8_wgmma

            y = fp8_wgmma(x2, layer.weight, layer.weight_scale, act=act)
        elif reads_weight_only(x2, getattr(layer, "w8a16_tensor_core_rows", 0)):
            from infer.kernels.w8a16_matmul import gate_up_gemv

            y = gate_up_gemv(x2.contiguous(), layer.weight, layer.weight_scale, act,
                             getattr(layer, "w8a16_gemv_rows", 0),
                             getattr(layer, "gate_up_rows_apart", False))
        else:
            return None
        return None if y is None else y.reshape(*x.shape[:-1], y.shape[-1])


def _to_fp8_wgmma(layer: nn.Module, x2: torch.Tensor) -> bool:
    """Whether a step of rows `x2` goes to kernels/fp8_wgmma.py: bfloat16 rows on CUDA, up
    to the layer's `fp8_wgmma_rows` (set where the GPU is a Hopper with Gluon), contiguous
    and 4-byte aligned (the kernel reads them in pairs)."""
    return (x2.is_cuda and 0 < len(x2) <= getattr(layer, "fp8_wgmma_rows", 0)
            and x2.dtype == torch.bfloat16 and x2.shape[1] % 4 == 0
            and x2.is_contiguous() and x2.data_ptr() % 4 == 0)


def _scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, layer: nn.Module,
               out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 rows (a scale each) times the layer's FP8 weight (a scale per channel)."""
    return torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale[:, None],
                            scale_b=layer.weight_scale[None, :], out_dtype=out_dtype)
