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


# Random123's Philox4x32 constants: round multipliers and Weyl key increments.
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


def philox4x32_ref(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor],
                   rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """Philox4x32-`rounds` on int64 tensors holding uint32 words (products of two of them
    wrap in int64 with their low 64 bits intact)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        p0, p1 = c0 * PHILOX_M0, c2 * PHILOX_M1
        hi0, lo0 = (p0 >> 32) & _U32, p0 & _U32
        hi1, lo1 = (p1 >> 32) & _U32, p1 & _U32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W0) & _U32, (k1 + PHILOX_W1) & _U32
    return c0, c1, c2, c3


def seeded_noise_ref(out: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor,
                     positions: torch.Tensor, exponential: bool = True, stream: int = 0) -> None:
    """`kernels.seeded_noise.seeded_noise` in torch: out[rows[i], :] := the draws of the
    Philox stream keyed by seeds[i] at counter (column, positions[i], stream, 0)."""
    n, n_cols = len(rows), out.shape[1]
    if n == 0 or n_cols == 0:
        return
    cols = torch.arange(n_cols, device=out.device, dtype=torch.int64).expand(n, n_cols)
    seeds, positions = seeds[:, None], positions[:, None]
    word, _, _, _ = philox4x32_ref(
        (cols, (positions & _U32).expand(n, n_cols), torch.full_like(cols, stream),
         torch.zeros_like(cols)),
        ((seeds & _U32).expand(n, n_cols), ((seeds >> 32) & _U32).expand(n, n_cols)))
    u = ((word >> 9).float() + 0.5) * (1.0 / 8388608.0)
    out[rows] = -u.log() if exponential else u
