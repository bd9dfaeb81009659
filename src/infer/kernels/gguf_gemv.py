"""GGUF matmul at one row of `x` (decode at batch 1): `y = x @ W^T` for Q4_K and Q6_K (the
types of a Q4_K_M file), the stored blocks read as 32-bit words (`data.view(int32)`: rows
a whole number of aligned words; Q6_K: K a multiple of 512).

Two launches. `_gemv_x_kernel` lays `x` out for the words: `xs` holds, for field e of
data word v of a row (Q4_K: 4 low, 4 high nibbles; Q6_K: 4 low, 4 high 6-bit values), the
float32 `x` it multiplies, scaled by 2^-p for the field's place p (below); Q4_K adds the
sums of `x` over each sub-block (its min term). Threads that hold neighbouring words read
neighbouring `xs`: each load of the main kernel is coalesced, and shared by all the rows
a thread holds.

`_gguf_gemv_kernel`: a program owns BLOCK_N rows and walks K a step of UNITS units (Q4_K: a
144-byte super-block; Q6_K: a pair of super-blocks, 420 bytes). Its tensors are `[BLOCK_N,
G, 1 or 4]`, G the step's scale groups (Q4_K: 64 weights, two sub-blocks, two 16-byte
loads; Q6_K: 16 bytes of `ql`, two groups of 16): a thread decodes whole groups, so scales
load and convert once per group. Each field becomes a float without the quarter-rate
int->float convert: it is masked where it lies in its word (or in the word shifted down,
so that it ends below bit 23) and or-ed into the float32 bits of 2^23, exactly; subtracting
2^23 (plus the type's offset times 2^p) leaves `(q - offset) * 2^p`, which `xs` undoes.
Sums of `q * x` are scaled once per group. Q6_K's odd super-blocks start two bytes into a
word: their words are funnel-shifted from two loads (the second an L1 hit).

Q8_0 stays with the generic kernel (gguf_matmul.py): every other 34-byte block starts two
bytes into a word, and the generic kernel's byte loads already read it at ~1.5 TB/s on the
H100 (8B shapes); versions of it in this layout ran at half that.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as QType

from infer.kernels import dependent_launch, launch_counters
from infer.kernels.split_k import sum_of_parts

# Weights, 32-bit words, data words (those `xs` covers) and scale groups per unit.
UNITS_OF: dict[QType, tuple[int, int, int, int]] = {
    QType.Q4_K: (256, 36, 32, 4), QType.Q6_K: (512, 105, 64, 8),
}
_Q4_K = tl.constexpr(int(QType.Q4_K))
_Q6_K = tl.constexpr(int(QType.Q6_K))
# Row blocks a launch that splits K may have: a counter each (launch_counters).
MAX_BLOCKS = 1 << 16
MAGIC = 0x4B000000  # 2^23 as float32 bits: a kernel argument, so that it sits in a register


@triton.jit
def _float(magic, bits, OFFSET: tl.constexpr, PLACE: tl.constexpr):
    """`(field - OFFSET) * 2^PLACE` for the field at bits PLACE.. (< 23) of `bits`, all
    other bits zero."""
    return (bits | magic).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET * 2.0 ** PLACE)


@triton.jit
def _word(ptr):
    return tl.load(ptr).to(tl.uint32, bitcast=True)


@triton.jit
def _masked_word(ptr, ok):
    return tl.load(ptr, mask=ok, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _shifted_word(ptr):
    """The word that starts two bytes after `ptr`."""
    return (_word(ptr) >> 16) | (_word(ptr + 1) << 16)


@triton.jit
def _runs_of_4(v):
    """`v [.., 4]`: runs of 4 consecutive words starting at multiples of 4 (16-byte loads of
    `xs`)."""
    return tl.max_contiguous(tl.multiple_of(v, [1, 1, 4]), [1, 1, 4])


@triton.jit
def _f16_lo(word):
    return (word & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_hi(word):
    return (word >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _bytes_dot(magic, w, x, nv, MASK: tl.constexpr, OFFSET: tl.constexpr):
    """`sum_b ((byte b of w) & MASK - OFFSET) * x[b * nv]`: bytes 0, 1 at places 0, 8 and
    bytes 2, 3 read from the word shifted down by 16."""
    up = w >> 16
    total = _float(magic, w & MASK, OFFSET, 0) * tl.load(x)
    total += _float(magic, w & (MASK << 8), OFFSET, 8) * tl.load(x + nv)
    total += _float(magic, up & MASK, OFFSET, 0) * tl.load(x + 2 * nv)
    total += _float(magic, up & (MASK << 8), OFFSET, 8) * tl.load(x + 3 * nv)
    return total


@triton.jit
def _nibbles_dot(magic, lo, hi, w, xs, v, nv, FIRST: tl.constexpr):
    """`lo`, `hi` (none if FIRST) plus the low and high nibbles of words `w` (data words v)
    times their `x` (`xs[e * nv + v]` for field e)."""
    v = _runs_of_4(v)
    up = w >> 12
    if FIRST:
        lo = _float(magic, w & 0xF, 0, 0) * tl.load(xs + v)
        hi = _float(magic, w & 0xF0, 0, 4) * tl.load(xs + 4 * nv + v)
    else:
        lo += _float(magic, w & 0xF, 0, 0) * tl.load(xs + v)
        hi += _float(magic, w & 0xF0, 0, 4) * tl.load(xs + 4 * nv + v)
    lo += _float(magic, w & 0xF00, 0, 8) * tl.load(xs + nv + v)
    lo += _float(magic, w & 0xF0000, 0, 16) * tl.load(xs + 2 * nv + v)
    lo += _float(magic, up & 0xF000, 0, 12) * tl.load(xs + 3 * nv + v)
    hi += _float(magic, w & 0xF000, 0, 12) * tl.load(xs + 5 * nv + v)
    hi += _float(magic, up & 0xF00, 0, 8) * tl.load(xs + 6 * nv + v)
    hi += _float(magic, up & 0xF0000, 0, 16) * tl.load(xs + 7 * nv + v)
    return lo, hi


@triton.jit
def _q4_k_words(p, c, ok):
    """Chunk c's words of the Q4_K super-blocks at words `p [BLOCK_N, G, 1]`: the head
    (`d`, `dmin`; 0 where not ok), the three words of scales, and its 8 words of nibbles
    (two runs of 4)."""
    j = tl.arange(0, 4)[None, None, :]
    q = p + 4 + c * 8
    return (_masked_word(p, ok), _word(p + 1), _word(p + 2), _word(p + 3), _word(q + j),
            _word(q + 4 + j))


@triton.jit
def _q4_k_scales(s0, s1, s2, c):
    """`(scales, mins)` of sub-blocks 2c (byte 0) and 2c + 1 (byte 1, 6 bits each; the
    bits above are junk) of Q4_K super-blocks, from their three words of packed scales."""
    sh = c % 2 * 16
    sc = tl.where(c < 2, s0 >> sh, ((s2 >> sh) & 0x0F0F) | ((s0 >> (sh + 2)) & 0x3030))
    mn = tl.where(c < 2, s1 >> sh, ((s2 >> (sh + 4)) & 0x0F0F) | ((s1 >> (sh + 2)) & 0x3030))
    return sc, mn


@triton.jit
def _q4_k(magic, acc, words, c, v, xs, nv):
    """Chunk c of Q4_K super-blocks, `words` from _q4_k_words: words 4 + 8c.. (data words
    v.. of the row) hold sub-block 2c in their low nibbles, 2c + 1 in their high ones.
    `acc [BLOCK_N, G, 1]`."""
    head, s0, s1, s2, wa, wb = words
    j = tl.arange(0, 4)[None, None, :]
    lo, hi = _nibbles_dot(magic, 0.0, 0.0, wa, xs, v + j, nv, True)
    lo, hi = _nibbles_dot(magic, lo, hi, wb, xs, v + 4 + j, nv, False)
    sc, mn = _q4_k_scales(s0, s1, s2, c)
    d = _f16_lo(head)
    acc += tl.sum(lo, axis=2, keep_dims=True) * (d * _float(magic, sc & 0x3F, 0, 0))
    acc += tl.sum(hi, axis=2, keep_dims=True) * (d * _float(magic, (sc >> 8) & 0x3F, 0, 0))
    sums = xs + 8 * nv + v // 4  # sums of x over sub-blocks: v // 4 = 8 * block + 2c
    mins = _float(magic, mn & 0x3F, 0, 0) * tl.load(sums)
    mins += _float(magic, (mn >> 8) & 0x3F, 0, 0) * tl.load(sums + 1)
    return acc - _f16_hi(head) * mins


@triton.jit
def _q6_k(magic, acc, p, g, xs, nv, ok, SHIFTED: tl.constexpr):
    """Piece g = 4h + q of the Q6_K super-blocks at words `p [BLOCK_N, G, 1]` (two bytes
    further if SHIFTED): `ql` words 4g + i hold weights 128h + 16q + 4i.. in their low
    nibbles, those 64 further in their high ones; `xs` points at the piece's `x`."""
    half = g // 4
    q = g % 4
    ql = p + g * 4
    # The two high bits of weight r (< 64) of a half and of weight r + 64: bits 2 (r // 32)
    # and 2 (r // 32) + 4 of qh byte 32h + r % 32.
    qh = p + 32 + half * 8 + q % 2 * 4
    ql_next = _word(ql)
    qh_next = _word(qh)
    for i in tl.static_range(4):
        if SHIFTED:
            ql_word = ql_next >> 16
            qh_word = qh_next >> 16
            ql_next = _word(ql + i + 1)
            qh_next = _word(qh + i + 1)
            ql_word |= ql_next << 16
            qh_word |= qh_next << 16
        else:
            ql_word = ql_next if i == 0 else _word(ql + i)
            qh_word = qh_next if i == 0 else _word(qh + i)
        qh_word = qh_word >> (q // 2 * 2)
        six_lo = (ql_word & 0x0F0F0F0F) | ((qh_word << 4) & 0x30303030)
        six_hi = ((ql_word >> 4) & 0x0F0F0F0F) | (qh_word & 0x30303030)
        if i == 0:
            lo = _bytes_dot(magic, six_lo, xs, nv, 0x3F, 32)
            hi = _bytes_dot(magic, six_hi, xs + 4 * nv, nv, 0x3F, 32)
        else:
            lo += _bytes_dot(magic, six_lo, xs + i * (nv // 4), nv, 0x3F, 32)
            hi += _bytes_dot(magic, six_hi, xs + 4 * nv + i * (nv // 4), nv, 0x3F, 32)
    # int8 scales of groups 8h + q (low nibbles) and 8h + 4 + q (high ones): byte q of
    # words 48 + 2h and 49 + 2h.
    if SHIFTED:
        s0 = _shifted_word(p + 48 + half * 2)
        s1 = _shifted_word(p + 49 + half * 2)
        d = _f16_hi(_masked_word(p + 52, ok))
    else:
        s0 = _word(p + 48 + half * 2)
        s1 = _word(p + 49 + half * 2)
        d = _f16_lo(_masked_word(p + 52, ok))
    sc_lo = ((s0 << (24 - q * 8)).to(tl.int32, bitcast=True) >> 24).to(tl.float32)
    sc_hi = ((s1 << (24 - q * 8)).to(tl.int32, bitcast=True) >> 24).to(tl.float32)
    return acc + (lo * sc_lo + hi * sc_hi) * d


@triton.jit
def _store_rows(y, rows, y_ptr, part_ptr, counts, pid_n, pid_s, N, splits):
    """Program (pid_n, pid_s)'s float32 sums `y` of `rows`: stored in `y`'s dtype when K is
    not split; else into `part_ptr [splits, N]`, counted in `counts[pid_n]` (a
    `launch_counters` counter: zero before, and set back to zero by the last program of
    the row block, which adds the parts, in split order, into `y`)."""
    if splits == 1:
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)
    else:
        last, y = sum_of_parts(y, part_ptr + rows, N, pid_s, splits, counts + pid_n, rows < N)
        if last:
            tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _gguf_gemv_kernel(
    xs, q_ptr, y_ptr, part_ptr, counts, N, K, nv, stride_qw, splits, units_per_split, magic,
    QTYPE: tl.constexpr, UNIT_K: tl.constexpr, UNIT_WORDS: tl.constexpr,
    UNIT_DATA: tl.constexpr, GROUPS: tl.constexpr, UNITS: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """Program (n, s) owns rows `n * BLOCK_N..` and units `s * units_per_split..` of K
    (`units_per_split` a multiple of UNITS). With `splits` > 1 the parts are added as
    `_store_rows` says."""
    dependent_launch.wait(PDL)  # `xs`, and the split counters, of the kernels before
    dependent_launch.release(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None]
    g = tl.arange(0, UNITS * GROUPS)[None, :, None]
    unit = g // GROUPS  # the group's unit in the step
    sub = g % GROUPS  # and its group in the unit
    u0 = pid_s * units_per_split
    u1 = tl.minimum(u0 + units_per_split, tl.cdiv(K, UNIT_K))
    if QTYPE == _Q4_K:
        stride_qw = tl.multiple_of(stride_qw, 4)  # 144-byte units: 16-byte aligned rows
    # Rows past N and units past u1 read the last ones and add nothing: their `d` loads as 0.
    row = q_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_qw
    acc = tl.zeros((BLOCK_N, UNITS * GROUPS, 1), dtype=tl.float32)
    for u in range(u0, u1, UNITS):
        ok = u + unit < u1
        uc = tl.minimum(u + unit, u1 - 1)
        p = row + uc * UNIT_WORDS
        v = uc * UNIT_DATA  # the unit's first data word
        if QTYPE == _Q4_K:
            acc = _q4_k(magic, acc, _q4_k_words(p, sub, ok), sub, v + sub * 8, xs, nv)
        else:
            x = xs + v // 4 + sub  # Q6_K's `xs` by piece (_gemv_x_kernel)
            acc = _q6_k(magic, acc, p, sub, x, nv, ok, False)
            acc = _q6_k(magic, acc, p + 52, sub, x + 8, nv, ok, True)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    _store_rows(y, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), y_ptr, part_ptr, counts, pid_n,
                pid_s, N, splits)


@triton.jit
def _gemv_x_kernel(x_ptr, xs, nv, QTYPE: tl.constexpr, BLOCK: tl.constexpr,
                   PDL: tl.constexpr):
    """`xs[e, v]` for data words v of a program's block (module docstring), then Q4_K's sums
    of x over sub-blocks at `xs[8 * nv + s]`."""
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    v = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = v < nv
    for e in tl.static_range(8):
        if QTYPE == _Q4_K:  # data word v = 32 block + 8c + j: weights 64 (4 block + c) + 4j
            k = v // 8 * 64 + v % 8 * 4 + e % 4 + e // 4 * 32
            # places (_nibbles_dot): low nibbles 0, 8, 16, 12; high ones 4, 12, 8, 16
            if e == 0:
                scale = 1.0
            elif e == 1 or e == 6:
                scale = 2.0 ** -8
            elif e == 2 or e == 7:
                scale = 2.0 ** -16
            elif e == 3 or e == 5:
                scale = 2.0 ** -12
            else:
                scale = 2.0 ** -4
            at = e * nv + v
        else:  # v = 32 block + 4 (4h + q) + i: weights 256 block + 128h + 16q + 4i
            k = v // 32 * 256 + v % 32 // 16 * 128 + v % 16 * 4 + e % 4 + e // 4 * 64
            scale = 2.0 ** -(e % 2 * 8)
            # by piece: xs[e, v % 4, v // 4] (a thread reads whole pieces of 4 words, its
            # neighbours the next pieces)
            at = e * nv + v % 4 * (nv // 4) + v // 4
        x = tl.load(x_ptr + k, mask=ok, other=0.0).to(tl.float32)
        tl.store(xs + at, x * scale, mask=ok)
    if QTYPE == _Q4_K:
        s = tl.program_id(0) * (BLOCK // 4) + tl.arange(0, BLOCK // 4)[:, None]
        x = tl.load(x_ptr + s * 32 + tl.arange(0, 32)[None, :], mask=s < nv // 4, other=0.0)
        tl.store(xs + 8 * nv + s, tl.sum(x.to(tl.float32), axis=1, keep_dims=True),
                 mask=s < nv // 4)


def gemv_x(x: torch.Tensor, qtype: QType, cols: int) -> tuple[torch.Tensor, int]:
    """`(xs, data words per row)` for `x [1, cols]` and weights of `qtype`."""
    unit_k, _, unit_data, _ = UNITS_OF[qtype]
    nv = cols * unit_data // unit_k
    xs = torch.empty(9 * nv, dtype=torch.float32, device=x.device)
    block = 256
    _gemv_x_kernel[(triton.cdiv(nv, block),)](x, xs, nv, QTYPE=int(qtype), BLOCK=block,
                                              num_warps=4, **dependent_launch.launch_options())
    return xs, nv


def gemv_words(data: torch.Tensor, qtype: QType) -> torch.Tensor | None:
    """`data [N, bytes per row]` as int32 words when the kernel takes it (its type, rows a
    whole number of aligned words), else None."""
    return row_words(data) if qtype in UNITS_OF else None


def row_words(data: torch.Tensor) -> torch.Tensor | None:
    """`data [N, bytes per row]` as int32 words where its rows are a whole number of
    aligned words, else None."""
    if data.dim() != 2 or data.stride(1) != 1:
        return None
    if data.shape[1] % 4 or data.stride(0) % 4 or data.storage_offset() % 4:
        return None
    return data.view(torch.int32)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv_launch(qtype: QType, rows: int, cols: int, device: torch.device) -> dict:
    """The launch of gguf_gemv for `rows x cols` weights. Measured on the H100 (Llama-3.1-8B
    shapes, bf16 x, CUDA graphs; benchmarks/quantized_gemv.py --sweep): 128 rows a program,
    one unit a step, 4 warps; K split in two while that keeps the programs under 4 (Q4_K;
    Q6_K: 3) per multiprocessor, up to 8 splits. Q4_K capped at 128 registers (4 programs
    per multiprocessor, 2-20 % faster); Q6_K only when its programs fill more than that
    (the LM head: 7 % faster; fewer rows ran slower)."""
    programs = triton.cdiv(rows, 128)
    units = cols // UNITS_OF[qtype][0]
    sms = multiprocessors(torch.device(device))
    limit = (4 if qtype == QType.Q4_K else 3) * sms
    split = 1
    while split < 8 and 2 * split <= units and 2 * split * programs <= limit:
        split *= 2
    capped = qtype == QType.Q4_K or (split == 1 and programs > 4 * sms)
    return dict(block_n=128, units=1, split=split, num_warps=4, maxnreg=128 if capped else None)


def gguf_gemv(x: torch.Tensor, words: torch.Tensor, qtype: QType, cols: int, *, block_n: int,
              units: int, split: int, num_warps: int, maxnreg: int | None = None
              ) -> torch.Tensor:
    """`x [1, cols]` times the transpose of the weight `words [N, words per row]` (from
    gemv_words): `[1, N]` in x's dtype. `split` > 1 splits K (in units) over that many
    programs per row block, the last of which adds their float32 sums; `maxnreg` caps the
    registers of a thread (more programs per multiprocessor)."""
    unit_k, unit_words, unit_data, groups = UNITS_OF[qtype]
    n = words.shape[0]
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0 or cols == 0:
        return y.zero_()
    steps = triton.cdiv(cols, unit_k)
    per_split = triton.cdiv(triton.cdiv(steps, max(1, split)), units) * units
    split = triton.cdiv(steps, per_split)
    row_blocks = triton.cdiv(n, block_n)
    part = torch.empty((split, n), dtype=torch.float32, device=x.device) if split > 1 else y
    counts = launch_counters("gguf_gemv", x.device, MAX_BLOCKS, row_blocks * (split > 1))
    xs, nv = gemv_x(x, qtype, cols)
    _gguf_gemv_kernel[(row_blocks, split)](
        xs, words, y, part, counts, n, cols, nv, words.stride(0),
        split, per_split, MAGIC, QTYPE=int(qtype), UNIT_K=unit_k, UNIT_WORDS=unit_words,
        UNIT_DATA=unit_data, GROUPS=groups, UNITS=units, BLOCK_N=block_n,
        num_warps=num_warps, **({} if maxnreg is None else dict(maxnreg=maxnreg)),
        **dependent_launch.launch_options(),
    )
    return y
