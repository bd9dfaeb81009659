"""Q4_K at one row of `x` with x rounded to int8 (decode at batch 1), as llama.cpp multiplies
its 4-bit blocks on a GPU: x is rounded per 32 values (a Q4_K sub-block) to int8 with one
float scale, `amax / 127` (`quantize_x`), so that a 32-bit word of weights (8 nibbles) meets
its 8 values of x in two `dp4a` instructions (four byte products summed into an int32
each). gguf_gemv.py's exact path makes every weight a float and multiplies it by a float x:
~3 instructions a weight (4.5 bits), where a memory-bound GEMV can afford about one.

The price is x's rounding: each value moves by at most half its block's step, so an output
moves by at most `sum_i |w_i| * step_i / 2` (the tests hold the kernel to that bound); the
min term of Q4_K (`dmin * m * sum x`) uses the exact sums. Behind
`EngineConfig.gguf_int8_activations`.

Words as in gguf_gemv.py (`data.view(int32)`, 36 a super-block of 256 weights): word 0 the
scales `d` (low half) and `dmin`, words 1-3 the 6-bit sub-block scales and mins, words
4 + 8c + j (chunk c < 4, j < 8) weights 64c + 4j.. in their low nibbles (sub-block 2c) and
64c + 32 + 4j.. in their high ones (sub-block 2c + 1): x's int8 words 16c + j and
16c + 8 + j of the super-block.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from infer.kernels import launch_counters
from infer.kernels.gguf_gemv import MAX_BLOCKS, _f16_hi, _f16_lo, _q4_k_scales, _store_rows, _word

SUPER_K, SUPER_WORDS, SUB_K = 256, 36, 32
_HIGH_NIBBLES = tl.constexpr(-0x0F0F0F10)  # 0xF0F0F0F0 as an int32


@triton.jit
def _dp4a(a, b, acc, PTX: tl.constexpr):
    """`acc + sum_i byte_i(a) * byte_i(b)`, a's bytes unsigned, b's signed. With PTX (a GPU;
    the interpreter has no inline assembly) one instruction."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm="dp4a.u32.s32 $0, $1, $2, $3;", constraints="=r,r,r,r", args=[a, b, acc],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        acc += (a & 0xFF) * ((b << 24) >> 24)
        acc += ((a >> 8) & 0xFF) * ((b << 16) >> 24)
        acc += ((a >> 16) & 0xFF) * ((b << 8) >> 24)
        return acc + ((a >> 24) & 0xFF) * (b >> 24)


@triton.jit
def _runs_of_4(v):
    return tl.max_contiguous(tl.multiple_of(v, [1, 1, 4]), [1, 1, 4])


