"""One row (or two) times a 4-bit weight in groups: `y [M, N] = x [M, K] @ w [N, K]^T`,
`w[n, k] = q[n, k] * scale[n, g] + zero[n, g]`, g = k // G, q in 0..15; float32
accumulation, M 1 or 2 (`quantization/int4_weights.py` makes the weights).

The layout is the kernel's (`int4_weights.kernel_layout`): q packed eight to an int32
word, a group of G values of a channel (a stripe) in G / 8 words, nibble i of the
stripe's word j holding k = g G + i G / 8 + j (lowest bits first); the channels in blocks
of B, each block's words K-major, `[N / B, K / 8, B]`, so that a thread's 16-byte load
holds one word of four channels, which then share each x value it converts, and a
program's channels are one run of memory; `scale` and `zero` `[N / B, K / G, B]` in 16
bits. A program owns BLOCK_N output channels and walks all of K, STRIPES groups a step (a
`[STRIPES, G / 8, BLOCK_N]` tile of words); with `gemv_gate_up`'s form its tile holds
BLOCK_N / 2 gate channels, then the same up channels. A nibble becomes the
float `v = 1/2 + q / 256` in one byte permute (under the exponent of 1/2, no convert, no
subtraction: `v x` is exact in float32 for a 16-bit x), and each group is scaled once a
word: `sum q x * scale + zero * sum x = 256 scale * sum v x + (zero - 128 scale) * sum x`.

`gemv_gate_up`'s form too (`int4_gemv_gate_up`): a gated MLP's `[gate | up]` weight, each
program multiplying the gate and up rows of the same channels and storing `act(gate) * up`;
and, as `gemv.py`'s, inside `row_skip.first_row_skipped_where(flag)` a two-row launch
multiplies the second row alone where the kernel finds the flag set.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch, gpu_compiled, row_skip
from infer.kernels.activation import gated
from infer.kernels.gemv import Launch

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
def _load_tile(words_at, s_at, z_at, g0, rg, groups, stride_w, stride_s, SW: tl.constexpr,
               EVEN_K: tl.constexpr):
    """Groups `g0 + rg` of the program's channels (`words_at`, `s_at`, `z_at`: group 0's
    addresses): words `[STRIPES, SW, BLOCK_N]`, and each group's `256 scale` and `zero -
    128 scale` (float32, `[STRIPES, 1, BLOCK_N]`)."""
    words_at += g0 * SW * stride_w  # int32: a weight's words are fewer than 2^31
    step = g0 * stride_s
    if EVEN_K:
        words = tl.load(words_at, eviction_policy="evict_first")
        scale = tl.load(s_at + step).to(tl.float32)
        zero = tl.load(z_at + step).to(tl.float32)
    else:
        inside = (g0 + rg)[:, None, None] < groups
        words = tl.load(words_at, mask=inside, other=0, eviction_policy="evict_first")
        scale = tl.load(s_at + step, mask=inside, other=0.0).to(tl.float32)
        zero = tl.load(z_at + step, mask=inside, other=0.0).to(tl.float32)
    return words, scale * 256.0, zero - scale * 128.0


@triton.jit
def _x_part(x_ptr, g0, rg, rj, i: tl.constexpr, groups, SW: tl.constexpr,
            EVEN_K: tl.constexpr):
    """x at nibble position i of each word of groups `g0 + rg`: `[STRIPES, SW, 1]`."""
    gg = (g0 + rg)[:, None]
    at = x_ptr + gg * (8 * SW) + i * SW + rj[None, :]
    if EVEN_K:
        return tl.load(at).to(tl.float32)[:, :, None]
    return tl.load(at, mask=gg < groups, other=0.0).to(tl.float32)[:, :, None]


@triton.jit
def _products(words, scale, zero, x_ptr, g0, rg, rj, groups, SW: tl.constexpr,
              EVEN_K: tl.constexpr, PTX: tl.constexpr):
    """`[STRIPES, SW, BLOCK_N]`: each word's eight weights times x, scaled."""
    halves = _halves(words, PTX)
    sums = tl.zeros(words.shape, dtype=tl.float32)
    x_sums = tl.zeros((words.shape[0], words.shape[1], 1), dtype=tl.float32)
    for i in tl.static_range(8):
        x = _x_part(x_ptr, g0, rg, rj, i, groups, SW, EVEN_K)
        sums += halves[i] * x
        x_sums += x
    return sums * scale + zero * x_sums


@triton.jit
def block_channels(N, blocks, BLOCK_N: tl.constexpr, B: tl.constexpr,
                   GATE_UP: tl.constexpr):
    """(the output channels the program stores, the block of each tile column's weight
    channel, its place in the block): BLOCK_N channels, or with GATE_UP (weight channels
    2N) BLOCK_N / 2 gate channels then the same up channels, BLOCK_N / 2 stored. Columns
    past the last channel read the last block (no mask on the weight's loads), not
    stored."""
    r = tl.arange(0, BLOCK_N)
    if GATE_UP == "":
        rn = tl.program_id(0) * BLOCK_N + r
        channel = rn
    else:
        rn = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        channel = tl.program_id(0) * (BLOCK_N // 2) + r % (BLOCK_N // 2) \
            + (r // (BLOCK_N // 2)) * N
    return rn, tl.minimum(channel // B, blocks - 1), channel % B


@triton.jit
def store_halves(acc, y_ptr, rn, N, GATE_UP: tl.constexpr):
    """A row's sums of `acc [BLOCK_N, ...]` rounded to y's dtype, stored at rn; with
    GATE_UP (`block_channels`' gate half, then up half) `act(gate) * up` of each channel,
    rounded as the activation kernel rounds what it reads and stores."""
    y = tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty)
    if GATE_UP != "":
        gate, up = tl.split(tl.trans(tl.reshape(y, (2, y.shape[0] // 2))))
        y = gated(gate, up, GATE_UP).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rn, y, mask=rn < N)


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, skip_ptr, y_ptr, N, groups, blocks, stride_xm, stride_wb,
    stride_sb, stride_ym, BLOCK_N: tl.constexpr, B: tl.constexpr, STRIPES: tl.constexpr,
    SW: tl.constexpr, ROWS: tl.constexpr, EVEN_K: tl.constexpr, GATE_UP: tl.constexpr,
    SKIPS: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr,
):
    rn, block, at = block_channels(N, blocks, BLOCK_N, B, GATE_UP)
    rg = tl.arange(0, STRIPES)
    rj = tl.arange(0, SW)
    # a block's word rows (and group rows) lie B apart
    stride_w = B
    stride_s = B
    block = block.to(tl.int64)[None, None, :]
    at = at[None, None, :]
    words_at = w_ptr + block * stride_wb + (rg[:, None, None] * SW + rj[None, :, None]) * B \
        + at
    s_at = s_ptr + block * stride_sb + rg[:, None, None] * B + at
    z_at = z_ptr + block * stride_sb + rg[:, None, None] * B + at
    # The first tile (weights, scales, zeros) is read before the kernel before this one
    # has finished (dependent_launch.py), and the skip flag, written before the graph
    # holding this launch started (row_skip.py); x only after.
    words, scale, zero = _load_tile(words_at, s_at, z_at, 0, rg, groups, stride_w,
                                    stride_s, SW, EVEN_K)
    if SKIPS:
        skip = tl.load(skip_ptr)
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    if SKIPS:  # two rows, the first left out where the flag is set
        if skip != 0:
            _rows(words, scale, zero, words_at, s_at, z_at, x_ptr + stride_xm,
                  y_ptr + stride_ym, rg, rj, rn, N, groups, stride_xm, stride_w, stride_s,
                  stride_ym, BLOCK_N, STRIPES, SW, 1, EVEN_K, GATE_UP, PTX)
        else:
            _rows(words, scale, zero, words_at, s_at, z_at, x_ptr, y_ptr, rg, rj, rn, N,
                  groups, stride_xm, stride_w, stride_s, stride_ym, BLOCK_N, STRIPES, SW, 2,
                  EVEN_K, GATE_UP, PTX)
    else:
        _rows(words, scale, zero, words_at, s_at, z_at, x_ptr, y_ptr, rg, rj, rn, N, groups,
              stride_xm, stride_w, stride_s, stride_ym, BLOCK_N, STRIPES, SW, ROWS, EVEN_K,
              GATE_UP, PTX)


@triton.jit
def _rows(words, scale, zero, words_at, s_at, z_at, x_ptr, y_ptr, rg, rj, rn, N,
          groups, stride_xm, stride_w, stride_s, stride_ym, BLOCK_N: tl.constexpr,
          STRIPES: tl.constexpr, SW: tl.constexpr, ROWS: tl.constexpr,
          EVEN_K: tl.constexpr, GATE_UP: tl.constexpr, PTX: tl.constexpr):
    """The program's channels of x's first ROWS rows, from the first tile held."""
    acc = _products(words, scale, zero, x_ptr, 0, rg, rj, groups, SW, EVEN_K, PTX)
    if ROWS == 2:
        acc_2 = _products(words, scale, zero, x_ptr + stride_xm, 0, rg, rj, groups, SW,
                          EVEN_K, PTX)
    for g0 in range(STRIPES, groups, STRIPES):
        words, scale, zero = _load_tile(words_at, s_at, z_at, g0, rg, groups, stride_w,
                                        stride_s, SW, EVEN_K)
        acc += _products(words, scale, zero, x_ptr, g0, rg, rj, groups, SW, EVEN_K, PTX)
        if ROWS == 2:
            acc_2 += _products(words, scale, zero, x_ptr + stride_xm, g0, rg, rj, groups,
                               SW, EVEN_K, PTX)
    acc = tl.trans(tl.reshape(acc, (STRIPES * SW, BLOCK_N)))
    store_halves(acc, y_ptr, rn, N, GATE_UP)
    if ROWS == 2:
        acc_2 = tl.trans(tl.reshape(acc_2, (STRIPES * SW, BLOCK_N)))
        store_halves(acc_2, y_ptr + stride_ym, rn, N, GATE_UP)


def default_launch(n: int, k: int) -> Launch:
    """The launch for an `[n, k]` 4-bit weight (`block_k` in weights), untuned: at least 8
    channels a program (a block of the layout, a tile row of 32 bytes), 8 KB of words a
    step."""
    if n >= 6144:
        return Launch(block_n=16, block_k=1024, num_warps=8)
    return Launch(block_n=8, block_k=2048, num_warps=8)


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
              zero: torch.Tensor, launch: Launch | None = None) -> torch.Tensor:
    """`x [M, K]` (1 to MAX_ROWS rows of float16 / bfloat16 / float32, unit column
    stride) times the 4-bit weight `(packed [N / B, K / 8, B] int32, scale, zero [N / B,
    K / G, B])` (see above): `[M, N]` in x's dtype."""
    return _launch(x, packed, scale, zero, launch)


def int4_gemv_gate_up(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                      zero: torch.Tensor, act: str, launch: Launch | None = None
                      ) -> torch.Tensor:
    """`act(gate) * up` of `int4_gemv(x, ...)` (the weight's channels gate's then up's,
    `2I` of them): `[M, I]`, in one launch (see `gemv.gemv_gate_up`)."""
    assert act in ("silu", "gelu_tanh"), act
    return _launch(x, packed, scale, zero, launch, act)


def _launch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
            launch: Launch | None, gate_up: str = "") -> torch.Tensor:
    assert x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.stride(1) == 1, (x.shape,
                                                                                x.stride())
    blocks, words, block = check_layout(packed, scale, zero)
    channels_stored = blocks * block
    k = words * WORD
    assert x.shape[1] == k, (x.shape, packed.shape)
    groups = scale.shape[1]
    group = k // groups
    m = x.shape[0]
    block_n, block_k, num_warps = launch or default_launch(channels_stored, k)
    assert block_k & (block_k - 1) == 0, block_k
    n = channels_stored // 2 if gate_up else channels_stored
    assert not gate_up or n % block == 0, (n, block)  # no block spans gate and up
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    per_program = block_n // 2 if gate_up else block_n
    assert per_program * (2 if gate_up else 1) == block_n, block_n
    stripes = max(1, block_k // group)
    flag = row_skip.skip_flag() if m == 2 else None
    if flag is not None:
        assert flag.dtype == torch.int32 and flag.device == x.device, (flag.dtype, flag.device)
    _int4_gemv_kernel[(triton.cdiv(n, per_program),)](
        x, packed, scale, zero, x if flag is None else flag, y, n, groups, blocks,
        x.stride(0), packed.stride(0), scale.stride(0), y.stride(0),
        BLOCK_N=block_n, B=block, STRIPES=stripes, SW=group // WORD, ROWS=m,
        EVEN_K=groups % stripes == 0, GATE_UP=gate_up, SKIPS=flag is not None,
        PTX=gpu_compiled(x.device),
        num_warps=num_warps, **dependent_launch.launch_options(),
    )
    return y


def check_layout(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
                 ) -> tuple[int, int, int]:
    """(blocks, words a channel, channels a block) of a weight in `kernel_layout`'s layout,
    its shapes, dtypes and strides checked."""
    assert packed.dtype == torch.int32 and packed.dim() == 3, (packed.dtype, packed.shape)
    assert packed.is_contiguous() and scale.is_contiguous() and zero.is_contiguous()
    blocks, words, block = packed.shape
    assert scale.shape == zero.shape and scale.dim() == 3, (scale.shape, zero.shape)
    assert (scale.shape[0], scale.shape[2]) == (blocks, block), (packed.shape, scale.shape)
    groups = scale.shape[1]
    group = words * WORD // groups if groups else 0
    assert groups and group * groups == words * WORD and group % WORD == 0, (words, groups)
    assert group & (group - 1) == 0, group
    return blocks, words, block
