"""GGUF Q6_K at 2..64 rows of bfloat16 `x` on Hopper's wgmma, written in Gluon: the Q6_K
twin of `gguf_q4k_wgmma.py` (same program shape, register order, x gather and K slices;
read that first). A Q4_K_M file keeps its LM head and half its layers' ffn_down and attn_v
in Q6_K, which gguf_gemm.py read at ~730 GB/s at 32 rows (the 8B down: 66 µs against
bfloat16's 44; this kernel 45 µs). `EngineConfig.gguf_q6k_wgmma`, on by default (H100, 8B
Q4_K_M step at batch 8 / 32: 4.88 / 6.14 ms against 5.21 / 6.64 without it).

A super-block is 210 bytes: `ql` (128 bytes of low nibbles), `qh` (64 bytes of 2-bit
highs), 16 int8 scales and an fp16 `d`; its rows are only 2-byte aligned, so every field is
read as 16-bit words. Weight `k = 128 (g // 4) + 16 (g % 4) + 4 t + e + 64 h` is nibble h of
byte e of `ql` word 4g + t, and its high bits are bits `2 (2h + (g // 2) % 2)` of byte e of
`qh` word `4 (2 (g // 4) + g % 2) + t`; its scale is byte `8 (g // 4) + g % 4 + 4 h`. So a
thread holding `ql` words 4g + t (as gguf_q4k_wgmma's words layout) holds each value's
high bits in 4 `qh` words, and one word of 6-bit bytes `v = (nibbles & 0x0F0F0F0F) |
(highs shifted & 0x30303030)` per nibble h gives 4 values (`1 + v 2^-8` or-ed into the bits
of 1.0, then `256 d sc f - 288 d sc`). The thread's values, ordered as gguf_q4k_wgmma's
(`k' = 128 h + 16 g + 8 (e // 2) + 2 t + e % 2`), are the wgmma's A operand; x is
gathered in that order.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from infer.kernels import launch_counters
from infer.kernels.gguf_q4k_wgmma import MAX_ROWS, ONE, store_bf16, words_layout
from infer.kernels.register_wgmma import (
    async_load,
    sums_layout,
    weights_layout,
    x_gather_layout,
    x_shared_layout,
)
from infer.kernels.w8_wgmma import MAX_BLOCKS

UNIT_WORDS = gl.constexpr(105)  # 16-bit words a super-block


@gluon.jit
def _word(ptr):
    """The 32-bit word of the two 16-bit words at `ptr` (2-byte aligned)."""
    lo = gl.load(ptr).to(gl.uint16, bitcast=True).to(gl.uint32)
    hi = gl.load(ptr + 1).to(gl.uint16, bitcast=True).to(gl.uint32)
    return lo | (hi << 16)


@gluon.jit
def _load_unit(row_ptr, ql_off, qh_off, sc_off, u):
    """Super-block u of each row: `d` (`[64]` fp16 bits), the scales' 16-bit words for
    h = 0 and 1 (`[64, 8]`), the `ql` and `qh` words each value takes (`[64, 8, 4]`)."""
    unit = row_ptr + u * UNIT_WORDS
    d = gl.load(unit + 104)
    sc_unit = gl.expand_dims(unit, 1) + sc_off
    units = gl.expand_dims(gl.expand_dims(unit, 1), 2)
    return (d, gl.load(sc_unit), gl.load(sc_unit + 2), _word(units + ql_off),
            _word(units + qh_off))


@gluon.jit
def _scales(d, sc, odd):
    """`a`, `b` with `a f + b = d sc (q - 32)` for `f = 1 + q 2^-8`: `[64, 8, 1]`, from
    `d` (`[64]` fp16 bits) and the scales' 16-bit words `sc [64, 8]`, byte `odd`."""
    df = d.to(gl.float16, bitcast=True).to(gl.float32)
    word = sc.to(gl.uint16, bitcast=True).to(gl.int32)
    s = ((word << (24 - 8 * odd)) >> 24).to(gl.float32)  # the byte, sign-extended
    ds = gl.expand_dims(df, 1) * s
    return gl.expand_dims(256.0 * ds, 2), gl.expand_dims(-288.0 * ds, 2)


@gluon.jit
def _six(vs, a, b, one):
    """`a f + b` for `f = 1 + v 2^-8`, v the 6 bits at bit 15 of `vs`."""
    return ((vs & (0x3F << 15)) | one).to(gl.float32, bitcast=True) * a + b


@gluon.jit
def _values(v, a, b, one):
    """The 4 values of a word of 6-bit bytes `v`, `[.., e % 2, e // 2]`."""
    return gl.join(gl.join(_six(v << 15, a, b, one), _six(v << 7, a, b, one)),
                   gl.join(_six(v >> 1, a, b, one), _six(v >> 9, a, b, one)))


