"""Linear layers with INT8 weights and float32 x on the CPU (`cpu_int8_linear.cpp`, part of
infer's CPU extension: `cpu_extension.available()`), where `quantization/int8.py` sends
them (`EngineConfig.cpu_int8_kernel`)."""

from __future__ import annotations

import torch


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 `x [rows, in]` times the int8 `weight [out, in]` transposed, each output
    channel times its `scale [out]` (float32 or bfloat16): float32 `[rows, out]`, each row
    the same whatever rows share the call (`cpu_int8_linear.cpp`)."""
    return torch.ops.infer_cpu.int8_linear(x, weight, scale)