@triton.jit
def _q4k_int8x_kernel(words, xq, dx, xsum, y_ptr, part_ptr, counts, N, units, stride_w,
                      splits, per_split, BLOCK_N: tl.constexpr, UNITS: tl.constexpr,
                      EVEN: tl.constexpr, PTX: tl.constexpr):
    """Program (n, s) owns rows `n * BLOCK_N..` and super-blocks `s * per_split..` of K,
    UNITS a step: `[BLOCK_N, UNITS * 4 chunks, 4]` words of nibbles (a chunk's 8 words as
    two runs of 4, 16-byte loads) against `[1, UNITS * 4, 4]` of int8 x, shared by the rows
    a thread holds. K split over `splits` programs: gguf_gemv._store_rows."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None]
    g = tl.arange(0, UNITS * 4)[None, :, None]
    c = g % 4  # the chunk in its super-block
    j = tl.arange(0, 4)[None, None, :]
    stride_w = tl.multiple_of(stride_w, 4)  # 144-byte super-blocks: 16-byte aligned rows
    row = words + tl.minimum(rn, N - 1).to(tl.int64) * stride_w  # rows past N: the last
    acc = tl.zeros((BLOCK_N, UNITS * 4, 1), dtype=tl.float32)
    u_end = tl.minimum(pid_s * per_split + per_split, units)
    for u0 in range(pid_s * per_split, u_end, UNITS):
        u = u0 + g // 4
        if EVEN:
            ok = True
        else:  # past the split's last super-block: that one again, its scale taken as 0
            ok = u < u_end
            u = tl.minimum(u, u_end - 1)
        p = row + u * 36
        wa = tl.load(p + _runs_of_4(4 + c * 8 + j))
        wb = tl.load(p + _runs_of_4(8 + c * 8 + j))
        x = xq + u * 64 + c * 16
        lo = _dp4a(wa & 0x0F0F0F0F, tl.load(x + _runs_of_4(j)), 0, PTX)
        lo = _dp4a(wb & 0x0F0F0F0F, tl.load(x + _runs_of_4(4 + j)), lo, PTX)
        # the high nibbles where they lie (16 times their value): no shift
        hi = _dp4a(wa & _HIGH_NIBBLES, tl.load(x + _runs_of_4(8 + j)), 0, PTX)
        hi = _dp4a(wb & _HIGH_NIBBLES, tl.load(x + _runs_of_4(12 + j)), hi, PTX)
        lo = tl.sum(lo, axis=2, keep_dims=True).to(tl.float32)
        hi = tl.sum(hi, axis=2, keep_dims=True).to(tl.float32)
        head = _word(p) if EVEN else tl.load(p, mask=ok, other=0).to(tl.uint32, bitcast=True)
        sc, mn = _q4_k_scales(_word(p + 1), _word(p + 2), _word(p + 3), c)
        sub = u * 8 + c * 2  # sub-blocks 2c and 2c + 1 of the super-block
        scaled = ((sc & 0x3F).to(tl.float32) * tl.load(dx + sub)) * lo
        scaled += (((sc >> 8) & 0x3F).to(tl.float32) * (tl.load(dx + sub + 1) * 0.0625)) * hi
        mins = ((mn & 0x3F).to(tl.float32) * tl.load(xsum + sub)
                + ((mn >> 8) & 0x3F).to(tl.float32) * tl.load(xsum + sub + 1))
        acc += _f16_lo(head) * scaled - _f16_hi(head) * mins
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    _store_rows(y, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), y_ptr, part_ptr, counts, pid_n,
                pid_s, N, splits)


@triton.jit
def _quantize_x_kernel(x_ptr, xq_ptr, dx_ptr, xsum_ptr, blocks, BLOCKS: tl.constexpr):
    """Blocks of 32 values of x: int8 `round(x / step)` (half away from zero), the step
    `amax / 127` (0 for a block of zeros), and the block's exact sum."""
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    at = b * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + at, mask=b < blocks, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1, keep_dims=True)
    inverse = tl.where(amax > 0, 127.0 / amax, 0.0)
    q = (x * inverse + tl.where(x < 0, -0.5, 0.5)).to(tl.int32)
    q = tl.minimum(tl.maximum(q, -127), 127)
    tl.store(xq_ptr + at, q.to(tl.int8), mask=b < blocks)
    tl.store(dx_ptr + b, amax / 127.0, mask=b < blocks)
    tl.store(xsum_ptr + b, tl.sum(x, axis=1, keep_dims=True), mask=b < blocks)


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x [1, K]` (K a multiple of 32) as `(int8 [K], step [K / 32], sum [K / 32])`, the
    steps and sums float32."""
    k = x.shape[-1]
    assert k % SUB_K == 0 and x.stride(-1) == 1, (x.shape, x.stride())
    blocks = k // SUB_K
    xq = torch.empty(k, dtype=torch.int8, device=x.device)
    dx = torch.empty(blocks, dtype=torch.float32, device=x.device)
    xsum = torch.empty(blocks, dtype=torch.float32, device=x.device)
    per_program = 32
    _quantize_x_kernel[(triton.cdiv(blocks, per_program),)](
        x, xq, dx, xsum, blocks, BLOCKS=per_program, num_warps=4)
    return xq, dx, xsum


def launch(rows: int, cols: int, device: torch.device) -> dict:
    """The launch for `rows x cols` weights, not measured yet (docs/performance.md): 64
    rows a program (a thread's x words shared by several rows), two super-blocks a step, K
    split while that keeps two programs a multiprocessor or fewer, up to 8 splits."""
    from infer.kernels.gguf_gemv import multiprocessors

    block_n, units = 64, 2
    programs, steps = triton.cdiv(rows, block_n), cols // SUPER_K // units
    split = 1
    while split < 8 and 2 * split <= steps and 2 * split * programs <= 2 * multiprocessors(
            device):
        split *= 2
    return dict(block_n=block_n, units=units, split=split, num_warps=4)


def q4k_gemv_int8x(x: torch.Tensor, words: torch.Tensor, cols: int, *, block_n: int = 32,
                   units: int = 2, split: int = 1, num_warps: int = 4,
                   quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                   ) -> torch.Tensor:
    """`x [1, cols]` times the transpose of the Q4_K weight `words [N, cols / 256 * 36]`
    (gguf_gemv.gemv_words), x rounded to int8 per 32 values (`quantized`: quantize_x(x),
    made here if not given), `units` (a power of 2) super-blocks a step, K split over
    `split` programs a row block: `[1, N]` in x's dtype."""
    assert cols % SUPER_K == 0 and words.shape[1] == cols // SUPER_K * SUPER_WORDS, (
        cols, words.shape)
    n = words.shape[0]
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    supers = cols // SUPER_K
    per_split = triton.cdiv(triton.cdiv(supers, max(1, split)), units) * units
    split = triton.cdiv(supers, per_split)
    row_blocks = triton.cdiv(n, block_n)
    part = torch.empty((split, n), dtype=torch.float32, device=x.device) if split > 1 else y
    counts = launch_counters("gguf_q4k_int8x", x.device, MAX_BLOCKS, row_blocks * (split > 1))
    xq, dx, xsum = quantized if quantized is not None else quantize_x(x)
    ptx = x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    _q4k_int8x_kernel[(row_blocks, split)](
        words, xq.view(torch.int32), dx, xsum, y, part, counts, n, supers, words.stride(0),
        split, per_split, BLOCK_N=block_n, UNITS=units, EVEN=supers % units == 0, PTX=ptx,
        num_warps=num_warps)
    return y
