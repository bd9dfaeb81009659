"""GGUF matmul at a few rows of `x` (decode batches, 2..64 rows): `y = x @ W^T` for Q4_K,
Q6_K (the types of a Q4_K_M file) and Q8_0, the stored blocks decoded in registers and
multiplied through `tl.dot`, so that a step reads only the quantized bytes.

A program owns BLOCK_N rows of `W` and BLOCK_M rows of `x` (16 at least: `tl.dot`'s
smallest) and computes `acc [BLOCK_N, BLOCK_M] = W x^T` (the weight is the dot's first
operand: BLOCK_N fills the wide side of the instruction, the few rows of `x` the narrow
one). It walks K UNITS units a step (a unit: 256 weights; Q4_K: a 144-byte super-block;
Q6_K: a 210-byte one; Q8_0: 8 blocks of 34 bytes) and decodes a unit in pieces of 64
(Q8_0: 128) weights, each `[BLOCK_N, 2, 8, 4]` (`[BLOCK_N, 2, 16, 2]`, `[BLOCK_N, 4, 16,
2]`) whose row-major order is the order of k, so that the piece reshapes to `[BLOCK_N,
64]` and meets a contiguous `[64, BLOCK_M]` tile of `x^T`.

Decoding, as in gguf_gemv.py: 32-bit word loads (Q6_K, Q8_0: 16-bit words, their blocks
being only 2-byte aligned; Q6_K as 32-bit words, every other super-block funnel-shifted,
ran 2.5x slower on the H100), each field masked in place (its word shifted by the
field's bit offset) and made a float without the int->float convert (or-ed into the
float32 bits of 2^23, 2^23 subtracted), scales decoded once per group and broadcast. The
piece is scaled in float32 and rounded once to x's dtype (bf16 / fp16), as dequantizing
does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as QType

from infer.kernels.gguf_gemv import _f16_hi, _f16_lo, _word, multiprocessors

# Weights and words (Q6_K, Q8_0: 16-bit words) per unit of K.
UNITS_OF: dict[QType, tuple[int, int]] = {
    QType.Q4_K: (256, 36), QType.Q6_K: (256, 105), QType.Q8_0: (256, 136),
}
_Q4_K = tl.constexpr(int(QType.Q4_K))
_Q6_K = tl.constexpr(int(QType.Q6_K))
MAGIC = 0x4B000000  # 2^23 as float32 bits


@triton.jit
def _float(magic, bits, OFFSET: tl.constexpr):
    """`field - OFFSET` for the field (< 2^23) in `bits` (int32, all other bits zero)."""
    return (bits | magic).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _half(ptr):
    """The 16-bit word at `ptr`, as uint32."""
    return tl.load(ptr).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _dot(acc, w, x_ptr, k, K, rm, M, stride_xm, BLOCK_N: tl.constexpr, PIECE: tl.constexpr,
         IEEE: tl.constexpr):
    """`acc + w x^T` for the piece `w [BLOCK_N, .., ..]` (float32, its PIECE weights k.. of
    each row in row-major order) and rows `rm` of `x`."""
    kk = k + tl.arange(0, PIECE)
    xt = tl.load(x_ptr + rm[None, :].to(tl.int64) * stride_xm + kk[:, None],
                 mask=(rm[None, :] < M) & (kk[:, None] < K), other=0.0)
    w = tl.reshape(w, (BLOCK_N, PIECE)).to(xt.dtype)
    if IEEE:  # float32 inputs: no TF32 rounding
        return tl.dot(w, xt, acc, input_precision="ieee")
    else:
        return tl.dot(w, xt, acc)


@triton.jit
def _q4_k_unit(acc, magic, p, ok, k0, K, x_ptr, rm, M, stride_xm, BLOCK_N: tl.constexpr,
               IEEE: tl.constexpr):
    """The Q4_K super-block at words `p [BLOCK_N, 1, 1, 1]` (`d`, `dmin` 0 where not `ok`):
    words 4 + 8c.. hold sub-block 2c (h = 0) in their low nibbles, 2c + 1 (h = 1) in their
    high ones; byte e of word j of a chunk is weight 4j + e of both."""
    h = tl.arange(0, 2)[None, :, None, None]
    j = tl.arange(0, 8)[None, None, :, None]
    e = tl.arange(0, 4)[None, None, None, :]
    head = tl.load(p, mask=ok, other=0).to(tl.uint32, bitcast=True)
    s0 = _word(p + 1)
    s1 = _word(p + 2)
    s2 = _word(p + 3)
    d = _f16_lo(head)
    dmin = _f16_hi(head)
    for c in tl.static_range(4):
        w = _word(p + 4 + c * 8 + j)
        # Bytes 0 and 1 of sc, mn: the 6-bit scales (mins) of sub-blocks 2c and 2c + 1.
        sh = c % 2 * 16
        if c < 2:
            sc = s0 >> sh
            mn = s1 >> sh
        else:
            sc = ((s2 >> sh) & 0x0F0F) | ((s0 >> (sh + 2)) & 0x3030)
            mn = ((s2 >> (sh + 4)) & 0x0F0F) | ((s1 >> (sh + 2)) & 0x3030)
        scale = d * _float(magic, (sc >> (h * 8)) & 0x3F, 0)
        low = dmin * _float(magic, (mn >> (h * 8)) & 0x3F, 0)
        q = _float(magic, (w >> (e * 8 + h * 4)) & 0xF, 0)
        acc = _dot(acc, q * scale - low, x_ptr, k0 + c * 64, K, rm, M, stride_xm,
                   BLOCK_N, 64, IEEE)
    return acc


@triton.jit
def _q6_k_unit(acc, magic, p, ok, k0, K, x_ptr, rm, M, stride_xm, BLOCK_N: tl.constexpr,
               IEEE: tl.constexpr):
    """The Q6_K super-block at 16-bit words `p [BLOCK_N, 1, 1, 1]` (`d` 0 where not `ok`).
    Weight 128h + 64t + 32a + 2i + e: low 4 bits in nibble t of byte e of `ql` word
    32h + 16a + i, high 2 bits at bit 8e + 4t + 2a of `qh` word 64 + 16h + i; its scale
    is int8 byte i // 8 of word 96 + 4h + 2t + a; `d` is word 104."""
    a = tl.arange(0, 2)[None, :, None, None]
    i = tl.arange(0, 16)[None, None, :, None]
    e = tl.arange(0, 2)[None, None, None, :]
    d = tl.load(p + 104, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    for h in tl.static_range(2):
        ql = _half(p + h * 32 + a * 16 + i)
        qh = _half(p + 64 + h * 16 + i)
        for t in tl.static_range(2):
            s = _half(p + 96 + h * 4 + t * 2 + a)
            sc = _float(magic, ((s >> (i // 8 * 8)) & 0xFF) ^ 0x80, 128)
            six = ((ql >> (e * 8 + t * 4)) & 0xF) | (((qh >> (e * 8 + t * 4 + a * 2)) & 3) << 4)
            w = _float(magic, six, 32) * (d * sc)
            acc = _dot(acc, w, x_ptr, k0 + h * 128 + t * 64, K, rm, M, stride_xm, BLOCK_N,
                       64, IEEE)
    return acc


@triton.jit
def _q8_0_unit(acc, magic, p, ok, k0, K, x_ptr, rm, M, stride_xm, BLOCK_N: tl.constexpr,
               IEEE: tl.constexpr):
    """The 8 Q8_0 blocks at 16-bit words `p [BLOCK_N, 1, 1, 1]`: block b's fp16 `d` is word
    17b, its weight 2i + e byte e of word 17b + 1 + i. Blocks past K, or all if not `ok`,
    add nothing."""
    b = tl.arange(0, 4)[None, :, None, None]
    i = tl.arange(0, 16)[None, None, :, None]
    e = tl.arange(0, 2)[None, None, None, :]
    for c in tl.static_range(2):
        blk = c * 4 + b
        here = (k0 + blk * 32 < K) & ok
        d = tl.load(p + blk * 17, mask=here, other=0).to(tl.float16, bitcast=True)
        w = tl.load(p + blk * 17 + 1 + i, mask=here, other=0).to(tl.uint16, bitcast=True)
        byte = ((w.to(tl.uint32) >> (e * 8)) + 0x80) & 0xFF  # q + 128
        wt = _float(magic, byte, 128) * d.to(tl.float32)
        acc = _dot(acc, wt, x_ptr, k0 + c * 128, K, rm, M, stride_xm, BLOCK_N, 128, IEEE)
    return acc


@triton.jit
def _gguf_gemm_kernel(
    x_ptr, q_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_ys, stride_ym,
    units_per_split, magic,
    QTYPE: tl.constexpr, UNIT_K: tl.constexpr, UNIT_WORDS: tl.constexpr, UNITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (n, m, s) owns rows `n * BLOCK_N..` of W, `m * BLOCK_M..` of x and units
    `s * units_per_split..` of K (a multiple of UNITS), UNITS a step, writing its sums at
    `y + s * stride_ys`. Rows of W past N read the last row (not stored); units past the
    split read its last one with their scales masked to 0; rows of x past M, and k past K
    (Q8_0 only: the others take whole units), load as 0, as do Q8_0's blocks past K."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p = q_ptr + (tl.minimum(rn, N - 1).to(tl.int64) * stride_qn)[:, None, None, None]
    u0 = pid_s * units_per_split
    u1 = tl.minimum(u0 + units_per_split, tl.cdiv(K, UNIT_K))
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for u in range(u0, u1, UNITS):
        for v in tl.static_range(UNITS):
            ok = tl.full((BLOCK_N, 1, 1, 1), u + v, tl.int32) < u1
            uc = tl.minimum(u + v, u1 - 1)
            unit = p + uc * UNIT_WORDS
            if QTYPE == _Q4_K:
                acc = _q4_k_unit(acc, magic, unit, ok, uc * UNIT_K, K, x_ptr, rm, M, stride_xm,
                                 BLOCK_N, IEEE)
            elif QTYPE == _Q6_K:
                acc = _q6_k_unit(acc, magic, unit, ok, uc * UNIT_K, K, x_ptr, rm, M, stride_xm,
                                 BLOCK_N, IEEE)
            else:
                acc = _q8_0_unit(acc, magic, unit, ok, uc * UNIT_K, K, x_ptr, rm, M, stride_xm,
                                 BLOCK_N, IEEE)
    tl.store(y_ptr + pid_s * stride_ys + rm[None, :].to(tl.int64) * stride_ym + rn[:, None],
             acc.to(y_ptr.dtype.element_ty), mask=(rm[None, :] < M) & (rn[:, None] < N))


def gemm_words(data: torch.Tensor, qtype: QType, cols: int) -> torch.Tensor | None:
    """`data [N, bytes per row]` as the kernel's words (Q4_K: int32; Q6_K, Q8_0: int16)
    when it takes it (its type, aligned rows), else None."""
    if qtype not in UNITS_OF or data.dim() != 2 or data.stride(1) != 1:
        return None
    size = 4 if qtype == QType.Q4_K else 2
    if data.shape[1] % size or data.stride(0) % size or data.storage_offset() % size:
        return None
    if qtype != QType.Q8_0 and cols % UNITS_OF[qtype][0]:
        return None
    return data.view(torch.int32 if size == 4 else torch.int16)


def gemm_launch(qtype: QType, rows: int, n: int, cols: int, device: torch.device) -> dict:
    """The launch of gguf_gemm for `x [rows, cols]` and `n` rows of W. Measured on the
    H100 (Llama-3.1-8B shapes, bf16 x at 8, 32 and 64 rows, weights cycled past L2;
    benchmarks/quantized_gemv.py --gemm-sweep): 64 rows of W a program, 4 warps, one unit
    a step; K split while that keeps the programs (of 64 rows) under 4 per multiprocessor,
    up to 8 splits (4 above 32 rows): the time follows the programs in flight (down at 8
    rows: 40 us split 8, 127 unsplit). Above 32 rows (BLOCK_M 64) Q4_K with many rows of W
    takes 128 a program, 8 warps (gate_up 94 us, 114 with 64), Q8_0 32 (gate_up 187, 239).
    Two units a step ran slower from 32 rows (up to 2x at 64), and no faster at 8."""
    programs = triton.cdiv(n, 64) * triton.cdiv(rows, 64)
    limit = 4 * multiprocessors(torch.device(device))
    most = 8 if rows <= 32 else 4
    split = 1
    while split < most and 2 * split <= triton.cdiv(cols, 256) and 2 * split * programs <= limit:
        split *= 2
    block_n, num_warps = 64, 4
    if rows > 32 and qtype == QType.Q4_K and n >= 16384:
        block_n, num_warps = 128, 8
    elif rows > 32 and qtype == QType.Q8_0:
        block_n = 32
    return dict(block_n=block_n, split=split, num_warps=num_warps, units=1)


def gguf_gemm(x: torch.Tensor, words: torch.Tensor, qtype: QType, cols: int, *,
              block_n: int, split: int, num_warps: int, units: int = 1, num_stages: int = 2,
              block_m: int | None = None) -> torch.Tensor:
    """`x [M, cols]` times the transpose of the weight `words [N, words per row]` (from
    gemm_words): `[M, N]` in x's dtype. `split` > 1 splits K (in units) over that many
    programs, their float32 sums added after; `block_m` defaults to M rounded up to a
    power of 2 (16 at least, 64 at most)."""
    unit_k, unit_words = UNITS_OF[qtype]
    m, n = x.shape[0], words.shape[0]
    if block_m is None:
        block_m = min(64, max(16, triton.next_power_of_2(m)))
    steps = triton.cdiv(cols, unit_k * units)
    per_split = triton.cdiv(steps, max(1, min(split, steps))) * units
    split = max(1, triton.cdiv(triton.cdiv(cols, unit_k), per_split))
    shape = (m, n) if split == 1 else (split, m, n)
    y = torch.empty(shape, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    if m == 0 or n == 0 or cols == 0:
        return y.zero_() if split == 1 else y.sum(0).to(x.dtype)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    _gguf_gemm_kernel[grid](
        x, words, y, m, n, cols, x.stride(0), words.stride(0), m * n, n, per_split, MAGIC,
        QTYPE=int(qtype), UNIT_K=unit_k, UNIT_WORDS=unit_words, UNITS=units, BLOCK_M=block_m,
        BLOCK_N=block_n, IEEE=x.dtype == torch.float32, num_warps=num_warps,
        num_stages=num_stages,
    )
    return y if split == 1 else y.sum(0).to(x.dtype)
