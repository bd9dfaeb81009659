"""RMSNorm of float32 rows on the CPU, and the residual add before it (`cpu_norm.cpp`, part
of infer's CPU extension: `cpu_extension.available()`), where `models/layers.py`'s
`RMSNorm` sends them (`EngineConfig.cpu_norm_kernel`)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of contiguous float32 `x [..., dim]` by float32 `weight [dim]`
    (`cpu_norm.cpp`)."""
    return torch.ops.infer_cpu.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(residual + x), residual + x)`, float32, in one call (`cpu_norm.cpp`)."""
    return torch.ops.infer_cpu.add_rms_norm(x, residual, weight, eps)
