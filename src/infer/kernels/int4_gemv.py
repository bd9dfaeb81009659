"""One row (or two) times a 4-bit weight in groups: `y [M, N] = x [M, K] @ w [N, K]^T`,
`w[n, k] = q[n, k] * scale[n, g] + zero[n, g]`, g = k // G, q in 0..15; float32
accumulation, M 1 or 2 (`quantization/int4_weights.py` makes the weights).

The layout is the kernel's: q packed eight to an int32 word, a group of G values (a stripe)
in G / 8 words, nibble i of the stripe's word j holding k = g G + i G / 8 + j (lowest bits
first), so that each nibble position meets a contiguous run of x; `scale` and `zero` `[N, K
/ G]` in 16 bits. A program owns BLOCK_N output channels and walks all of K, STRIPES groups
a step (a `[BLOCK_N, STRIPES, G / 8]` tile of words), as `gemv.py` does for 8- and 16-bit
weights. A nibble becomes the float `v = 1/2 + q / 256` in one byte permute (under the
exponent of 1/2, no convert, no subtraction: `v x` is exact in float32 for a 16-bit x), the
word's eight `v x` are summed in the thread, and each group is scaled once a word:
`sum q x * scale + zero * sum x = 256 scale * sum v x + (zero - 128 scale) * sum x`.

`gemv_gate_up`'s form too (`int4_gemv_gate_up`): a gated MLP's `[gate | up]` weight, each
program multiplying the gate and up rows of the same channels and storing `act(gate) * up`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch, gpu_compiled
from infer.kernels.gemv import Launch, store_sums

MAX_ROWS = 2
WORD = 8  # 4-bit values an int32 word holds


@triton.jit
def _halves(words, PTX: tl.constexpr):
    """Each word's eight nibbles q as the floats `1/2 + q / 256`, nibble 0 first. With
    PTX (a GPU) two masks spread the nibbles over bytes and a `prmt` a value puts its byte
    under the exponent (float bits 0x3F0q0000); else the same bits in Triton."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 lo, hi, c;
            and.b32 lo, $8, 0x0F0F0F0F;
            shr.u32 hi, $8, 4;
            and.b32 hi, hi, 0x0F0F0F0F;
            mov.b32 c, 0x3F000000;
            prmt.b32 $0, lo, c, 0x7044;
            prmt.b32 $1, hi, c, 0x7044;
            prmt.b32 $2, lo, c, 0x7144;
            prmt.b32 $3, hi, c, 0x7144;
            prmt.b32 $4, lo, c, 0x7244;
            prmt.b32 $5, hi, c, 0x7244;
            prmt.b32 $6, lo, c, 0x7344;
            prmt.b32 $7, hi, c, 0x7344;
            }""",
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[words],
            dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    return (_half(words, 0), _half(words, 1), _half(words, 2), _half(words, 3),
            _half(words, 4), _half(words, 5), _half(words, 6), _half(words, 7))


@triton.jit
def _half(words, i: tl.constexpr):
    return ((((words >> (4 * i)) & 0xF) << 16) | 0x3F000000).to(tl.float32, bitcast=True)


@triton.jit
def _load_tile(w_rows, s_rows, z_rows, g0, rg, rj, groups, SW: tl.constexpr,
               EVEN_K: tl.constexpr):
    """Groups `g0 + rg` of the program's rows: words `[BLOCK_N, STRIPES, SW]`, and each
    group's `256 scale` and `zero - 128 scale` (float32, `[BLOCK_N, STRIPES, 1]`)."""
    gg = (g0 + rg)[None, :, None]
    at = gg * SW + rj[None, None, :]
    if EVEN_K:
        words = tl.load(w_rows + at, eviction_policy="evict_first")
        scale = tl.load(s_rows + gg).to(tl.float32)
        zero = tl.load(z_rows + gg).to(tl.float32)
    else:
        inside = gg < groups
        words = tl.load(w_rows + at, mask=inside, other=0, eviction_policy="evict_first")
        scale = tl.load(s_rows + gg, mask=inside, other=0.0).to(tl.float32)
        zero = tl.load(z_rows + gg, mask=inside, other=0.0).to(tl.float32)
    return words, scale * 256.0, zero - scale * 128.0


@triton.jit
def _x_part(x_ptr, g0, rg, rj, i: tl.constexpr, groups, SW: tl.constexpr,
            EVEN_K: tl.constexpr):
    """x at nibble position i of each word of groups `g0 + rg`: `[STRIPES, SW]`."""
    gg = (g0 + rg)[:, None]
    at = x_ptr + gg * (8 * SW) + i * SW + rj[None, :]
    if EVEN_K:
        return tl.load(at).to(tl.float32)
    return tl.load(at, mask=gg < groups, other=0.0).to(tl.float32)