@gluon.jit
def _q6k_wgmma_kernel(x_ptr, q_ptr, y_ptr, part_ptr, counts, M, N, K, pairs_xm, stride_qn,
                      stride_ym, units_per_split, splits, one, BLOCK_M: gl.constexpr,
                      num_warps: gl.constexpr):
    """Program (n, s): rows `64 n..` of W (16-bit words at q_ptr), every row of x (M <=
    BLOCK_M), super-blocks `s * units_per_split..` of K; sums as gguf_q4k_wgmma's."""
    BLOCK_N: gl.constexpr = 64
    layout: gl.constexpr = words_layout()
    row_layout: gl.constexpr = gl.SliceLayout(2, layout)
    acc_layout: gl.constexpr = sums_layout(BLOCK_M)
    a_layout: gl.constexpr = weights_layout(BLOCK_M)
    x_layout: gl.constexpr = x_gather_layout()
    x_smem: gl.constexpr = x_shared_layout(BLOCK_M, 256)

    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, row_layout))
    g = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, row_layout)), 0)
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    t = gl.expand_dims(gl.expand_dims(t, 0), 1)
    row_ptr = q_ptr + gl.minimum(pid_n * BLOCK_N + rows, N - 1).to(gl.int64) * stride_qn
    ql_off = 2 * (4 * gl.expand_dims(g, 2) + t)
    qh_off = 64 + 2 * (4 * gl.expand_dims(2 * (g // 4) + g % 2, 2) + t)
    sc_off = 96 + 4 * (g // 4) + g % 4 // 2
    odd = g % 2
    shift = gl.expand_dims(2 * (g // 2 % 2), 2)  # the highs' bit in byte e, h = 0
    kp = gl.arange(0, 256, layout=gl.SliceLayout(0, x_layout))
    kx = 128 * (kp // 64 % 2) + 16 * (kp // 16 % 4) + 4 * (kp // 2 % 4) \
        + 2 * (kp // 8 % 2) + kp % 2 + 64 * (kp // 128)
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
    x_rows = x_ptr + gl.expand_dims(rm.to(gl.int64) * (2 * pairs_xm), 1)
    x_ok = gl.expand_dims(rm < M, 1)
    xs = gl.allocate_shared_memory(gl.bfloat16, [3, BLOCK_M, 256], x_smem)

    u0 = pid_s * units_per_split
    u1 = gl.minimum(u0 + units_per_split, K // 256)
    acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=acc_layout)
    d, sc0, sc1, ql, qh = _load_unit(row_ptr, ql_off, qh_off, sc_off, u0)
    async_load(xs.index(0), x_rows + gl.expand_dims(u0 * 256 + kx, 0), mask=x_ok)
    async_copy.commit_group()
    for u in range(u0, u1):
        un = gl.minimum(u + 1, u1 - 1)
        n_d, n_sc0, n_sc1, n_ql, n_qh = _load_unit(row_ptr, ql_off, qh_off, sc_off, un)
        async_load(xs.index((u - u0 + 1) % 3), x_rows + gl.expand_dims(un * 256 + kx, 0),
                   mask=x_ok)
        async_copy.commit_group()
        a0, b0 = _scales(d, sc0, odd)
        a1, b1 = _scales(d, sc1, odd)
        v0 = (ql & 0x0F0F0F0F) | ((qh << (4 - shift)) & 0x30303030)
        v1 = ((ql >> 4) & 0x0F0F0F0F) | ((qh >> shift) & 0x30303030)
        # [row, g, t, e % 2, e // 2, h] -> [row, h, g, e // 2, t, e % 2]: k' in order
        tile = gl.permute(gl.join(_values(v0, a0, b0, one), _values(v1, a1, b1, one)),
                          (0, 5, 1, 4, 2, 3))
        a = gl.convert_layout(gl.reshape(tile, (BLOCK_N, 256)).to(gl.bfloat16), a_layout,
                              assert_trivial=True)
        async_copy.wait_group(1)  # this super-block's x is in
        fence_async_shared()
        acc = warpgroup_mma(a, xs.index((u - u0) % 3).permute((1, 0)), acc)
        d, sc0, sc1, ql, qh = n_d, n_sc0, n_sc1, n_ql, n_qh
    async_copy.wait_group(0)  # the last iteration's copy (of the last super-block again)
    store_bf16(acc, pid_n, pid_s, y_ptr, part_ptr, counts, M, N, stride_ym, splits,
               BLOCK_M)


def q6k_wgmma(x: torch.Tensor, words: torch.Tensor, cols: int, *, split: int = 1
              ) -> torch.Tensor:
    """`x [M, cols]` (bfloat16, up to 64 rows, 4-byte aligned rows) times the transpose of
    the Q6_K weight `words [N, cols / 256 * 105]` (16-bit, gguf_gemm.gemm_words), K split
    over `split` programs a channel block: `[M, N]` bfloat16."""
    assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and cols % 256 == 0, (
        x.dtype, x.stride(), cols)
    assert x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0, "x in 4-byte pairs"
    assert words.dtype == torch.int16 and words.shape[1] == cols // 256 * UNIT_WORDS.value
    m, n = x.shape[0], words.shape[0]
    assert m <= MAX_ROWS, m
    units = cols // 256
    per_split = triton.cdiv(units, max(1, min(split, units)))
    split = triton.cdiv(units, per_split)
    blocks = triton.cdiv(n, 64)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    parts = torch.empty((split, m, n), dtype=torch.float32, device=x.device) \
        if split > 1 else y
    if m and n:
        _q6k_wgmma_kernel[(blocks, split)](
            x, words, y, parts, launch_counters("gguf_q6k_wgmma", x.device, MAX_BLOCKS, blocks),
            m, n, cols, x.stride(0) // 2, words.stride(0), y.stride(0), per_split, split, ONE,
            BLOCK_M=min(MAX_ROWS, max(16, triton.next_power_of_2(m))), num_warps=4)
    return y
