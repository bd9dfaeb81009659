"""One row (or two) times a 4-bit weight in groups: `y [M, N] = x [M, K] @ w [N, K]^T`,
`w[n, k] = q[n, k] * scale[n, g] + zero[n, g]`, g = k // group, q in 0..15; float32
accumulation, M 1 or 2 (`quantization/int4_weights.py` makes the weights).

The layout is the kernel's: `q` packed eight to an int32 word along K (`packed [N, K / 8]`,
nibble i of word j holding k = 8j + i, lowest bits first), `scale` and `zero` `[N, K /
group]` in 16 bits. Each program owns BLOCK_N output channels and walks all of K, a tile
of BLOCK_W words a step (as `gemv.py` does for 8- and 16-bit weights): the words' eight
nibbles are each multiplied by x at their own stride, summed within the word (one group),
and only then scaled, `sum_i q_i x_i * scale + zero * sum_i x_i`, so a weight costs a
shift, a mask, a convert and a multiply-add.

`gemv_gate_up`'s form too (`int4_gemv_gate_up`): a gated MLP's `[gate | up]` weight, each
program multiplying the gate and up rows of the same channels and storing `act(gate) * up`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch
from infer.kernels.gemv import Launch, store_sums

MAX_ROWS = 2
WORD = 8  # 4-bit values an int32 word holds


@triton.jit
def _load_tile(w_rows, s_rows, z_rows, ww, KW, GROUP: tl.constexpr, EVEN_K: tl.constexpr):
    """Words `ww` of the program's rows, and each word's group scale and zero."""
    gg = ww * 8 // GROUP
    if EVEN_K:
        words = tl.load(w_rows + ww[None, :], eviction_policy="evict_first")
        scale = tl.load(s_rows + gg[None, :])
        zero = tl.load(z_rows + gg[None, :])
    else:
        inside = ww[None, :] < KW
        words = tl.load(w_rows + ww[None, :], mask=inside, other=0,
                        eviction_policy="evict_first")
        scale = tl.load(s_rows + gg[None, :], mask=inside, other=0.0)
        zero = tl.load(z_rows + gg[None, :], mask=inside, other=0.0)
    return words, scale.to(tl.float32), zero.to(tl.float32)


@triton.jit
def _x_word(x_ptr, ww, i, KW, EVEN_K: tl.constexpr):
    """x's column 8w + i of each word w in `ww`."""
    if EVEN_K:
        return tl.load(x_ptr + ww * 8 + i).to(tl.float32)
    return tl.load(x_ptr + ww * 8 + i, mask=ww < KW, other=0.0).to(tl.float32)


