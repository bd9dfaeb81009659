"""One token's q/k/v projection with RoPE and the KV store in the GEMV's epilogue
(`EngineConfig.qkv_rope_epilogue`): what `gemv.gemv` then `rope_kv_store.rope_store_kv`
do, in one launch.

Neox RoPE rotates channel j of a head with channel j + D/2. The launch's first programs
each own pairs of q and k channels: their weight tile's rows alternate j and j + D/2 (as
`gemv_gate_up`'s alternate gate and up channels), so a program holds both halves of its
pairs, rotates them at the token's position and stores q's into the attention's input and
k's into the cache at the token's slot; the programs after them own v's channels and
store them into the cache. The RoPE kernel's launch goes, and no program waits for
another's store (RoPE inside the attention kernel instead cost more than its launch, as
every split waited for the one that stored the new key: docs/performance.md, session 50).

Rounded as the two kernels round: the projection's outputs to x's dtype, then q rotated
in float32 and rounded to its dtype, k rotated, rounded to its dtype and then the cache's,
v to the cache's; each channel's sum as the GEMV sums it at the same launch, so the result
is bit for bit theirs. No q/k norm (Qwen3's and Gemma's need a whole head in a program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch, gpu_compiled
from infer.kernels.gemv import _channels, _sums, _weights, default_launch

# The plain INT8 GEMV's registers a thread (sm_90, Triton 3.6), so that as many programs
# share an SM: the epilogue took 77-80 (three 8-warp programs an SM where the GEMV has four), and
# lost 3.0 / 1.9 µs a layer on an H200's 1B / 8B (docs/performance.md, session 52). At 64
# the 1B INT8 form spills nothing, the 8B's 8 bytes (INT8) or 32 (bf16). Unmeasured.
MAX_REGISTERS = 64


@triton.jit
def _qkv_rope_kernel(
    x_ptr, w_ptr, s_ptr, q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
    K, stride_wn, stride_cs, n_q_heads, n_kv_heads, half, pair_programs,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SCALED: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    r = tl.arange(0, BLOCK_N)
    d = 2 * half
    n_pairs = (n_q_heads + n_kv_heads) * half
    n_v = n_kv_heads * d
    # Before the dependent-launch wait: the token's position and slot (written before the
    # step's kernels start, never by the kernel before), the cos / sin of a pair
    # program's pairs, and the first weight tile.
    pos = tl.load(pos_ptr).to(tl.int64)
    slot = tl.load(slot_ptr).to(tl.int64)
    pair = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    j = pair % half
    # Weight rows: a pair program's tile row 2i is channel j of pair i's head, 2i + 1 its
    # channel j + D/2; a v program's rows are v's channels in order. Past the last pair
    # or channel, the last one again (not stored).
    if pid < pair_programs:
        tile_pair = tl.minimum(pid * (BLOCK_N // 2) + r // 2, n_pairs - 1)
        wn = (tile_pair // half) * d + tile_pair % half + (r % 2) * half
        inside = pair < n_pairs
        cos = tl.load(cos_ptr + pos * stride_cs + j, mask=inside, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * stride_cs + j, mask=inside, other=0.0).to(tl.float32)
    else:
        wn = (n_q_heads + n_kv_heads) * d + tl.minimum((pid - pair_programs) * BLOCK_N + r,
                                                       n_v - 1)
        cos = tl.zeros([BLOCK_N // 2], dtype=tl.float32)
        sin = tl.zeros([BLOCK_N // 2], dtype=tl.float32)
    w_rows = w_ptr + wn.to(tl.int64)[:, None] * stride_wn
    rk = tl.arange(0, BLOCK_K)
    w = _weights(w_rows, rk, K, EVEN_K)
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    acc, _ = _sums(w, w_rows, rk, x_ptr, 0, K, BLOCK_K, 1, EVEN_K, PTX)
    y = _channels(acc, s_ptr, wn, SCALED)
    y = y.to(q_ptr.dtype.element_ty)
    if pid < pair_programs:
        x1, x2 = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
        inside = pair < n_pairs
        head = pair // half
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        r1 = a * cos - b * sin
        r2 = b * cos + a * sin
        is_q = inside & (head < n_q_heads)
        at_q = q_ptr + head * d + j
        tl.store(at_q, r1.to(q_ptr.dtype.element_ty), mask=is_q)
        tl.store(at_q + half, r2.to(q_ptr.dtype.element_ty), mask=is_q)
        is_k = inside & (head >= n_q_heads) & ((tl.zeros_like(j).to(tl.int64) + slot) >= 0)
        at_k = kc_ptr + slot * n_v + (head - n_q_heads) * d + j
        tl.store(at_k, r1.to(q_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty), mask=is_k)
        tl.store(at_k + half, r2.to(q_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty),
                 mask=is_k)
    else:
        c = (pid - pair_programs) * BLOCK_N + r
        tl.store(vc_ptr + slot * n_v + c, y.to(vc_ptr.dtype.element_ty),
                 mask=(c < n_v) & ((tl.zeros_like(c).to(tl.int64) + slot) >= 0))


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
             num_heads: int, num_kv_heads: int, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x [1, K]` times the fused q/k/v `weight [(H + 2 KvH) * D, K]` (x's dtype, or 8-bit
    with `scale` per channel), q and k rotated at `positions[0]` by `cos` / `sin` `[max_pos,
    D / 2]` (as `rope_kv_store`), k and v stored into the caches `[blocks, block_size, KvH,
    D]` (contiguous) at `slot_mapping[0]` (-1: not stored): q `[1, H, D]`."""
    head_dim = k_cache.shape[3]
    half = head_dim // 2
    n, k = weight.shape
    assert x.shape == (1, k) and x.stride(1) == 1 and weight.stride(1) == 1, x.shape
    assert n == (num_heads + 2 * num_kv_heads) * head_dim and head_dim % 2 == 0, n
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == num_kv_heads
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cos.shape == sin.shape and cos.shape[1] == half and cos.stride(1) == 1
    assert sin.stride() == cos.stride()
    assert positions.shape == slot_mapping.shape == (1,), positions.shape
    if scale is None:
        assert weight.dtype == x.dtype, (weight.dtype, x.dtype)
    else:
        assert weight.dtype in (torch.int8, torch.float8_e4m3fn) and scale.shape == (n,)
    q = torch.empty((1, num_heads, head_dim), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = default_launch(n, k, weight.element_size())
    pair_programs = triton.cdiv((num_heads + num_kv_heads) * half, block_n // 2)
    grid = (pair_programs + triton.cdiv(num_kv_heads * head_dim, block_n),)
    _qkv_rope_kernel[grid](
        x, weight, weight if scale is None else scale, q, k_cache, v_cache, cos, sin,
        positions, slot_mapping, k, weight.stride(0), cos.stride(0), num_heads,
        num_kv_heads, half, pair_programs,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        SCALED=scale is not None, PTX=gpu_compiled(x.device), num_warps=num_warps,
        maxnreg=MAX_REGISTERS, **dependent_launch.launch_options(),
    )
    return q
