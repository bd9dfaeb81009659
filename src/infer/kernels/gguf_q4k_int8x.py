"""Q4_K at one row of `x` with x rounded to int8 (decode at batch 1), as llama.cpp multiplies
its 4-bit blocks on a GPU: x is rounded per 32 values (a Q4_K sub-block) to int8 with one
float scale, `amax / 127` (`int8_rows.quantize_x`), so that a 32-bit word of weights (8
nibbles) meets its 8 values of x in two `dp4a` instructions (four byte products summed into
an int32 each). gguf_gemv.py's exact path makes every weight a float and multiplies it by a float x:
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

What bounds it on an H200 is the L1's throughput, not the instructions or DRAM (Nsight
Compute, docs/performance.md): 8 threads share a super-block's 128 bytes of nibbles, so
that a warp's 16-byte loads cover whole runs, and a super-block's header and a chunk's
steps and sums of x each come in one 16-byte load. The tile is `[units, rows, 32 words]`,
flat along the words: with `[.., 8, 4]` Triton 3.6 gave each thread a whole super-block
(32 rows a warp load, every thread its own L1 request) where 3.9 spread it as meant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch, gpu_compiled, launch_counters
from infer.kernels.gguf_gemv import MAX_BLOCKS, _f16_hi, _f16_lo, _q4_k_scales, _store_rows
from infer.kernels.int8_rows import quantize_x

SUPER_K, SUPER_WORDS = 256, 36
_HIGH_NIBBLES = tl.constexpr(-0x0F0F0F10)  # 0xF0F0F0F0 as an int32


@triton.jit
def _dp4a(a, b, acc, PTX: tl.constexpr, SIGNED: tl.constexpr = False):
    """`acc + sum_i byte_i(a) * byte_i(b)`, b's bytes signed, a's unsigned (or SIGNED).
    With PTX (a GPU; the interpreter has no inline assembly) one instruction."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm="dp4a.s32.s32 $0, $1, $2, $3;" if SIGNED else "dp4a.u32.s32 $0, $1, $2, $3;",
            constraints="=r,r,r,r", args=[a, b, acc], dtype=tl.int32, is_pure=True, pack=1)
    else:
        for k in tl.static_range(4):
            byte = ((a << (24 - 8 * k)) >> 24) if SIGNED else ((a >> (8 * k)) & 0xFF)
            acc += byte * ((b << (24 - 8 * k)) >> 24)
        return acc


@triton.jit
def _step_units(u0, ui, u_end, EVEN: tl.constexpr):
    """A step's super-blocks `u0 + ui` and whether each is one of the split's: past its
    last (unless EVEN), that last one again, to be taken as 0."""
    u = u0 + ui
    ok = u < u_end  # with EVEN always, and left unused
    if not EVEN:
        u = tl.minimum(u, u_end - 1)
    return u, ok


@triton.jit
def _four(p, PTX: tl.constexpr):
    """The four 32-bit values at `p` (16-byte aligned), of p's type: on a GPU one 16-byte
    load."""
    if PTX:
        ty = p.dtype.element_ty
        return tl.inline_asm_elementwise(
            asm="ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", constraints="=r,=r,=r,=r,l",
            args=[p.to(tl.int64, bitcast=True)], dtype=(ty, ty, ty, ty), is_pure=True,
            pack=1)
    return tl.load(p), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3)


@triton.jit
def _header(p, ok, EVEN: tl.constexpr, PTX: tl.constexpr):
    """A super-block's words 0-3 (`d | dmin`, the packed scales), `d | dmin` 0 where not
    `ok`: on a GPU one 16-byte load (the 8 threads of a super-block ask the same address)."""
    head, s0, s1, s2 = _four(p, PTX)
    head = head.to(tl.uint32, bitcast=True)
    if not EVEN:
        head = tl.where(ok, head, 0)
    return (head, s0.to(tl.uint32, bitcast=True), s1.to(tl.uint32, bitcast=True),
            s2.to(tl.uint32, bitcast=True))


