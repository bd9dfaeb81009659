"""One row (or two) times a weight (16-bit, or 8-bit scaled per channel):
`y [M, N] = x [M, K] @ w [N, K]^T`, float32 accumulation, M 1 or 2.

Batch-1 decode multiplies one row by every projection; the weight's bytes bound the time,
and on small projections cuBLAS splits K over programs and then adds the parts in a
second kernel. Here each program owns BLOCK_N output channels and walks all of K,
multiplying in registers and reducing once at the end: one launch. (Splitting K over
programs, the last of a row block adding the parts, was tried: on an H200 it was the
fastest launch for none of the 1B, 8B and 8B-at-TP=2 projections, `gemv_sweep_h200.json`.)

`gemv_gate_up` multiplies a gated MLP's `[gate | up]` weight and stores `act(gate) * up`
("silu" / "gelu_tanh"), without the activation's own launch: each program multiplies the
gate and up rows of the same channels, so no program repeats another's work. (The
activation in the down projection's GEMV instead, each program working it out for the
whole row, lost on an H200, as did the RMSNorm in the GEMV after it: docs/performance.md.)

With `scale` the weight is 8-bit (int8, or FP8 e4m3 on a GPU) standing for
`w * scale[:, None]`, a scale per output channel: each weight is made float32 in registers
(`weight_cast.py`) and each channel's sum scaled once, at the end. `set_form`
(`EngineConfig.gemv_form`) picks how x reaches the tile: through shared memory (Triton's
choice), or bfloat16 x read as words straight into it (`_word_rows`), 16-bit weights as
words too, int8 ones as units there if asked.

Two rows (MAX_ROWS) go the same way, each weight made float32 once for both. On an H200 the
second row adds 50-90 % to a one-row launch of 8-bit weights (its multiply-adds on the CUDA
cores), which beats the tensor-core kernels on narrow layers only: the engine sends two
rows here where `w8a16_matmul.gemv_takes` (`EngineConfig.gemv_8bit_max_rows`). Inside
`row_skip.first_row_skipped_where(flag)` a two-row launch multiplies the second row alone
(at the one-row cost) where the kernel finds the flag set; `gemv_gate_up_rows_apart`
launches two rows one at a time, the first launch doing nothing where the flag is set.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch, gpu_compiled, row_skip
from infer.kernels.activation import gated
from infer.kernels.weight_cast import (
    F16_FP8_UNDO,
    FP8_TIMES_UNDO,
    to_f16_times,
    to_float_times,
    to_unit,
)

MAX_ROWS = 2
# the form "halves": x's factor, the float16 sums' factor back, and the steps a run
HALVES_X = tl.constexpr(2.0 ** -8)
HALVES_UNDO = tl.constexpr(2.0 ** 8)
HALVES_RUN = tl.constexpr(8)


class Launch(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int


@triton.jit
def _weights(w_rows, kk, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_rows + kk[None, :], eviction_policy="evict_first")
    return tl.load(w_rows + kk[None, :], mask=kk[None, :] < K, other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _row(x_ptr, kk, K, EVEN_K: tl.constexpr):
    """x's columns kk."""
    if EVEN_K:
        return tl.load(x_ptr + kk)
    return tl.load(x_ptr + kk, mask=kk < K, other=0.0)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, skip_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, EVEN_K: tl.constexpr,
    GATE_UP: tl.constexpr, SCALED: tl.constexpr, SKIPS: tl.constexpr,
    SKIPPED_WHOLE: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr,
    FORM: tl.constexpr = "floats", FP8_BITS: tl.constexpr = False,
):
    if SKIPPED_WHOLE:  # noqa: SIM102 (a constexpr branch: the runtime test is not compiled in)
        if tl.load(skip_ptr) != 0:  # one row, left out: the launch does nothing
            # The kernel after this one waits for this one's end alone: program 0 waits
            # for the kernel before, so that this one ends after it.
            dependent_launch.release(PDL)
            if tl.program_id(0) == 0:
                dependent_launch.wait(PDL)
            return
    rn, wn = channels(N, BLOCK_N, GATE_UP)
    rk = tl.arange(0, BLOCK_K)
    # Rows past N read row N - 1 (no mask on the weight's loads) and are not stored.
    w_rows = w_ptr + wn.to(tl.int64)[:, None] * stride_wn
    # The first weight tile is read before the kernel before this one has finished
    # (dependent_launch.py), and the skip flag, written before the graph holding this
    # launch started (row_skip.py); x only after.
    if FORM != "floats" and not SCALED:  # 16-bit weights as words too
        w = _weights(w_rows.to(tl.pointer_type(tl.int32), bitcast=True),
                     tl.arange(0, BLOCK_K // 2), K // 2, EVEN_K)
    else:
        w = _weights(w_rows, rk, K, EVEN_K)
    if SKIPS:
        skip = tl.load(skip_ptr)
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    if SKIPS:  # two rows, the first left out where the flag is set
        if skip != 0:
            _rows(w, w_rows, rk, x_ptr + stride_xm, s_ptr, y_ptr + stride_ym, rn, wn, N, K,
                  stride_xm, stride_ym, BLOCK_K, 1, EVEN_K, GATE_UP, SCALED, PTX, FORM,
                  FP8_BITS)
        else:
            _rows(w, w_rows, rk, x_ptr, s_ptr, y_ptr, rn, wn, N, K, stride_xm, stride_ym,
                  BLOCK_K, 2, EVEN_K, GATE_UP, SCALED, PTX, FORM, FP8_BITS)
    else:
        _rows(w, w_rows, rk, x_ptr, s_ptr, y_ptr, rn, wn, N, K, stride_xm, stride_ym,
              BLOCK_K, ROWS, EVEN_K, GATE_UP, SCALED, PTX, FORM, FP8_BITS)


@triton.jit
def channels(N, BLOCK_N: tl.constexpr, GATE_UP: tl.constexpr):
    """(the output channels the program stores, the weight rows its tile reads): BLOCK_N
    of each; with GATE_UP (weight rows 2N) tile row 2c is gate channel c's and 2c + 1 up
    channel c's, BLOCK_N / 2 channels stored. Rows past N read row N - 1."""
    r = tl.arange(0, BLOCK_N)
    if GATE_UP == "":
        rn = tl.program_id(0) * BLOCK_N + r
        wn = tl.minimum(rn, N - 1)
    else:
        rn = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        wn = tl.minimum(tl.program_id(0) * (BLOCK_N // 2) + r // 2, N - 1) + (r % 2) * N
    return rn, wn


@triton.jit
def _rows(w, w_rows, rk, x_ptr, s_ptr, y_ptr, rn, wn, N, K, stride_xm, stride_ym,
          BLOCK_K: tl.constexpr, ROWS: tl.constexpr, EVEN_K: tl.constexpr,
          GATE_UP: tl.constexpr, SCALED: tl.constexpr, PTX: tl.constexpr,
          FORM: tl.constexpr, FP8_BITS: tl.constexpr):
    """The program's channels of x's first ROWS rows, from the first weight tile `w`, in
    the form FORM (`form_of`); FP8 weights made floats by their bits with FP8_BITS (set
    only for FP8 weights on a GPU: `set_fp8_bits`)."""
    if FORM == "floats":
        _float_rows(w, w_rows, rk, x_ptr, s_ptr, y_ptr, rn, wn, N, K, stride_xm, stride_ym,
                    BLOCK_K, ROWS, EVEN_K, GATE_UP, SCALED, PTX, FP8_BITS)
    elif FORM == "halves":
        _half_rows(w, w_rows, rk, x_ptr, s_ptr, y_ptr, rn, wn, N, K, BLOCK_K, EVEN_K,
                   GATE_UP, FP8_BITS)
    else:
        _word_rows(w, w_rows, rk, x_ptr, s_ptr, y_ptr, rn, wn, N, K, stride_xm, stride_ym,
                   BLOCK_K, ROWS, EVEN_K, GATE_UP, SCALED, PTX, FORM == "units", FP8_BITS)


@triton.jit
def _float_rows(w, w_rows, rk, x_ptr, s_ptr, y_ptr, rn, wn, N, K, stride_xm, stride_ym,
                BLOCK_K: tl.constexpr, ROWS: tl.constexpr, EVEN_K: tl.constexpr,
                GATE_UP: tl.constexpr, SCALED: tl.constexpr, PTX: tl.constexpr,
                FP8_BITS: tl.constexpr):
    """`_rows` in the form "floats": x through shared memory into the tile's layout (Triton's
    choice for a vector broadcast over the tile's rows), each weight made float32."""
    # A second row shares each weight made float32 (two accumulators of the one-row
    # layout: a third dimension for the rows made the kernel 2-3x slower on an H200).
    w = to_float_times(w, PTX, FP8_BITS)
    acc = w * _row(x_ptr, rk, K, EVEN_K).to(tl.float32)[None, :]
    if ROWS == 2:
        acc_2 = w * _row(x_ptr + stride_xm, rk, K, EVEN_K).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + rk
        w = to_float_times(_weights(w_rows, kk, K, EVEN_K), PTX, FP8_BITS)
        acc += w * _row(x_ptr, kk, K, EVEN_K).to(tl.float32)[None, :]
        if ROWS == 2:
            acc_2 += w * _row(x_ptr + stride_xm, kk, K, EVEN_K).to(tl.float32)[None, :]
    store_sums(acc, s_ptr, y_ptr, rn, wn, N, SCALED, GATE_UP, FP8_BITS)
    if ROWS == 2:
        store_sums(acc_2, s_ptr, y_ptr + stride_ym, rn, wn, N, SCALED, GATE_UP,
                   FP8_BITS)


@triton.jit
def _half_x(x_ptr, kk, K, EVEN_K: tl.constexpr, FP8_BITS: tl.constexpr):
    """x's columns kk as float16: times 2^-8, or with FP8_BITS as they are (the weights
    carry the 2^-8: `_half_weights`)."""
    if FP8_BITS:
        return _row(x_ptr, kk, K, EVEN_K).to(tl.float32).to(tl.float16)
    return (_row(x_ptr, kk, K, EVEN_K).to(tl.float32) * HALVES_X).to(tl.float16)


@triton.jit
def _half_weights(w, FP8_BITS: tl.constexpr):
    """FP8 weights as float16: by the hardware's convert, or with FP8_BITS times 2^-8 by
    their bits (`weight_cast.to_f16_times`, no convert)."""
    tl.static_assert(not FP8_BITS or HALVES_UNDO == F16_FP8_UNDO)
    if FP8_BITS:
        return to_f16_times(w)
    return w.to(tl.float16)


@triton.jit
def _half_run(part, w_rows, x_ptr, rk, k_begin, k_end, K, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, FP8_BITS: tl.constexpr):
    """`part` plus the float16 products of columns `[k_begin, k_end)`, BLOCK_K a step."""
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + rk
        part += _half_weights(_weights(w_rows, kk, K, EVEN_K), FP8_BITS) \
            * _half_x(x_ptr, kk, K, EVEN_K, FP8_BITS)[None, :]
    return part


@triton.jit
def _half_rows(w, w_rows, rk, x_ptr, s_ptr, y_ptr, rn, wn, N, K, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, GATE_UP: tl.constexpr, FP8_BITS: tl.constexpr):
    """`_rows` in the form "halves" (FP8 weights, one row, a GPU): each weight made float16
    by the hardware's convert (two weights an instruction) and multiplied by x times 2^-8
    in float16 (two multiply-adds an instruction) into float16 sums, which every
    HALVES_RUN steps are added into float32 ones times 2^8. With FP8_BITS the weights are
    made float16 times 2^-8 by their bits instead (`weight_cast.to_f16_times`, three
    instructions a register of four, none on the convert pipe) and x is taken as it is:
    the same products. A product is at most 448 |x| 2^-8, so a run's sum overflows
    float16 only where |x| passes ~4,600; where a sum came out infinite or NaN the program
    redoes its channels in the form "floats". With the convert, slower than "floats" on an
    H100 (the 8B batch-1 step 3.97 ms against 3.13): its converts, a quarter of its loop,
    issue at 16 values a cycle per SM."""
    run = HALVES_RUN * BLOCK_K
    part = _half_run(_half_weights(w, FP8_BITS) * _half_x(x_ptr, rk, K, EVEN_K,
                                                          FP8_BITS)[None, :],
                     w_rows, x_ptr, rk, BLOCK_K, tl.minimum(run, K), K, BLOCK_K, EVEN_K,
                     FP8_BITS)
    acc = part.to(tl.float32) * HALVES_UNDO
    for r0 in range(run, K, run):
        part = _half_run(tl.zeros(w.shape, tl.float16), w_rows, x_ptr, rk, r0,
                         tl.minimum(r0 + run, K), K, BLOCK_K, EVEN_K, FP8_BITS)
        acc += part.to(tl.float32) * HALVES_UNDO
    if tl.max(((acc != acc) | (tl.abs(acc) == float("inf"))).to(tl.int32)) != 0:
        # a run overflowed: the form "floats" (one row, the hardware's exact convert)
        _float_rows(_weights(w_rows, rk, K, EVEN_K), w_rows, rk, x_ptr, s_ptr, y_ptr, rn, wn,
                    N, K, 0, 0, BLOCK_K, 1, EVEN_K, GATE_UP, True, True, False)
    else:
        store_sums(acc, s_ptr, y_ptr, rn, wn, N, True, GATE_UP)


@triton.jit
def _word_rows(w, w_rows, rk, x_ptr, s_ptr, y_ptr, rn, wn, N, K, stride_xm, stride_ym,
               BLOCK_K: tl.constexpr, ROWS: tl.constexpr, EVEN_K: tl.constexpr,
               GATE_UP: tl.constexpr, SCALED: tl.constexpr, PTX: tl.constexpr,
               UNITS: tl.constexpr, FP8_BITS: tl.constexpr):
    """`_rows` in the forms "words" and "units" (`form_of`): x (bfloat16) read as 32-bit
    words straight into the tile's layout (no trip through shared memory), a word's two
    values apart by a shift and a mask, against the tile's even and odd columns (a
    bfloat16 weight's read as words too). With UNITS (int8) each weight q is the float
    `v = 1 + (q + 128) / 2^15` (`weight_cast.to_unit`: one byte permute, no subtraction),
    and `sum(x q) = 2^15 (sum(x v) - sum(x)) - 128 sum(x)`, sum(x) taken once at the end."""
    rw = tl.arange(0, BLOCK_K // 2)
    w_even, w_odd = _columns_apart(w, PTX, UNITS, FP8_BITS)
    acc = _add_products(0.0, w_even, w_odd, x_ptr, rw, K, EVEN_K)
    if ROWS == 2:
        acc_2 = _add_products(0.0, w_even, w_odd, x_ptr + stride_xm, rw, K, EVEN_K)
    words_16 = w_rows.to(tl.pointer_type(tl.int32), bitcast=True)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        if w.dtype == tl.int32:
            w = _weights(words_16, k0 // 2 + rw, K // 2, EVEN_K)
        else:
            w = _weights(w_rows, k0 + rk, K, EVEN_K)
        w_even, w_odd = _columns_apart(w, PTX, UNITS, FP8_BITS)
        acc = _add_products(acc, w_even, w_odd, x_ptr + k0, rw, K - k0, EVEN_K)
        if ROWS == 2:
            acc_2 = _add_products(acc_2, w_even, w_odd, x_ptr + stride_xm + k0, rw, K - k0,
                                  EVEN_K)
    if UNITS:
        acc = _from_units(acc, x_ptr, rk, K, BLOCK_K, EVEN_K)
    store_sums(acc, s_ptr, y_ptr, rn, wn, N, SCALED, GATE_UP, FP8_BITS)
    if ROWS == 2:
        if UNITS:
            acc_2 = _from_units(acc_2, x_ptr + stride_xm, rk, K, BLOCK_K, EVEN_K)
        store_sums(acc_2, s_ptr, y_ptr + stride_ym, rn, wn, N, SCALED, GATE_UP,
                   FP8_BITS)


@triton.jit
def _columns_apart(w, PTX: tl.constexpr, UNITS: tl.constexpr, FP8_BITS: tl.constexpr):
    """The tile's weights as float32, even and odd columns: 8-bit ones (as units with
    UNITS), or bfloat16 ones read as words."""
    if w.dtype == tl.int32:
        even, odd = _word_halves(w)
    else:
        w = to_unit(w, PTX) if UNITS else to_float_times(w, PTX, FP8_BITS)
        even, odd = tl.split(tl.reshape(w, (w.shape[0], w.shape[1] // 2, 2)))
    return even, odd


@triton.jit
def _word_halves(words):
    """The two bfloat16 values of each 32-bit word as float32: the first (low half), the
    second."""
    return (words << 16).to(tl.float32, bitcast=True), (words & -65536).to(tl.float32,
                                                                             bitcast=True)


@triton.jit
def _add_products(acc, w_even, w_odd, x_ptr, rw, K, EVEN_K: tl.constexpr):
    """acc plus the weights times x (from x_ptr, K columns left), two multiply-adds a
    word."""
    words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rw
    if EVEN_K:
        words = tl.load(words)[None, :]
    else:  # K is even: a word is whole or past the end
        words = tl.load(words, mask=rw < K // 2, other=0)[None, :]
    x_even, x_odd = _word_halves(words)
    return acc + w_even * x_even + w_odd * x_odd


@triton.jit
def _from_units(acc, x_ptr, rk, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """`[BLOCK_N, 1]`: each channel's `sum(x q)` from its sums of x times units."""
    x_sum = _row(x_ptr, rk, K, EVEN_K).to(tl.float32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x_sum += _row(x_ptr, k0 + rk, K, EVEN_K).to(tl.float32)
    x_sum = tl.sum(x_sum)
    # Powers of two multiply exactly; the difference is of two near sums.
    return (tl.sum(acc, axis=1, keep_dims=True) - x_sum) * 32768.0 - x_sum * 128.0


@triton.jit
def store_sums(acc, s_ptr, y_ptr, rn, wn, N, SCALED: tl.constexpr, GATE_UP: tl.constexpr,
               FP8_TIMES: tl.constexpr = False):
    """A row's sums of `acc [BLOCK_N, BLOCK_K]` (weight rows wn), scaled per channel where
    SCALED (and by `FP8_TIMES_UNDO` first with FP8_TIMES: FP8 weights that
    `to_float_times` made floats on a GPU), rounded to y's dtype; with GATE_UP,
    `act(gate) * up` of each channel's pair (rounded as the activation kernel rounds what
    it reads and stores), stored at rn."""
    y = tl.sum(acc, axis=1)
    if FP8_TIMES:
        y *= FP8_TIMES_UNDO
    if SCALED:
        y *= tl.load(s_ptr + wn).to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty)
    if GATE_UP != "":
        gate, up = tl.split(tl.reshape(y, (y.shape[0] // 2, 2)))
        y = gated(gate, up, GATE_UP).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rn, y, mask=rn < N)


def default_launch(n: int, k: int, weight_bytes: int = 2, rows: int = 1,
                   int8: bool = False) -> Launch:
    """The launch for `rows` rows times an `[n, k]` weight of `weight_bytes`-byte
    elements (`int8`: INT8 ones), from `benchmarks/gemv_sweep.py` on an H200 over the 1B
    and 8B projections (and 8B-at-TP=2 for 16-bit weights). 16-bit
    (`gemv_sweep_h200.json`): the best single rule, within 1.14x of each shape's fastest
    launch, 1.7 % slower than those over all fifteen (cuBLAS: 8.5 %). 8-bit
    (`gemv_sweep_h200_s41_{int8,fp8}.json`): 16 channels a program on layers wide enough
    for 384 of them, 4 on narrower ones (more programs for the SMs); 0.5-0.7 % slower
    than each shape's fastest over all ten, within 1.17x of each. Two rows of 8-bit
    weights (the layers `w8a16_matmul.gemv_takes` sends here, narrow ones): shorter K
    steps, the one-row launch's 2048 costing the 1B qkv / o / down 7.4 / 5.6 / 11.1 µs
    against 5.6 / 4.7 / 11.0 for INT8 (`gemv_sweep_h200_s45b_gemv2_int8.json`), FP8
    7.0 / 5.2 / 10.7 against 5.2 / 4.3 / 10.1 (`..._s47_gemv2_fp8.json`).

    One row of INT8 on layers 4,096 to 6,143 wide (the 8B's o and down, which take this
    GEMV while the dp4a one takes the rest): 8 channels by 1024 of K where K is at most
    4096, else 4 by 1024, 4 warps; the fastest under dependent launch on an H100
    (`gemv_sweep_h100_80gb_hbm3_s61a_gemv_od.json`: o 7.75 -> 7.44 µs, down 21.70 ->
    21.51), and in the 8B step 2.94 / 2.95 ms against 2.99 / 2.98
    (`decode_h100_80gb_hbm3_s61e_*`). FP8 lost with it (3.20 against 3.17 ms) and keeps
    the 8-bit rule."""
    if weight_bytes == 1 and rows == 2:
        if n >= 3072:
            return Launch(block_n=4, block_k=512, num_warps=4)
        return Launch(block_n=4, block_k=1024, num_warps=8)
    if int8 and rows == 1 and 4096 <= n < 6144:
        return Launch(block_n=8 if k <= 4096 else 4, block_k=1024, num_warps=4)
    if weight_bytes == 1:
        if n >= 6144:
            return Launch(block_n=16, block_k=512, num_warps=8)
        return Launch(block_n=4, block_k=2048, num_warps=8)
    if n * k <= 1 << 24:  # 32 MB of 16-bit weights: longer steps, more warps in flight
        return Launch(block_n=8, block_k=1024, num_warps=8)
    return Launch(block_n=8, block_k=512, num_warps=4)


def gemv(x: torch.Tensor, weight: torch.Tensor, launch: Launch | None = None,
         scale: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K]` (1 to MAX_ROWS rows of float16 / bfloat16 / float32, unit column stride)
    times the transpose of `weight [N, K]` (unit column stride; x's dtype, or with `scale
    [N]` int8 / float8_e4m3fn): `[M, N]` in x's dtype."""
    assert weight.shape[1] == x.shape[1], (weight.shape, x.shape)
    return _launch(x, weight, launch, scale)


def gemv_gate_up(x: torch.Tensor, weight: torch.Tensor, act: str,
                 scale: torch.Tensor | None = None, launch: Launch | None = None
                 ) -> torch.Tensor:
    """`act(gate) * up` of `gemv(x, weight)` (`weight [2I, K]`, gate's rows then up's, as a
    gated MLP's fused gate_up projection stores them): `[M, I]`, in one launch. Each
    program owns `block_n / 2` channels of both halves (the launch is the whole weight's), so
    the activation's own launch goes and no program does another's work; bit for bit the
    GEMV's `[M, 2I]` then `kernels/activation.py`'s `gated_rows`."""
    assert act in ("silu", "gelu_tanh"), act
    assert weight.shape[0] % 2 == 0 and weight.shape[1] == x.shape[1], (weight.shape, x.shape)
    return _launch(x, weight, launch, scale, act)


def gemv_gate_up_rows_apart(x: torch.Tensor, weight: torch.Tensor, act: str,
                            scale: torch.Tensor | None = None) -> torch.Tensor:
    """`gemv_gate_up` of two rows as two one-row launches, inside
    `row_skip.first_row_skipped_where(flag)`: the first row's launch does nothing where
    the kernel finds the flag set (its output row unwritten). For layers too wide for the
    two-row launch, whose two rows otherwise go to the tensor cores and the activation's
    own launch (a draft round's first forward: `EngineConfig.gate_up_rows_apart`)."""
    flag = row_skip.skip_flag()
    assert flag is not None and x.dim() == 2 and x.shape[0] == 2, (flag, x.shape)
    y = torch.empty((2, weight.shape[0] // 2), dtype=x.dtype, device=x.device)
    _launch(x[:1], weight, None, scale, act, out=y[:1], skip_whole=flag)
    _launch(x[1:], weight, None, scale, act, out=y[1:])
    return y


def _launch(x: torch.Tensor, weight: torch.Tensor, launch: Launch | None,
            scale: torch.Tensor | None, gate_up: str = "", out: torch.Tensor | None = None,
            skip_whole: torch.Tensor | None = None) -> torch.Tensor:
    assert x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.stride(1) == 1, (x.shape,
                                                                                x.stride())
    assert weight.dim() == 2 and weight.stride(1) == 1, (weight.shape, weight.stride())
    if scale is None:
        assert weight.dtype == x.dtype, (weight.dtype, x.dtype)
    else:
        assert weight.dtype in (torch.int8, torch.float8_e4m3fn), weight.dtype
        assert scale.shape == weight.shape[:1] and scale.is_contiguous(), scale.shape
    m = x.shape[0]
    weight_rows, k = weight.shape
    block_n, block_k, num_warps = launch or default_launch(
        weight_rows, k, weight.element_size(), m, weight.dtype == torch.int8)
    n = weight_rows // 2 if gate_up else weight_rows
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (m, n) and y.stride(1) == 1 and y.dtype == x.dtype, (y.shape, n)
    if n == 0 or k == 0:
        return y.zero_()  # act(0) * 0 = 0 too
    channels = block_n // 2 if gate_up else block_n
    assert channels * (2 if gate_up else 1) == block_n, block_n
    skip = row_skip.skip_flag() if m == 2 else None
    assert skip_whole is None or m == 1, m
    flag = skip if skip_whole is None else skip_whole
    if flag is not None:
        assert flag.dtype == torch.int32 and flag.device == x.device, (flag.dtype, flag.device)
    ptx = gpu_compiled(x.device)
    _gemv_kernel[(triton.cdiv(n, channels),)](
        x, weight, weight if scale is None else scale, x if flag is None else flag, y, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, ROWS=m, EVEN_K=k % block_k == 0, GATE_UP=gate_up,
        SCALED=scale is not None, SKIPS=skip is not None,
        SKIPPED_WHOLE=skip_whole is not None, PTX=ptx,
        FORM="halves" if ptx and m == 1 and _fp8_halves and weight.dtype == torch.float8_e4m3fn
        else form_of(x, weight),
        FP8_BITS=ptx and _fp8_bits and weight.dtype == torch.float8_e4m3fn,
        num_warps=num_warps,
        **dependent_launch.launch_options(),
    )
    return y


_form = "floats"  # EngineConfig.gemv_form, set by the runner's set-up
_fp8_bits = True  # EngineConfig.fp8_weight_bits, set by the runner's set-up
_fp8_halves = False  # EngineConfig.fp8_gemv_halves, likewise


def set_fp8_halves(on: bool) -> None:
    """Whether one row of FP8 weights on a GPU takes the form "halves" from now on (float16
    products and runs of sums, `_half_rows`)."""
    global _fp8_halves
    _fp8_halves = on


def set_fp8_bits(on: bool) -> None:
    """Whether FP8 weights on a GPU become floats by their bits from now on
    (`weight_cast.to_float_times`) rather than by the hardware's convert."""
    global _fp8_bits
    _fp8_bits = on


def set_form(form: str) -> None:
    """The form the GEMV takes from now on where it can (`form_of`): one of
    `engine/config.py`'s GEMV_FORMS."""
    global _form
    _form = form


def form_of(x: torch.Tensor, weight: torch.Tensor) -> str:
    """The form `_rows` takes: "floats" (x through shared memory, each weight made float32:
    `weight_cast.to_float`), or with `set_form` "words" / "units" (`_word_rows`; units for
    int8 weights, words for others) where x is bfloat16 and x's rows and a 16-bit weight's
    are whole 32-bit words (an even K and row stride, from a 4-byte boundary)."""
    if _form == "floats" or x.dtype != torch.bfloat16 or not _whole_words(x):
        return "floats"
    if weight.element_size() == 2 and not _whole_words(weight):
        return "floats"
    return "units" if _form == "units" and weight.dtype == torch.int8 else "words"


def _whole_words(t: torch.Tensor) -> bool:
    """Whether the rows of a 2-D tensor of 16-bit values are whole 32-bit words."""
    return not (t.shape[1] % 2 or (t.shape[0] > 1 and t.stride(0) % 2) or t.data_ptr() % 4)