@triton.jit
def _products(words, scale, zero, x_ptr, ww, KW, EVEN_K: tl.constexpr):
    """`[BLOCK_N, BLOCK_W]`: each word's eight weights times x's columns, dequantized."""
    sums = tl.zeros(words.shape, dtype=tl.float32)
    x_sums = tl.zeros(ww.shape, dtype=tl.float32)
    for i in tl.static_range(8):
        # The nibble under the exponent of 2^23 (0x4B000000), then 2^23 taken away: exact,
        # without the quarter-rate integer convert.
        bits = ((words >> (4 * i)) & 0xF) | 0x4B000000
        q = bits.to(tl.float32, bitcast=True) - 8388608.0
        x = _x_word(x_ptr, ww, i, KW, EVEN_K)
        sums += q * x[None, :]
        x_sums += x
    return sums * scale + zero * x_sums[None, :]


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, N, KW, stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
    EVEN_K: tl.constexpr, GATE_UP: tl.constexpr, PDL: tl.constexpr,
):
    r = tl.arange(0, BLOCK_N)
    if GATE_UP == "":
        rn = tl.program_id(0) * BLOCK_N + r
        wn = tl.minimum(rn, N - 1)
    else:  # weight rows 2N: tile row 2c is gate channel c's, 2c + 1 up channel c's
        rn = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        wn = tl.minimum(tl.program_id(0) * (BLOCK_N // 2) + r // 2, N - 1) + (r % 2) * N
    rw = tl.arange(0, BLOCK_W)
    # Rows past N read row N - 1 (no mask on the weight's loads) and are not stored.
    w_rows = w_ptr + wn.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + wn.to(tl.int64)[:, None] * stride_sn
    z_rows = z_ptr + wn.to(tl.int64)[:, None] * stride_sn
    # The first tile (weights, scales, zeros) is read before the kernel before this one
    # has finished (dependent_launch.py); x only after.
    words, scale, zero = _load_tile(w_rows, s_rows, z_rows, rw, KW, GROUP, EVEN_K)
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    acc = _products(words, scale, zero, x_ptr, rw, KW, EVEN_K)
    if ROWS == 2:
        acc_2 = _products(words, scale, zero, x_ptr + stride_xm, rw, KW, EVEN_K)
    for w0 in range(BLOCK_W, KW, BLOCK_W):
        ww = w0 + rw
        words, scale, zero = _load_tile(w_rows, s_rows, z_rows, ww, KW, GROUP, EVEN_K)
        acc += _products(words, scale, zero, x_ptr, ww, KW, EVEN_K)
        if ROWS == 2:
            acc_2 += _products(words, scale, zero, x_ptr + stride_xm, ww, KW, EVEN_K)
    store_sums(acc, s_ptr, y_ptr, rn, wn, N, False, GATE_UP)
    if ROWS == 2:
        store_sums(acc_2, s_ptr, y_ptr + stride_ym, rn, wn, N, False, GATE_UP)


def default_launch(n: int, k: int) -> Launch:
    """The launch for an `[n, k]` 4-bit weight (`block_k` in weights): the 8-bit GEMV's
    bytes a row a step (`gemv.default_launch`), untuned for 4 bits."""
    if n >= 6144:
        return Launch(block_n=16, block_k=1024, num_warps=8)
    return Launch(block_n=4, block_k=4096, num_warps=8)


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
              zero: torch.Tensor, launch: Launch | None = None) -> torch.Tensor:
    """`x [M, K]` (1 to MAX_ROWS rows of float16 / bfloat16 / float32, unit column
    stride) times the transpose of the 4-bit weight `(packed [N, K / 8] int32, scale,
    zero [N, K / group])` (see above): `[M, N]` in x's dtype."""
    return _launch(x, packed, scale, zero, launch)


def int4_gemv_gate_up(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                      zero: torch.Tensor, act: str, launch: Launch | None = None
                      ) -> torch.Tensor:
    """`act(gate) * up` of `int4_gemv(x, ...)` (the weight's rows gate's then up's, `[2I,
    K]`): `[M, I]`, in one launch (see `gemv.gemv_gate_up`)."""
    assert act in ("silu", "gelu_tanh"), act
    assert packed.shape[0] % 2 == 0, packed.shape
    return _launch(x, packed, scale, zero, launch, act)


def _launch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
            launch: Launch | None, gate_up: str = "") -> torch.Tensor:
    assert x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.stride(1) == 1, (x.shape,
                                                                                x.stride())
    assert packed.dtype == torch.int32 and packed.dim() == 2 and packed.stride(1) == 1
    weight_rows, words = packed.shape
    k = words * WORD
    assert x.shape[1] == k, (x.shape, packed.shape)
    assert scale.shape == zero.shape and scale.shape[0] == weight_rows, (scale.shape,
                                                                        zero.shape)
    assert scale.stride() == zero.stride() and scale.stride(1) == 1, (scale.stride(),
                                                                       zero.stride())
    groups = scale.shape[1]
    assert groups and k % groups == 0 and (k // groups) % WORD == 0, (k, groups)
    m = x.shape[0]
    block_n, block_k, num_warps = launch or default_launch(weight_rows, k)
    assert block_k % WORD == 0, block_k
    n = weight_rows // 2 if gate_up else weight_rows
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    channels = block_n // 2 if gate_up else block_n
    assert channels * (2 if gate_up else 1) == block_n, block_n
    block_w = block_k // WORD
    _int4_gemv_kernel[(triton.cdiv(n, channels),)](
        x, packed, scale, zero, y, n, words, x.stride(0), packed.stride(0), scale.stride(0),
        y.stride(0),
        BLOCK_N=block_n, BLOCK_W=block_w, GROUP=k // groups, ROWS=m,
        EVEN_K=words % block_w == 0, GATE_UP=gate_up, num_warps=num_warps,
        **dependent_launch.launch_options(),
    )
    return y
