"""Torch references of the elementwise/normalisation kernels, computed in float32 and
rounded once to the input dtype (what the kernels do), except where a model's own rounding
is the contract (RMSNorm rounds as transformers does). The token bitmask's works in place,
as its kernel does: it is the path the engine takes where the kernel does not run."""

from __future__ import annotations

import functools
import math
import sys

import torch


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                offset: float = 0.0) -> torch.Tensor:
    """transformers' rounding: Llama's `w * x_normed.to(dtype)` (offset 0), Gemma's
    `(x_normed * (1 + w)).to(dtype)` in float32 (offset 1)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset == 0.0:
        return (weight.float() * xf.to(x.dtype).float()).to(x.dtype)
    return (xf * (offset + weight.float())).to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns `(rmsnorm(x + residual), x + residual)`; the sum is rounded to the residual's
    dtype before it is normalised, so the output is exactly the norm of what is stored."""
    new_residual = (x.float() + residual.float()).to(residual.dtype)
    return rmsnorm_ref(new_residual, weight, eps, offset), new_residual


def rope_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE (rotate the two halves of each head); returns new tensors."""
    c = cos[positions].float().unsqueeze(1)
    s = sin[positions].float().unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def swiglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def geglu_tanh_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate.pow(3))
    return (0.5 * gate * (1.0 + torch.tanh(inner)) * up).to(gate_up.dtype)


def apply_token_bitmask_ref(logits: torch.Tensor, masks: torch.Tensor,
                            rows: torch.Tensor | None = None) -> None:
    """`token_bitmask.apply_token_bitmask` in torch, in place, reading nothing back to the
    host (`rows`, when given, already on the logits' device)."""
    n_cols = logits.shape[-1]
    cut = min(n_cols, 32 * masks.shape[1])
    target = logits[:len(masks)] if rows is None else logits[rows]
    words = masks if rows is None else masks[rows]
    # Byte k of a little-endian int32 holds its bits 8k..8k+7: [n, 4 W, 8] uint8 bits in
    # token order, a quarter of the bytes of expanding the int32 words.
    assert sys.byteorder == "little"
    bytes_ = words.contiguous().view(torch.uint8).unsqueeze(-1)
    bits = (bytes_ >> _byte_shifts(words.device)) & 1
    allowed = bits.view(len(words), 32 * masks.shape[1])[:, :cut].bool()
    target[:, :cut].masked_fill_(~allowed, float("-inf"))
    target[:, cut:] = float("-inf")
    if rows is not None:
        logits[rows] = target


@functools.cache
def _byte_shifts(device: torch.device) -> torch.Tensor:
    """Made on the device (a fill, not a copy from the host), once per device."""
    return torch.arange(8, dtype=torch.uint8, device=device)