@triton.jit
def _products(words, scale, zero, x_ptr, g0, rg, rj, groups, SW: tl.constexpr,
              EVEN_K: tl.constexpr, PTX: tl.constexpr):
    """`[BLOCK_N, STRIPES, SW]`: each word's eight weights times x, scaled."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _halves(words, PTX)
    x = _x_part(x_ptr, g0, rg, rj, 0, groups, SW, EVEN_K)
    sums = v0 * x[None, :, :]
    x_sums = x
    x = _x_part(x_ptr, g0, rg, rj, 1, groups, SW, EVEN_K)
    sums += v1 * x[None, :, :]
    x_sums += x
    x = _x_part(x_ptr, g0, rg, rj, 2, groups, SW, EVEN_K)
    sums += v2 * x[None, :, :]
    x_sums += x
    x = _x_part(x_ptr, g0, rg, rj, 3, groups, SW, EVEN_K)
    sums += v3 * x[None, :, :]
    x_sums += x
    x = _x_part(x_ptr, g0, rg, rj, 4, groups, SW, EVEN_K)
    sums += v4 * x[None, :, :]
    x_sums += x
    x = _x_part(x_ptr, g0, rg, rj, 5, groups, SW, EVEN_K)
    sums += v5 * x[None, :, :]
    x_sums += x
    x = _x_part(x_ptr, g0, rg, rj, 6, groups, SW, EVEN_K)
    sums += v6 * x[None, :, :]
    x_sums += x
    x = _x_part(x_ptr, g0, rg, rj, 7, groups, SW, EVEN_K)
    sums += v7 * x[None, :, :]
    x_sums += x
    return sums * scale + zero * x_sums[None, :, :]


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, N, groups, stride_xm, stride_wn, stride_sn,
    stride_ym, BLOCK_N: tl.constexpr, STRIPES: tl.constexpr, SW: tl.constexpr,
    ROWS: tl.constexpr, EVEN_K: tl.constexpr, GATE_UP: tl.constexpr, PTX: tl.constexpr,
    PDL: tl.constexpr,
):
    r = tl.arange(0, BLOCK_N)
    if GATE_UP == "":
        rn = tl.program_id(0) * BLOCK_N + r
        wn = tl.minimum(rn, N - 1)
    else:  # weight rows 2N: tile row 2c is gate channel c's, 2c + 1 up channel c's
        rn = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        wn = tl.minimum(tl.program_id(0) * (BLOCK_N // 2) + r // 2, N - 1) + (r % 2) * N
    rg = tl.arange(0, STRIPES)
    rj = tl.arange(0, SW)
    # Rows past N read row N - 1 (no mask on the weight's loads) and are not stored.
    w_rows = w_ptr + wn.to(tl.int64)[:, None, None] * stride_wn
    s_rows = s_ptr + wn.to(tl.int64)[:, None, None] * stride_sn
    z_rows = z_ptr + wn.to(tl.int64)[:, None, None] * stride_sn
    # The first tile (weights, scales, zeros) is read before the kernel before this one
    # has finished (dependent_launch.py); x only after.
    words, scale, zero = _load_tile(w_rows, s_rows, z_rows, 0, rg, rj, groups, SW, EVEN_K)
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    acc = _products(words, scale, zero, x_ptr, 0, rg, rj, groups, SW, EVEN_K, PTX)
    if ROWS == 2:
        acc_2 = _products(words, scale, zero, x_ptr + stride_xm, 0, rg, rj, groups, SW,
                          EVEN_K, PTX)
    for g0 in range(STRIPES, groups, STRIPES):
        words, scale, zero = _load_tile(w_rows, s_rows, z_rows, g0, rg, rj, groups, SW,
                                        EVEN_K)
        acc += _products(words, scale, zero, x_ptr, g0, rg, rj, groups, SW, EVEN_K, PTX)
        if ROWS == 2:
            acc_2 += _products(words, scale, zero, x_ptr + stride_xm, g0, rg, rj, groups,
                               SW, EVEN_K, PTX)
    acc = tl.reshape(acc, (BLOCK_N, STRIPES * SW))
    store_sums(acc, s_ptr, y_ptr, rn, wn, N, False, GATE_UP)
    if ROWS == 2:
        acc_2 = tl.reshape(acc_2, (BLOCK_N, STRIPES * SW))
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
    assert block_k & (block_k - 1) == 0 and (k // groups) & (k // groups - 1) == 0, (
        block_k, k // groups)
    n = weight_rows // 2 if gate_up else weight_rows
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    channels = block_n // 2 if gate_up else block_n
    assert channels * (2 if gate_up else 1) == block_n, block_n
    group = k // groups
    stripes = max(1, block_k // group)
    _int4_gemv_kernel[(triton.cdiv(n, channels),)](
        x, packed, scale, zero, y, n, groups, x.stride(0), packed.stride(0), scale.stride(0),
        y.stride(0),
        BLOCK_N=block_n, STRIPES=stripes, SW=group // WORD, ROWS=m,
        EVEN_K=groups % stripes == 0, GATE_UP=gate_up, PTX=gpu_compiled(x.device),
        num_warps=num_warps, **dependent_launch.launch_options(),
    )
    return y