@triton.jit
def _q4k_int8x_kernel(words, xq, side, y_ptr, part_ptr, counts, N, units, stride_w, splits,
                      per_split, BLOCK_N: tl.constexpr, UNITS: tl.constexpr,
                      EVEN: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr):
    """Program (n, s) owns rows `n * BLOCK_N..` and super-blocks `s * per_split..` of K,
    UNITS a step: `[UNITS, BLOCK_N, 32]` words of nibbles, a thread 4 of them (half a
    chunk) and their 8 words of x; a chunk's two halves each add half its min term. Scales
    apply to `[UNITS, BLOCK_N, 8]` sums (a size-1 dimension would take a layout of its own,
    converted through shared memory every step). K split over `splits` programs:
    gguf_gemv._store_rows."""
    dependent_launch.wait(PDL)  # x's rounding, and the split counters, of the kernels before
    dependent_launch.release(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    ui = tl.arange(0, UNITS)[:, None, None]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None]
    wd = tl.arange(0, 32)[None, None, :]  # a word of nibbles: chunk wd // 8
    # its x words: 16c + wd % 8 (low nibbles), 8 further (high ones)
    xw = tl.max_contiguous(tl.multiple_of(wd + wd // 8 * 8, [1, 1, 8]), [1, 1, 8])
    c = tl.arange(0, 8)[None, None, :] // 2  # the chunk of a half chunk
    stride_w = tl.multiple_of(stride_w, 4)  # 144-byte super-blocks: 16-byte aligned rows
    row = words + tl.minimum(rn, N - 1).to(tl.int64) * stride_w  # rows past N: the last
    acc = tl.zeros((UNITS, BLOCK_N, 8), dtype=tl.float32)
    u_end = tl.minimum(pid_s * per_split + per_split, units)
    for u0 in range(pid_s * per_split, u_end, UNITS):
        u, ok = _step_units(u0, ui, u_end, EVEN)  # the scale 0 where not ok
        p = row + u * 36
        w = tl.load(p + 4 + wd)
        x = xq + u * 64 + xw
        lo = _dp4a(w & 0x0F0F0F0F, tl.load(x), 0, PTX)
        hi = _dp4a(w & _HIGH_NIBBLES, tl.load(x + 8), 0, PTX)
        lo = tl.sum(tl.reshape(lo, (UNITS, BLOCK_N, 8, 4)), axis=3)  # by half chunk
        hi = tl.sum(tl.reshape(hi, (UNITS, BLOCK_N, 8, 4)), axis=3)
        head, s0, s1, s2 = _header(p, ok, EVEN, PTX)
        sc, mn = _q4_k_scales(s0, s1, s2, c)
        sub = u * 8 + c * 2  # sub-blocks 2c and 2c + 1 of the super-block
        dx0, dx1, sum0, sum1 = _four(side + sub * 2, PTX)  # x's of sub-blocks 2c, 2c + 1
        scaled = ((sc & 0x3F).to(tl.float32) * dx0) * lo.to(tl.float32)
        scaled += (((sc >> 8) & 0x3F).to(tl.float32) * (dx1 * 0.0625)) * hi.to(tl.float32)
        mins = (mn & 0x3F).to(tl.float32) * sum0 + ((mn >> 8) & 0x3F).to(tl.float32) * sum1
        acc += _f16_lo(head) * scaled - (0.5 * _f16_hi(head)) * mins
    y = tl.sum(tl.sum(acc, axis=2), axis=0)
    _store_rows(y, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), y_ptr, part_ptr, counts, pid_n,
                pid_s, N, splits)


def launch(rows: int, cols: int, device: torch.device) -> dict:
    """The launch for `rows x cols` weights: 64 rows a program, two super-blocks a step, K
    split as `split_launch` splits it. On an H200 (`quantized_gemv.py --int8x-sweep`, 8B
    shapes, 40 launches) a layer's four projections take 56.4 µs this way, 54.1 with each
    shape's fastest."""
    return split_launch(rows, cols, device, block_n=64, units=2)


def split_launch(rows: int, cols: int, device: torch.device, *, block_n: int,
                 units: int, unit_k: int = SUPER_K) -> dict:
    """`block_n` rows a program, `units` units (super-blocks; of `unit_k` weights) a step,
    K split in two while that keeps the programs within four a multiprocessor (up to 8
    splits)."""
    from infer.kernels.gguf_gemv import multiprocessors

    programs, steps = triton.cdiv(rows, block_n), cols // unit_k // units
    split = 1
    while split < 8 and 2 * split <= steps and 2 * split * programs <= 4 * multiprocessors(
            device):
        split *= 2
    return dict(block_n=block_n, units=units, split=split, num_warps=4)


def q4k_gemv_int8x(x: torch.Tensor, words: torch.Tensor, cols: int, *, block_n: int = 32,
                   units: int = 2, split: int = 1, num_warps: int = 4,
                   quantized: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> torch.Tensor:
    """`x [1, cols]` times the transpose of the Q4_K weight `words [N, cols / 256 * 36]`
    (gguf_gemv.gemv_words), x rounded to int8 per 32 values (`quantized`: quantize_x(x),
    made here if not given), `units` (a power of 2) super-blocks a step, K split over
    `split` programs a row block: `[1, N]` in x's dtype."""
    assert cols % SUPER_K == 0 and words.shape[1] == cols // SUPER_K * SUPER_WORDS, (
        cols, words.shape)
    return run_int8x(_q4k_int8x_kernel, x, words, cols, block_n=block_n, units=units,
                     split=split, num_warps=num_warps, quantized=quantized)


def run_int8x(kernel, x: torch.Tensor, words: torch.Tensor, cols: int, *, block_n: int,
              units: int, split: int, num_warps: int,
              quantized: tuple[torch.Tensor, torch.Tensor] | None,
              unit_k: int = SUPER_K) -> torch.Tensor:
    """Launch an int8-x kernel of this module's signature (the Q4_K one, gguf_q6k_int8x's,
    gguf_q8_0_int8x's; its unit of K `unit_k` weights): x rounded here unless
    `quantized`, K split over `split` programs a row block (their counters per kernel in
    `launch_counters`)."""
    n = words.shape[0]
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    supers = cols // unit_k
    per_split = triton.cdiv(triton.cdiv(supers, max(1, split)), units) * units
    split = triton.cdiv(supers, per_split)
    row_blocks = triton.cdiv(n, block_n)
    part = torch.empty((split, n), dtype=torch.float32, device=x.device) if split > 1 else y
    counts = launch_counters(kernel.fn.__name__, x.device, MAX_BLOCKS,
                             row_blocks * (split > 1))
    xq, side = quantized if quantized is not None else quantize_x(x)
    ptx = gpu_compiled(x.device)
    kernel[(row_blocks, split)](
        words, xq.view(torch.int32), side, y, part, counts, n, supers, words.stride(0),
        split, per_split, BLOCK_N=block_n, UNITS=units, EVEN=supers % units == 0, PTX=ptx,
        num_warps=num_warps, **dependent_launch.launch_options())
    return y
