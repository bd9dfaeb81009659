"""Store new keys/values `[T, KvH, D]` into the paged caches at their flat slots.

Cache layout (per layer): `[num_blocks, block_size, KvH, D]`, contiguous, so slot
`s = block * block_size + row` starts at element `s * KvH * D`. Slot -1 means skip. An
FP8 cache (`attention/kv_dtype.py`) takes each value times its scale's inverse, saturated
at ±448 (`cache_values`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def cache_values(x, cache_ptr, inverse_scale):
    """`x` as the cache at `cache_ptr` stores it (`kv_dtype.as_cache_values`; an FP8 cache's
    values times `inverse_scale`, float32)."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        return _e4m3_saturated(x.to(tl.float32) * inverse_scale).to(tl.float8e4nv,
                                                                     bitcast=True)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _e4m3_saturated(x):
    """float32 -> e4m3 bytes (uint8), rounded to nearest even and saturated at ±448, by
    integer arithmetic (torch's conversion, bit for bit; Triton's interpreter rounds a value
    that carries into the next power of two down to the power below): a normal magnitude
    keeps float32's exponent and top 3 mantissa bits, rounded by adding 2^19 - 1 plus the
    kept last bit, rebiased from 127 to 7; a subnormal one (below 2^-6) is its count of
    2^-9, rounded by adding and taking away 2^23 (whose float32 step is 1)."""
    a = tl.minimum(tl.abs(x), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    byte = tl.where(a < 0.015625, subnormal, normal)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (byte | sign).to(tl.uint8)


@triton.jit
def _kv_store_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    n_heads, head_dim, k_inverse, v_inverse,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    keep = (tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot) >= 0
    mask = (heads < n_heads) & (dims < head_dim) & keep
    dst = slot * n_heads * head_dim + heads * head_dim + dims
    k = tl.load(k_ptr + tok * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(kc_ptr + dst, cache_values(k, kc_ptr, k_inverse), mask=mask)
    tl.store(vc_ptr + dst, cache_values(v, vc_ptr, v_inverse), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, inverse_scales: tuple[float, float] = (1.0, 1.0)
             ) -> None:
    """`k_cache.view(-1, KvH, D)[slot_mapping[t]] = k[t]` (same for v), skipping slot -1;
    an FP8 cache's keys and values times `inverse_scales` (float32)."""
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    _, _, n_heads, head_dim = k_cache.shape
    assert k.dim() == 3 and k.shape == v.shape and k.shape[1:] == (n_heads, head_dim), (
        k.shape, v.shape, k_cache.shape)
    # The kernel computes slot offsets from the logical shape: caches must be contiguous.
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.stride(2) == 1 and v.stride(2) == 1, (k.stride(), v.stride())
    assert slot_mapping.shape == (k.shape[0],) and not slot_mapping.is_floating_point()
    assert k_cache.dtype == v_cache.dtype and k.device == k_cache.device == slot_mapping.device
    if k.shape[0]:
        _kv_store_kernel[(k.shape[0],)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            n_heads, head_dim, *inverse_scales,
            BLOCK_H=triton.next_power_of_2(n_heads), BLOCK_D=triton.next_power_of_2(head_dim),
            num_warps=4,
        )
