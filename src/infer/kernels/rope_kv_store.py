"""What a layer does between its q/k/v projection and attention, in one launch: an
optional RMSNorm of every q and k head (Qwen3, Gemma 3), neox RoPE of q (in place) and k,
and the store of k and v into the paged caches at their slots (slot -1: skipped).

Four launches (q norm, k norm, RoPE, KV store) become one; at batch 1 each is a few
microseconds of latency per layer. One program per token. The result equals the unfused
kernels' (`rmsnorm`, `rope`, `kv_store`) up to the float32 summation order inside a head's
norm: the normalised values are rounded to q's dtype before they are rotated, as the
unfused path stores them between its kernels. Rotated keys go only to the cache (rounded
to q's dtype first, then to the cache's: FP8 as `kv_store.cache_values`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch
from infer.kernels.kv_store import cache_values


@triton.jit
def _norm_rope(x1, x2, w_ptr, dims, dmask, cos, sin, half, eps,
               NORM: tl.constexpr, OFFSET: tl.constexpr):
    """Rotate the halves `x1`, `x2` `[heads, half]` of each head, after normalising each
    head when NORM; returns float32 halves (still to be rounded by the caller's store)."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if NORM:
        inv_rms = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1))
                                / (2 * half) + eps)
        w1 = tl.load(w_ptr + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
        if OFFSET == 0.0:  # rmsnorm.py's rounding: normalised x rounded, times w, rounded
            a = (a * inv_rms[:, None]).to(x1.dtype).to(tl.float32) * w1
            b = (b * inv_rms[:, None]).to(x1.dtype).to(tl.float32) * w2
        else:
            a = a * inv_rms[:, None] * (w1 + OFFSET)
            b = b * inv_rms[:, None] * (w2 + OFFSET)
        a = a.to(x1.dtype).to(tl.float32)
        b = b.to(x1.dtype).to(tl.float32)
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def _rope_kv_store_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
    qw_ptr, kw_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    n_q_heads, n_kv_heads, half, eps, k_inverse, v_inverse,
    NORM: tl.constexpr, OFFSET: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    # Before the dependent-launch wait: positions and slots are written before the step's
    # kernels start (copies, or kernels before its graph), never by the projection right
    # before this kernel; the tables never change.
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < half
    cos = tl.load(cos_ptr + pos * stride_cs + dims, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cs + dims, mask=dmask, other=0.0).to(tl.float32)
    cos = cos[None, :]
    sin = sin[None, :]
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)

    qh = tl.arange(0, BLOCK_HQ)[:, None]
    qmask = (qh < n_q_heads) & dmask[None, :]
    q1_ptr = q_ptr + tok * stride_qt + qh * stride_qh + dims[None, :]
    q1 = tl.load(q1_ptr, mask=qmask, other=0.0)
    q2 = tl.load(q1_ptr + half, mask=qmask, other=0.0)
    r1, r2 = _norm_rope(q1, q2, qw_ptr, dims, dmask, cos, sin, half, eps, NORM, OFFSET)
    tl.store(q1_ptr, r1.to(q1.dtype), mask=qmask)
    tl.store(q1_ptr + half, r2.to(q1.dtype), mask=qmask)

    kh = tl.arange(0, BLOCK_HK)[:, None]
    kmask = (kh < n_kv_heads) & dmask[None, :]
    k1_ptr = k_ptr + tok * stride_kt + kh * stride_kh + dims[None, :]
    k1 = tl.load(k1_ptr, mask=kmask, other=0.0)
    k2 = tl.load(k1_ptr + half, mask=kmask, other=0.0)
    r1, r2 = _norm_rope(k1, k2, kw_ptr, dims, dmask, cos, sin, half, eps, NORM, OFFSET)
    # Rounded to k's dtype first, as the unfused RoPE stores it, then to the cache's.
    r1 = cache_values(r1.to(k1.dtype), kc_ptr, k_inverse)
    r2 = cache_values(r2.to(k1.dtype), kc_ptr, k_inverse)
    v1_ptr = v_ptr + tok * stride_vt + kh * stride_vh + dims[None, :]
    v1 = cache_values(tl.load(v1_ptr, mask=kmask, other=0.0), vc_ptr, v_inverse)
    v2 = cache_values(tl.load(v1_ptr + half, mask=kmask, other=0.0), vc_ptr, v_inverse)
    keep = kmask & ((tl.zeros([BLOCK_HK, BLOCK_D], dtype=tl.int64) + slot) >= 0)
    dst = slot * n_kv_heads * 2 * half + kh * 2 * half + dims[None, :]
    tl.store(kc_ptr + dst, r1, mask=keep)
    tl.store(kc_ptr + dst + half, r2, mask=keep)
    tl.store(vc_ptr + dst, v1, mask=keep)
    tl.store(vc_ptr + dst + half, v2, mask=keep)


def rope_store_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
    eps: float = 0.0, norm_offset: float = 0.0,
    inverse_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """q `[T, H, D]` (normalised and rotated in place; returned), k and v `[T, KvH, D]`
    (k is read, not changed) into caches `[blocks, block_size, KvH, D]` at
    `slot_mapping[t]`. `cos`/`sin` `[max_pos, D/2]` as `rope.rope_`; with `q_norm` and
    `k_norm` (weights `[D]`) every head is RMS-normalised first, as `rmsnorm.rmsnorm` with
    `eps` and `norm_offset` (0: x * w, 1: Gemma's x * (1 + w)). An FP8 cache's keys and
    values are multiplied by `inverse_scales` (float32) before their rounding."""
    tokens, n_q_heads, head_dim = q.shape
    _, _, n_kv_heads, _ = k_cache.shape
    assert k.shape == v.shape == (tokens, n_kv_heads, head_dim), (q.shape, k.shape, v.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    # Cache slots are addressed from the logical shape: the caches must be contiguous.
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert head_dim % 2 == 0 and cos.shape == sin.shape and cos.shape[1] * 2 == head_dim
    assert cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert positions.shape == slot_mapping.shape == (tokens,)
    assert not positions.is_floating_point() and not slot_mapping.is_floating_point()
    assert (q_norm is None) == (k_norm is None), "q and k are normalised together"
    assert norm_offset in (0.0, 1.0)
    norm = q_norm is not None
    if norm:
        assert q_norm.shape == k_norm.shape == (head_dim,), (q_norm.shape, k_norm.shape)
        assert q_norm.is_contiguous() and k_norm.is_contiguous()
    assert q.dtype == k.dtype == v.dtype and k_cache.dtype == v_cache.dtype
    assert q.device == k_cache.device == cos.device == positions.device == slot_mapping.device
    if tokens:
        half = head_dim // 2
        _rope_kv_store_kernel[(tokens,)](
            q, k, v, k_cache, v_cache, cos, sin, positions, slot_mapping,
            q_norm if norm else cos, k_norm if norm else cos,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), n_q_heads, n_kv_heads, half, eps, *inverse_scales,
            NORM=norm, OFFSET=norm_offset,
            BLOCK_HQ=triton.next_power_of_2(n_q_heads),
            BLOCK_HK=triton.next_power_of_2(n_kv_heads),
            BLOCK_D=triton.next_power_of_2(half), num_warps=4,
            **dependent_launch.launch_options(),
        )
    return q
