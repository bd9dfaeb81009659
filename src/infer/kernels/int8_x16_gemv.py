"""One row of x times INT8 weights by `dp4a`, x carried as 16-bit fixed point in two int8
halves: `y [1, N] = x [1, K] @ (w [N, K] * scale[:, None])^T`.

The float GEMV (`gemv.py`) makes each int8 weight a float and multiplies it in float32:
~3.5-4.8 instructions a weight, so a byte of INT8 weight costs twice the instructions of
a byte of bfloat16 weight, and on an H100 the INT8 GEMVs of a batch-1 decode step read at
88 % of the bfloat16 ones' rate. Here x is first split as the int8 tensor-core kernel splits
it (`int8_x16.split_rows`: `x ~ s (256 hi + lo)`, one scale a row) and each 32-bit word of
four weights meets the matching words of hi and of lo in one `dp4a` each: two integer
instructions for four weights, no conversion. The int32 sums are exact
(`|w| <= 128, |hi| <= 127, |lo| <= 128`: below 2^31 for K up to 2^17); each output is
`s * scale_w * (256 sum(w hi) + sum(w lo))`, x's rounding (half a 16-bit step of its row's
range) the only error, the same as the tensor-core kernel's at two rows and more.

Each program owns BLOCK_N output channels and walks all of K (`gemv.py`'s shape of launch),
BLOCK_K weights (BLOCK_K / 4 words) of each row a step; with GATE_UP it multiplies the gate
and up rows of the same channels and stores `act(gate) * up` (`gemv.channels`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch, gpu_compiled
from infer.kernels.gemv import Launch, channels, store_sums
from infer.kernels.gemv import _weights as _words
from infer.kernels.gemv import default_launch as gemv_launch
from infer.kernels.gguf_q4k_int8x import _dp4a
from infer.kernels.int8_x16 import Halves, split_rows


@triton.jit
def _halves(q_ptr, cols, KW, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The words of x's high and low halves at the word columns `cols`, `[BLOCK_N,
    len(cols)]`: loaded in the weight tile's layout, each thread its own columns' words
    (the rows' repeats hit L1), where a vector broadcast over the rows went through shared
    memory on narrow tiles (sm_90, Triton 3.6: 1.26 instructions a weight instead of 0.92)."""
    at = q_ptr + cols[None, :] + tl.zeros((BLOCK_N, 1), dtype=tl.int32)
    if EVEN_K:
        return tl.load(at), tl.load(at + KW)
    mask = cols[None, :] + tl.zeros((BLOCK_N, 1), dtype=tl.int32) < KW
    return (tl.load(at, mask=mask, other=0), tl.load(at + KW, mask=mask, other=0))


@triton.jit
def _int8_x16_gemv_kernel(q_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, N, KW, stride_wn,
                          BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                          EVEN_K: tl.constexpr, GATE_UP: tl.constexpr, PTX: tl.constexpr,
                          PDL: tl.constexpr):
    rn, wn = channels(N, BLOCK_N, GATE_UP)
    rw = tl.arange(0, BLOCK_W)
    # Rows past N read row N - 1 (no mask on the weight's loads) and are not stored.
    w_rows = w_ptr + wn.to(tl.int64)[:, None] * stride_wn
    # The first weight tile is read before the kernel before this one has finished
    # (dependent_launch.py); x's halves only after.
    w = _words(w_rows, rw, KW, EVEN_K)
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    hi, lo = _halves(q_ptr, rw, KW, EVEN_K, BLOCK_N)
    acc_hi = _dp4a(w, hi, tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.int32), PTX, SIGNED=True)
    acc_lo = _dp4a(w, lo, tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.int32), PTX, SIGNED=True)
    for k0 in range(BLOCK_W, KW, BLOCK_W):
        w = _words(w_rows, k0 + rw, KW, EVEN_K)
        hi, lo = _halves(q_ptr, k0 + rw, KW, EVEN_K, BLOCK_N)
        acc_hi = _dp4a(w, hi, acc_hi, PTX, SIGNED=True)
        acc_lo = _dp4a(w, lo, acc_lo, PTX, SIGNED=True)
    sums = (tl.sum(acc_hi, axis=1).to(tl.float32) * 256.0
            + tl.sum(acc_lo, axis=1).to(tl.float32)) * tl.load(xs_ptr)
    store_sums(sums[:, None], ws_ptr, y_ptr, rn, wn, N, True, GATE_UP)


def default_launch(n: int, k: int) -> Launch:
    """The launch for an `[n, k]` weight (block_k in weights: a multiple of 4). Layers of
    4096 channels and more: 8 channels a program, 1024 weights of each a step, 4 warps, the
    best single launch over the 8B's projections on an H100 under dependent launch
    (`gemv_sweep_h100_80gb_hbm3_s59a_x16.json`: within 1.8 % of each shape's fastest of 18,
    0.9 us a layer faster than the 8-bit GEMV's rule). Narrower ones (not swept): that
    rule."""
    if n >= 4096:
        return Launch(block_n=8, block_k=1024, num_warps=4)
    return gemv_launch(n, k, weight_bytes=1)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `int8_x16_gemv` multiplies this one-row step: a contiguous int8 weight whose
    rows are whole 32-bit words, on a GPU or the interpreter alike."""
    return (x.dim() == 2 and x.shape[0] == 1 and weight.dtype == torch.int8
            and weight.dim() == 2 and weight.is_contiguous() and weight.shape[1] % 4 == 0
            and weight.data_ptr() % 4 == 0)


def int8_x16_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  act: str = "", launch: Launch | None = None,
                  halves: Halves | None = None) -> torch.Tensor:
    """`x [1, K]` (float16 / bfloat16 / float32, unit column stride) times the transpose of
    `weight [N, K]` int8 (`takes`) scaled by `scale [N]`: `[1, N]` in x's dtype; with `act`
    ("silu" / "gelu_tanh") `act(gate) * up` of a gated MLP's `[gate | up]` weight,
    `[1, N / 2]`, rounded as `gemv.gemv_gate_up` rounds it. `halves`: x's `split_rows`,
    where the kernel that made x made them too (else split here, a launch)."""
    assert takes(x, weight) and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.stride(1) == 1 and scale.shape == weight.shape[:1] and scale.is_contiguous()
    assert act in ("", "silu", "gelu_tanh"), act
    weight_rows, k = weight.shape
    n = weight_rows // 2 if act else weight_rows
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0 or k == 0:
        return y.zero_()  # act(0) * 0 = 0 too
    block_n, block_k, num_warps = launch or default_launch(weight_rows, k)
    assert block_k % 4 == 0 and (not act or block_n % 2 == 0), launch
    q, x_scale = halves or split_rows(x)
    assert q.shape == (2, 1, k), q.shape
    kw = k // 4
    _int8_x16_gemv_kernel[(triton.cdiv(n, block_n // 2 if act else block_n),)](
        q.view(torch.int32), x_scale, weight.view(torch.int32), scale, y, n, kw, kw,
        BLOCK_N=block_n, BLOCK_W=block_k // 4, EVEN_K=kw % (block_k // 4) == 0,
        GATE_UP=act, PTX=gpu_compiled(x.device), num_warps=num_warps,
        **dependent_launch.launch_options())
    return y
