"""GGUF matmul: `y = x @ W^T`, `W [N, K]` a GGUF-quantized weight read as it is stored
(ggml's blocks, each row of `W` its own run of blocks along K), `x [M, K]` 16-bit (or
float32), float32 accumulation; and `gguf_dequantize`, the same blocks decoded to `W`.

Block layouts (little-endian; `gguf.quants` is the reference), `q` the stored integers:
- Q8_0, 34 bytes per 32 weights: fp16 `d`, 32 int8 `q`; `w = d * q`.
- Q4_0, 18 bytes per 32: fp16 `d`, 16 bytes of nibbles; `w = d * (q - 8)`.
- Q4_1, 20 bytes per 32: fp16 `d`, fp16 `m`, 16 bytes of nibbles; `w = d * q + m`.
  (In both, byte j holds weight j in its low nibble and weight j + 16 in its high one.)
- Q4_K, 144 bytes per 256: fp16 `d`, `dmin`, 12 bytes packing eight 6-bit scales `sc` and
  mins `mn`, 128 bytes of nibbles (32 bytes hold sub-blocks 2c and 2c + 1 of 32 weights in
  their low and high nibbles); sub-block s is `w = d * sc[s] * q - dmin * mn[s]`.
- Q5_K, 176 bytes per 256: Q4_K's `d`, `dmin`, scales, then 32 bytes `qh` (bit s of byte
  l: the fifth bit of weight l of sub-block s), then Q4_K's 128 bytes of nibbles.
- Q6_K, 210 bytes per 256: 128 bytes `ql` (low nibbles), 64 bytes `qh` (2 high bits), 16
  int8 scales (one per 16 weights), fp16 `d`; `w = d * sc * (q - 32)`.

Meant for decode-sized M (a step's rows), which is bound by reading the weight: each
program owns BLOCK_N rows of `W` and BLOCK_M rows of `x` and walks K a step of UNITS units
of 256 weights (a k-quant super-block, or 8 blocks of 32), decoding the bytes in
registers, so only the quantized bytes cross memory. A unit is decoded as an `[S, L]` tile
(S groups of L weights sharing a scale, computed once per group); one row of `x` is
multiplied with it in registers and reduced once at the end, more rows go through
`tl.dot`. One row of Q4_K or Q6_K goes to gguf_gemv.py instead (32-bit loads, no
int->float converts, scales once per group), 2..64 rows of Q4_K, Q6_K or Q8_0 to
gguf_gemm.py (the same decoding, then `tl.dot`; Q4_K and Q6_K by bfloat16 x on a Hopper
GPU, with `set_wgmma`, to gguf_wgmma.py's wgmma). Larger M (prefill chunks) is
compute-bound: `gguf_dequantize` there, then cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as QType
from gguf.constants import GGML_QUANT_SIZES

from infer.kernels import gluon_hopper
from infer.kernels.gguf_gemm import gemm_launch, gemm_words, gguf_gemm
from infer.kernels.gguf_gemv import gemv_launch, gemv_words, gguf_gemv

UNIT = 256  # weights per unit of K that a program decodes at once
GEMM_ROWS = 64  # Q4_K, Q6_K and Q8_0 at 2..GEMM_ROWS rows go to gguf_gemm.py
# (S, L) of each type's unit: S groups of L weights, k = g * L + i within the unit.
TILES: dict[QType, tuple[int, int]] = {
    QType.Q8_0: (8, 32), QType.Q4_0: (8, 32), QType.Q4_1: (8, 32),
    QType.Q4_K: (8, 32), QType.Q5_K: (8, 32), QType.Q6_K: (16, 16),
}
SUPPORTED = tuple(TILES)

_Q8_0 = tl.constexpr(int(QType.Q8_0))
_Q4_0 = tl.constexpr(int(QType.Q4_0))
_Q4_1 = tl.constexpr(int(QType.Q4_1))
_Q4_K = tl.constexpr(int(QType.Q4_K))
_Q5_K = tl.constexpr(int(QType.Q5_K))
_Q6_K = tl.constexpr(int(QType.Q6_K))


@triton.jit
def _f16(ptr, mask):
    """The fp16 at two (unaligned) bytes, as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _kquant_scales(ptr, g, mask):
    """Sub-block g's 6-bit scale and min from Q4_K/Q5_K's 12 packed bytes at `ptr`."""
    low = g < 4
    a = _byte(ptr + tl.where(low, g, g + 4), mask)
    b = _byte(ptr + tl.where(low, g + 4, g), mask)
    c = _byte(ptr + tl.where(low, g, g - 4), mask)
    sc = tl.where(low, a & 63, (a & 0xF) | ((c >> 6) << 4))
    mn = tl.where(low, b & 63, (a >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _kquant_nibbles(qs, g, i, mask):
    """Weight i of sub-block g in Q4_K/Q5_K's 128 bytes of nibbles at `qs`."""
    return (_byte(qs + g // 2 * 32 + i, mask) >> (g % 2 * 4)) & 0xF


@triton.jit
def _kquant_weights(unit, q, g, mask):
    """Q4_K/Q5_K's `d * sc[g] * q - dmin * mn[g]`."""
    sc, mn = _kquant_scales(unit + 4, g, mask)
    return (_f16(unit, mask) * sc) * q.to(tl.float32) - _f16(unit + 2, mask) * mn


@triton.jit
def _decode(unit, g, i, ok, QTYPE: tl.constexpr):
    """Float32 weights i of groups g: `unit [BLOCK_N, G, 1]` points at the first byte of
    each group's unit, `g [1, G, 1]` is the group's index in its unit, `i [1, 1, L]`,
    `ok [BLOCK_N, G, 1]` masks whole groups (their weights are then 0: scales load as 0)."""
    # The order of the float32 operations is gguf's, so that dequantizing (no FMA) is exact.
    if QTYPE == _Q8_0:
        block = unit + g * 34
        q = tl.load(block + 2 + i, mask=ok, other=0).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * _f16(block, ok)
    elif QTYPE == _Q4_0:
        block = unit + g * 18
        q = (_byte(block + 2 + i % 16, ok) >> (i // 16 * 4)) & 0xF
        w = _f16(block, ok) * (q - 8).to(tl.float32)
    elif QTYPE == _Q4_1:
        block = unit + g * 20
        q = (_byte(block + 4 + i % 16, ok) >> (i // 16 * 4)) & 0xF
        w = _f16(block, ok) * q.to(tl.float32) + _f16(block + 2, ok)
    elif QTYPE == _Q4_K:
        w = _kquant_weights(unit, _kquant_nibbles(unit + 16, g, i, ok), g, ok)
    elif QTYPE == _Q5_K:
        q = _kquant_nibbles(unit + 48, g, i, ok) | (((_byte(unit + 16 + i, ok) >> g) & 1) << 4)
        w = _kquant_weights(unit, q, g, ok)
    else:
        tl.static_assert(QTYPE == _Q6_K)
        # Weight k = 128h + r (h = g // 8): low nibbles from byte 64h + r % 64 (the high
        # nibble for r >= 64), two high bits from byte 128 + 32h + r % 32 (bits 2 (r // 32)).
        half = g // 8
        ql = (_byte(unit + half * 64 + g % 4 * 16 + i, ok) >> (g % 8 // 4 * 4)) & 0xF
        qh = (_byte(unit + 128 + half * 32 + g % 2 * 16 + i, ok) >> (g % 8 // 2 * 2)) & 3
        scale = tl.load(unit + 192 + g, mask=ok, other=0).to(tl.int8, bitcast=True)
        w = (_f16(unit + 208, ok) * scale.to(tl.float32)) * ((ql | (qh << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _gguf_matmul_kernel(
    x_ptr, q_ptr, y_ptr,
    M, N, K, stride_xm, stride_qn, stride_ys, stride_ym, steps_per_split,
    QTYPE: tl.constexpr, S: tl.constexpr, L: tl.constexpr, UNIT_BYTES: tl.constexpr,
    UNITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    """A step is UNITS units, decoded as one `[BLOCK_N, UNITS * S, L]` tile."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)  # split of K: `steps_per_split` steps
    STEP: tl.constexpr = UNITS * S * L
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    gs = tl.arange(0, UNITS * S)[None, :, None]  # group in the step
    i = tl.arange(0, L)[None, None, :]
    rows = q_ptr + rn[:, None, None].to(tl.int64) * stride_qn
    t0 = pid_s * steps_per_split
    t1 = tl.minimum(t0 + steps_per_split, tl.cdiv(K, STEP))
    if BLOCK_M == 1:  # products summed in registers, reduced once
        acc3 = tl.zeros((BLOCK_N, UNITS * S, L), dtype=tl.float32)
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        for t in range(t0, t1):
            kg = t * STEP + gs * L  # each group's first k
            ok = (rn[:, None, None] < N) & (kg < K)
            w = _decode(rows + (t * UNITS + gs // S) * UNIT_BYTES, gs % S, i, ok, QTYPE)
            x = tl.load(x_row + kg + i, mask=kg + i < K, other=0.0)
            acc3 += w * x.to(tl.float32)
        acc = tl.sum(tl.sum(acc3, axis=2), axis=1)[None, :]
    else:
        rk = tl.arange(0, STEP)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(t0, t1):
            kk = t * STEP + rk
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            kg = t * STEP + gs * L
            ok = (rn[:, None, None] < N) & (kg < K)
            w = _decode(rows + (t * UNITS + gs // S) * UNIT_BYTES, gs % S, i, ok, QTYPE)
            w = tl.trans(tl.reshape(w, (BLOCK_N, STEP))).to(x.dtype)
            if IEEE:  # float32 inputs: no TF32 rounding
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
    tl.store(y_ptr + pid_s * stride_ys + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _gguf_dequantize_kernel(
    q_ptr, w_ptr, N, K, stride_qn, stride_wn,
    QTYPE: tl.constexpr, S: tl.constexpr, L: tl.constexpr, UNIT_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    u = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.arange(0, S)[None, :, None]
    i = tl.arange(0, L)[None, None, :]
    kg = u * (S * L) + g * L
    unit = q_ptr + rn[:, None, None].to(tl.int64) * stride_qn + u * UNIT_BYTES
    w = _decode(unit, g, i, (rn[:, None, None] < N) & (kg < K), QTYPE)
    tl.store(w_ptr + rn[:, None, None].to(tl.int64) * stride_wn + kg + i,
             w.to(w_ptr.dtype.element_ty), mask=(rn[:, None, None] < N) & (kg + i < K))


def _check_blocks(data: torch.Tensor, qtype: QType, cols: int) -> tuple[int, int, int]:
    """`(S, L, bytes per unit)` of `qtype`, after checking `data` holds `cols`-weight rows."""
    if qtype not in TILES:
        name = getattr(qtype, "name", str(qtype))
        raise ValueError(f"GGUF type {name} has no Triton kernel (supported: "
                         f"{', '.join(t.name for t in SUPPORTED)})")
    block, size = GGML_QUANT_SIZES[QType(qtype)]
    assert data.dtype == torch.uint8 and data.dim() == 2 and data.stride(1) == 1, (
        data.dtype, data.shape, data.stride())
    assert cols % block == 0 and data.shape[1] == cols // block * size, (
        QType(qtype).name, cols, data.shape)
    groups, width = TILES[qtype]
    return groups, width, UNIT // block * size


def gguf_matmul(x: torch.Tensor, data: torch.Tensor, qtype: QType, cols: int) -> torch.Tensor:
    """`x [M, cols]` (float16 / bfloat16 / float32, unit column stride) times the transpose
    of the GGUF weight `data [N, bytes per row]` (uint8, each row its blocks as stored):
    `[M, N]` in x's dtype. ValueError for a type without a kernel."""
    if x.shape[0] == 1 and gemv_words(data, qtype) is not None:
        return _matmul(x, data, qtype, cols, **gemv_launch(qtype, data.shape[0], cols, x.device))
    if 1 < x.shape[0] <= GEMM_ROWS and gemm_words(data, qtype, cols) is not None:
        if (_wgmma.get(qtype) and x.dtype == torch.bfloat16 and x.stride(1) == 1
                and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0
                and gluon_hopper(x.device, "gguf_wgmma")):
            from infer.kernels.gguf_wgmma import gguf_wgmma

            return gguf_wgmma(x, gemm_words(data, qtype, cols), qtype, cols)
        return _gemm(x, data, qtype, cols,
                     **gemm_launch(qtype, x.shape[0], data.shape[0], cols, x.device))
    # Measured on the H100 (4096 x 4096 and 4096 x 14336, bf16; CUDA graphs): 16 rows of W
    # a program, two units a step.
    return _matmul(x, data, qtype, cols, block_n=8 if x.shape[0] == 1 else 16, units=2,
                   split=1)


# EngineConfig.gguf_q4k_wgmma / gguf_q6k_wgmma, set by the runner's set-up
_wgmma = {QType.Q4_K: False, QType.Q6_K: False}


def set_wgmma(qtype: QType, on: bool) -> None:
    """Whether 2..GEMM_ROWS rows of bfloat16 x by `qtype` blocks (Q4_K or Q6_K) take
    gguf_wgmma.py (where `kernels.gluon_hopper`) from now on."""
    assert qtype in _wgmma, qtype
    _wgmma[qtype] = on


def _matmul(x: torch.Tensor, data: torch.Tensor, qtype: QType, cols: int, *, block_n: int,
            units: int, split: int, num_warps: int = 4, num_stages: int = 3,
            gemv: bool = True, maxnreg: int | None = None) -> torch.Tensor:
    """gguf_matmul with its launch spelled out (for tuning): `units` (a power of 2) units
    of K a step; `split` > 1 splits K over that many programs, summing float32 partials.
    One row of a type that gguf_gemv.py takes goes there (unless not `gemv`): its units
    are UNITS_OF's (Q6_K: 512 weights); `maxnreg` caps its registers a thread."""
    groups, width, unit_bytes = _check_blocks(data, qtype, cols)
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    assert x.shape[1] == cols and x.device == data.device, (x.shape, cols, x.device)
    m, n = x.shape[0], data.shape[0]
    words = gemv_words(data, qtype) if gemv and m == 1 else None
    if words is not None:
        return gguf_gemv(x, words, qtype, cols, block_n=block_n, units=units, split=split,
                         num_warps=num_warps, maxnreg=maxnreg)
    steps = triton.cdiv(cols, units * UNIT)
    per_split = triton.cdiv(steps, max(1, min(split, steps)))
    split = max(1, triton.cdiv(steps, per_split))
    shape = (m, n) if split == 1 else (split, m, n)
    y = torch.empty(shape, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    if m > 0 and n > 0:
        block_m = 1 if m == 1 else 16 if m <= 16 else 32 if m <= 32 else 64
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
        _gguf_matmul_kernel[grid](
            x, data, y, m, n, cols, x.stride(0), data.stride(0), m * n, n, per_split,
            QTYPE=int(qtype), S=groups, L=width, UNIT_BYTES=unit_bytes, UNITS=units,
            BLOCK_M=block_m, BLOCK_N=block_n, IEEE=x.dtype == torch.float32,
            num_warps=num_warps, num_stages=num_stages,
        )
    return y if split == 1 else y.sum(0).to(x.dtype)


def _gemm(x: torch.Tensor, data: torch.Tensor, qtype: QType, cols: int, **launch
          ) -> torch.Tensor:
    """gguf_matmul through gguf_gemm.py with its launch spelled out (for tuning)."""
    _check_blocks(data, qtype, cols)
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    assert x.shape[1] == cols and x.device == data.device, (x.shape, cols, x.device)
    words = gemm_words(data, qtype, cols)
    assert words is not None, (QType(qtype).name, data.shape, data.stride())
    return gguf_gemm(x, words, qtype, cols, **launch)


def gguf_dequantize(data: torch.Tensor, qtype: QType, cols: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The GGUF weight `data [N, bytes per row]` (uint8, rows of blocks as stored) decoded
    to `[N, cols]` in `dtype`: in float32 exactly gguf's `dequantize`. ValueError for a
    type without a kernel."""
    groups, width, unit_bytes = _check_blocks(data, qtype, cols)
    n = data.shape[0]
    w = torch.empty((n, cols), dtype=dtype, device=data.device)
    if n == 0 or cols == 0:
        return w
    block_n = 32
    grid = (triton.cdiv(n, block_n), triton.cdiv(cols, UNIT))
    _gguf_dequantize_kernel[grid](
        data, w, n, cols, data.stride(0), w.stride(0),
        QTYPE=int(qtype), S=groups, L=width, UNIT_BYTES=unit_bytes, BLOCK_N=block_n,
        num_warps=4, enable_fp_fusion=False,  # gguf's float32 rounding: no FMA
    )
    return w
