"""Neox-style rotary embedding, in place on q `[T, H, D]` and k `[T, KvH, D]`.

Every scaling variant (linear, llama3) lives in the cos/sin table `[max_pos, D/2]`, so one
kernel covers them all. One program per token: the token's cos/sin row is read once and
applied to all of its q and k heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(ptr, stride_t, stride_h, tok, n_heads, cos, sin, half,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < n_heads) & (dims[None, :] < half)
    p1 = ptr + tok * stride_t + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + half, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(p1, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(p1 + half, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    n_q_heads, n_k_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + pos * stride_cs + dims, mask=dims < half, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cs + dims, mask=dims < half, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, tok, n_q_heads, cos, sin, half,
                  BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr, stride_kt, stride_kh, tok, n_k_heads, cos, sin, half,
                  BLOCK_HK, BLOCK_D)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place at `positions` `[T]`; returns them. q/k may be strided views
    (e.g. slices of a fused qkv output) as long as head_dim is unit-stride."""
    assert q.dim() == 3 and k.dim() == 3, (q.shape, k.shape)
    tokens, _, head_dim = q.shape
    assert k.shape[0] == tokens and k.shape[2] == head_dim, (q.shape, k.shape)
    assert head_dim % 2 == 0 and cos.shape == sin.shape, (head_dim, cos.shape, sin.shape)
    assert cos.dim() == 2 and cos.shape[1] * 2 == head_dim, (cos.shape, head_dim)
    # Elements are addressed as tok * stride_t + head * stride_h + dim (and the table as
    # pos * stride + dim): the innermost dims must be unit-stride.
    assert q.stride(2) == 1 and k.stride(2) == 1, (q.stride(), k.stride())
    assert cos.stride(1) == 1 and sin.stride() == cos.stride(), (cos.stride(), sin.stride())
    assert positions.shape == (tokens,) and not positions.is_floating_point()
    assert q.dtype == k.dtype and q.device == k.device == cos.device == positions.device
    if tokens:
        half = head_dim // 2
        _rope_kernel[(tokens,)](
            q, k, cos, sin, positions,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            q.shape[1], k.shape[1], half,
            BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            BLOCK_D=triton.next_power_of_2(half), num_warps=4,
        )
    return q, k
