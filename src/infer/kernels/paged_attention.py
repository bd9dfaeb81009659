"""Paged attention over the KV pool: a split-K decode kernel and a varlen prefill kernel.

Cache layout (per layer): `[num_blocks, block_size, KvH, D]`; token `p` of sequence `i`
is row `p % block_size` of block `block_tables[i, p // block_size]` (see
`infer.attention.metadata`). Keys are gathered token by token through the block table, so
blocks may sit anywhere in the pool and a cached prefix is read like any other context.
An FP8 cache (`attention/kv_dtype.py`) is made q's dtype tile by tile as it is read.

GQA packing: a program owns one kv head and all `group = H / KvH` query heads that share
it (rows of its tile are (token, head-in-group) pairs), so each K/V tile is loaded once per
kv head rather than once per query head.

Softmax runs online in base 2 (scores pre-multiplied by log2(e)); `m` is the running row
max and `l` the running sum of `2^(s - m)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch, sm_count
from infer.kernels.activation import _tanh


@triton.jit
def _attend(
    acc, l_i, m_i, q, q_pos, kc_ptr, vc_ptr, bt_ptr, lo, hi, kv_head,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    scale, softcap, window, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Fold keys `[lo, hi)` of one sequence into the running (acc, l, m) of a q tile. An
    FP8 cache's keys and values are made q's dtype, or float16 for bfloat16 q (e4m3 is
    exact in both; the hardware makes e4m3 float16 a pair an instruction, bfloat16 only
    through float32, two more): q made float16 once, exact for |q| in [2^-14, 65504]."""
    if kc_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        q = q.to(tl.float16)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        blk = tl.load(bt_ptr + kpos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
        row = kpos % BLOCK_SIZE
        koff = blk * stride_kb + row * stride_kt + kv_head * stride_kh
        k = tl.load(kc_ptr + koff[None, :] + dims[:, None],
                    mask=kmask[None, :] & dmask[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, k, input_precision=PRECISION)
        if SOFTCAP:
            s = s * scale
            s = softcap * _tanh(s / softcap) * 1.4426950408889634
        else:
            s = s * (scale * 1.4426950408889634)
        visible = kmask[None, :]
        if CAUSAL:
            visible = visible & (kpos[None, :] <= q_pos[:, None])
        if WINDOW:
            visible = visible & (q_pos[:, None] - kpos[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; subtract 0 instead to avoid NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        voff = blk * stride_vb + row * stride_vt + kv_head * stride_vh
        v = tl.load(vc_ptr + voff[:, None] + dims[None, :],
                    mask=kmask[:, None] & dmask[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _combine_splits(part_o_ptr, part_lse_ptr, out_ptr, rows, out_offs, num_splits, count,
                    head_dim, dims, qmask, gmask,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, L2_ONLY: tl.constexpr,
                    BLOCK_S: tl.constexpr = 0):
    """Output rows (`rows`: token * num_heads + head; written at `out_offs`) = the first
    `count` splits' partials weighted by 2^lse. Split 0 always holds the first visible
    key, so its lse is finite; empty splits (lse = -inf) weigh 0. BLOCK_S > 0: that many
    splits' partials loaded at once (`set_combine_at_once`), else one split at a time."""
    row0 = rows * num_splits
    if BLOCK_S > 0:
        _combine_at_once(part_o_ptr, part_lse_ptr, out_ptr, row0, out_offs, count, head_dim,
                         dims, qmask, gmask, BLOCK_R, BLOCK_D, BLOCK_S, L2_ONLY)
        return
    m = tl.load(part_lse_ptr + row0, mask=gmask, other=0.0,
                cache_modifier=".cg" if L2_ONLY else "")
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    for split in range(0, count):
        lse = tl.load(part_lse_ptr + row0 + split, mask=gmask, other=float("-inf"),
                      cache_modifier=".cg" if L2_ONLY else "")
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        o = tl.load(part_o_ptr + (row0 + split)[:, None] * head_dim + dims[None, :],
                    mask=qmask, other=0.0, cache_modifier=".cg" if L2_ONLY else "")
        acc = acc * alpha[:, None] + o * w[:, None]
        total = total * alpha + w
        m = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + out_offs[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=qmask)


@triton.jit
def _combine_at_once(part_o_ptr, part_lse_ptr, out_ptr, row0, out_offs, count, head_dim,
                     dims, qmask, gmask, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_S: tl.constexpr, L2_ONLY: tl.constexpr):
    """`_combine_splits` with BLOCK_S splits' partials a load: one round trip to memory
    for a few splits, where the loop one split at a time waits for each in turn."""
    s = tl.arange(0, BLOCK_S)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s0 in range(0, count, BLOCK_S):
        at = row0[:, None] + s0 + s[None, :]  # [BLOCK_R, BLOCK_S]
        smask = gmask[:, None] & (s0 + s[None, :] < count)
        lse = tl.load(part_lse_ptr + at, mask=smask, other=float("-inf"),
                      cache_modifier=".cg" if L2_ONLY else "")
        o = tl.load(part_o_ptr + at[:, :, None] * head_dim + dims[None, None, :],
                    mask=smask[:, :, None] & qmask[:, None, :], other=0.0,
                    cache_modifier=".cg" if L2_ONLY else "")
        m_new = tl.maximum(m, tl.max(lse, 1))
        # Rows left out (gmask) see only -inf: subtract 0 instead to avoid NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        w = tl.exp2(lse - m_use[:, None])
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], axis=1)
        total = total * alpha + tl.sum(w, 1)
        m = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + out_offs[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=qmask)


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    counter_ptr,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ot, stride_oh,
    num_heads, num_kv_heads, num_splits, min_split_keys, scale, softcap, window, head_dim,
    group,
    QLEN: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    ROW_WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, LAST_COMBINES: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    """A program: one (sequence, kv head, split). Its rows are (token, head of the GQA
    group) pairs, row r = token r // BLOCK_G, head r % BLOCK_G, for the sequence's QLEN
    new tokens (its last: token t at position seq_len - QLEN + t)."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Read before the dependent-launch wait: the lengths are written before the step's
    # kernels start (by copies, or by kernels before its graph), never by the kernel right
    # before this one, which stores the new keys and values. So splits without keys end
    # before the wait, and a launch made for long sequences (a graph's: up to 64 splits of
    # each kv head) does not keep the SMs with programs that only wait and leave.
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if WINDOW:  # the first token's window, the earliest
        lo = tl.maximum(seq_len - QLEN + 1 - window, 0)
    # Split-K: the visible keys [lo, seq_len) are cut into chunks of whole tiles, at least
    # min_split_keys each, so a short sequence in a launch made for long ones (a CUDA
    # graph's) uses only the first `live` splits; the rest are empty and report
    # lse = -inf, or, where the last split combines, take no part at all.
    span = seq_len - lo
    chunk = tl.cdiv(tl.maximum(tl.cdiv(span, num_splits), min_split_keys), BLOCK_N) * BLOCK_N
    live = tl.cdiv(span, chunk)
    if LAST_COMBINES:  # noqa: SIM102 (a constexpr branch: the runtime test is not compiled in)
        if split >= live:
            return
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    s_lo = lo + split * chunk
    s_hi = tl.minimum(s_lo + chunk, seq_len)

    r = tl.arange(0, BLOCK_R)
    tok = r // BLOCK_G
    g = r % BLOCK_G
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    token = seq * QLEN + tok  # the row's token in q and out
    rmask = (tok < QLEN) & (g < group)
    qmask = rmask[:, None] & (dims[None, :] < head_dim)
    q = tl.load(q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh
                + dims[None, :], mask=qmask, other=0.0)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    q_pos = (seq_len - QLEN + tok).to(tl.int32)
    # The range is clipped to the keys some token sees: per-element masks (CAUSAL,
    # ROW_WINDOW) only where the tokens are several, each with its position and window.
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, q_pos, kc_ptr, vc_ptr, bt_ptr + seq * stride_bt, s_lo, s_hi,
        kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        scale, softcap, window, head_dim,
        BLOCK_SIZE, BLOCK_N, BLOCK_D, CAUSAL, SOFTCAP, ROW_WINDOW, PRECISION,
    )
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    rows = token * num_heads + heads
    out_offs = token * stride_ot + heads * stride_oh
    out_ptrs = out_ptr + out_offs[:, None] + dims[None, :]
    if SPLIT:
        if LAST_COMBINES:
            if live == 1:  # the only split with keys: nothing to combine
                tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=qmask)
            else:
                _store_partial(part_o_ptr, part_lse_ptr, o, l_i, m_i, rows, num_splits,
                               split, head_dim, dims, qmask, rmask)
                # The last live split of (seq, kv head) to finish combines them, instead
                # of a second launch. The barrier puts every thread's partial stores
                # before the atomic, which publishes them (release) and orders the
                # combining reads after it (acquire); the counter goes back to 0 for the
                # next launch.
                tl.debug_barrier()
                counter = counter_ptr + seq * num_kv_heads + kv_head
                if tl.atomic_add(counter, 1, sem="acq_rel") == live - 1:
                    _combine_splits(part_o_ptr, part_lse_ptr, out_ptr, rows, out_offs,
                                    num_splits, live, head_dim, dims, qmask, rmask, BLOCK_R,
                                    BLOCK_D, True, BLOCK_S)
                    tl.atomic_xchg(counter, 0, sem="relaxed")
        else:
            _store_partial(part_o_ptr, part_lse_ptr, o, l_i, m_i, rows, num_splits, split,
                           head_dim, dims, qmask, rmask)
    else:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _store_partial(part_o_ptr, part_lse_ptr, o, l_i, m_i, rows, num_splits, split, head_dim,
                   dims, qmask, gmask):
    """A split's partial of output rows `rows` (token * num_heads + head): o normalised
    within the split, lse = m + log2(l) (base 2; -inf for a split without keys)."""
    row = rows * num_splits + split
    tl.store(part_o_ptr + row[:, None] * head_dim + dims[None, :], o, mask=qmask)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    tl.store(part_lse_ptr + row, lse, mask=gmask)


@triton.jit
def _reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_heads, num_splits,
    head_dim, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    heads = head + tl.arange(0, 1)
    dims = tl.arange(0, BLOCK_D)
    qmask = (heads[:, None] >= 0) & (dims[None, :] < head_dim)
    _combine_splits(part_o_ptr, part_lse_ptr, out_ptr, token * num_heads + heads,
                    token * stride_ot + heads * stride_oh, num_splits, num_splits, head_dim,
                    dims, qmask, heads >= 0, 1, BLOCK_D, False)


# Lengths that change from step to step are not specialised on (Triton would compile
# another variant the first time one is a multiple of 16: ~0.5 s in the middle of serving).
@triton.jit(do_not_specialize=["stride_bt", "num_seqs"])
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr, tile_start_ptr,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ot, stride_oh,
    scale, softcap, window, head_dim, group, num_seqs,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr, PRECISION: tl.constexpr, TILED: tl.constexpr,
):
    kv_head = tl.program_id(2)
    if TILED:
        # Program t takes query tile t of the step: tile_start[i] is the first tile of
        # sequence i (tile_start[num_seqs]: the total). Programs past it have nothing to do.
        t = tl.program_id(0)
        if t >= tl.load(tile_start_ptr + num_seqs):
            return
        lo_s = 0
        hi_s = num_seqs - 1
        while lo_s < hi_s:  # the last sequence whose first tile is <= t
            mid = (lo_s + hi_s + 1) // 2
            if tl.load(tile_start_ptr + mid) <= t:
                lo_s = mid
            else:
                hi_s = mid - 1
        seq = lo_s.to(tl.int64)
        qblk = t - tl.load(tile_start_ptr + seq)
    else:
        seq = tl.program_id(0).to(tl.int64)
        qblk = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # the new tokens are the last q_len of the sequence

    # Tile rows are (token, head-in-group) pairs: row r = token (r // BLOCK_G), head (r % BLOCK_G).
    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    tok = qblk * BLOCK_Q + r // BLOCK_G
    g = r % BLOCK_G
    dims = tl.arange(0, BLOCK_D)
    rmask = (tok < q_len) & (g < group)
    qmask = rmask[:, None] & (dims[None, :] < head_dim)
    heads = kv_head * group + g
    q = tl.load(q_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_qt
                + heads[:, None] * stride_qh + dims[None, :], mask=qmask, other=0.0)
    q_pos = ctx + tok
    first = ctx + qblk * BLOCK_Q
    hi = tl.minimum(first + BLOCK_Q, seq_len)
    lo = 0
    if WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    if qblk * BLOCK_Q >= q_len:
        hi = lo
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, q_pos, kc_ptr, vc_ptr, bt_ptr + seq * stride_bt, lo, hi,
        kv_head, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        scale, softcap, window, head_dim,
        BLOCK_SIZE, BLOCK_N, BLOCK_D, True, SOFTCAP, WINDOW, PRECISION,
    )
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_ot
             + heads[:, None] * stride_oh + dims[None, :],
             o.to(out_ptr.dtype.element_ty), mask=qmask)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    assert q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        q.shape, k_cache.shape, v_cache.shape)
    num_heads, head_dim = q.shape[1:]
    assert k_cache.shape[3] == head_dim and num_heads % k_cache.shape[2] == 0, (
        q.shape, k_cache.shape)
    # Kernels address the head dim (and block-table columns) as `base + index`.
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert block_tables.dim() == 2 and (block_tables.stride(1) == 1 or
                                        block_tables.shape[1] <= 1)
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    # The cache in q's dtype, or FP8 (attention/kv_dtype.py: made q's dtype as it is read)
    assert k_cache.dtype == v_cache.dtype in (q.dtype, torch.float8_e4m3fn), (q.dtype,
                                                                          k_cache.dtype)
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert q.device == k_cache.device == block_tables.device == seq_lens.device


def _common(q: torch.Tensor, k_cache: torch.Tensor, scale: float,
            sliding_window: int | None, logit_softcap: float | None) -> dict:
    return dict(
        scale=float(scale), softcap=float(logit_softcap or 0.0),
        window=int(sliding_window or 0), head_dim=q.shape[2],
        group=q.shape[1] // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1],
        SOFTCAP=bool(logit_softcap), WINDOW=sliding_window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


MIN_SPLIT_KEYS = 256
SMALL_GRID_SPLIT_KEYS = 64
# Tokens a sequence may bring to the decode kernel: fewer than a tile of keys, so that the
# first split holds a key every token sees (the splits' combination starts from it).
MAX_DECODE_QUERIES = 16


def split_keys(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Keys a decode split takes at least. Where the (sequence, kv head) programs are
    fewer than the GPU's SMs (batch 1 to ~16), each one's walk over the keys is the
    kernel's latency, so splits of a tile or so; otherwise 256, so that a full GPU adds no
    partials to combine. Measured on an H200 (docs/performance.md): 64 against 256 keys
    took the Llama-3.2-1B batch-1 step 0.90 -> 0.87 ms and Gemma 3 4B's 3.23 -> 2.96 ms,
    and the 8B's batch-32 step 5.11 -> 5.22 ms, hence 256 on full GPUs."""
    if num_seqs * num_kv_heads < sm_count(device):
        return SMALL_GRID_SPLIT_KEYS
    return MIN_SPLIT_KEYS


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                       device: torch.device) -> int:
    """Split-K factor of a decode launch (the Triton attention backend's policy): enough
    (seq, kv head, split) programs to fill the GPU about twice, but at least `split_keys`
    keys per split; a power of 2 so few kernel variants get compiled."""
    want = triton.cdiv(2 * sm_count(device), max(num_seqs * num_kv_heads, 1))
    keys = split_keys(num_seqs, num_kv_heads, device)
    splits = max(1, min(want, triton.cdiv(max_seq_len, keys), 64))
    return triton.next_power_of_2(splits)


_combining_at_once = False  # EngineConfig.decode_combine_at_once, set by the runner's set-up
# Floats a thread holds of a combine's tile of partials ([rows, splits, head_dim]) at most:
# compiled for sm_90, the 8B's one-sequence launch (8 warps) takes 252 registers with 8
# splits at once (193 one at a time), no spills.
COMBINE_FLOATS_PER_THREAD = 64


def set_combine_at_once(on: bool) -> None:
    """Whether the last split of a decode launch loads several splits' partials at once
    (`_combine_at_once`) instead of one split at a time."""
    global _combining_at_once
    _combining_at_once = on


def combine_block(num_splits: int, block_rows: int, block_d: int, num_warps: int) -> int:
    """The splits a combine loads at once (0: one at a time): up to the launch's splits,
    COMBINE_FLOATS_PER_THREAD a thread at most, where `set_combine_at_once`."""
    if not _combining_at_once:
        return 0
    tile = COMBINE_FLOATS_PER_THREAD * 32 * num_warps
    most = max(1, tile // (block_rows * block_d))
    return min(triton.next_power_of_2(num_splits), 1 << (most.bit_length() - 1))


def decode_launch(head_dim: int, num_seqs: int) -> tuple[int, int]:
    """(keys per tile, warps) of a decode launch. Head size 128 was tuned on the H100
    (benchmarks/decode_attention_tuning.py): 128 keys and 4 warps beat 64 and 8 by 5-20 %
    from batch 1 to 256. But that launch takes 255 registers and spills (ptxas -v, sm_90);
    for one sequence's one-token step 64 keys and 8 warps (193 registers, no spill) took an
    H200's 8B batch-1 step 4.08 -> 4.04 ms (`spec_cost_h200_s49b_*.json`) and 4.106 ->
    4.083 / 4.091 (`decode_h200_s49c_*.json`), INT8 2.638 -> 2.630; at batch 8 it lost
    (4.397 -> 4.429). A lone sequence's verify step of 5 tokens took it too: the queued
    drafted step 6.746 / 6.751 against 6.770 / 6.779 ms (`spec_cost_h200_s50b_*.json`;
    64 keys and 4 warps 6.790). Other head sizes keep the untuned launch."""
    if head_dim == 128:
        return (64, 8) if num_seqs == 1 else (128, 4)
    return (64 if head_dim < 128 else 32), 8


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
    block_tables: torch.Tensor, scale: float, sliding_window: int | None = None,
    logit_softcap: float | None = None, num_splits: int = 1,
    out: torch.Tensor | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
    split_counters: torch.Tensor | None = None, min_split_keys: int | None = None,
    query_len: int = 1,
) -> torch.Tensor:
    """`query_len` new queries per sequence (`q[query_len * i + t]` is sequence i's token
    at position seq_lens[i] - query_len + t, its K/V and those of the tokens before it
    already stored; each sees the keys up to its own position). Launch shape depends
    only on `q.shape`, `query_len` and `num_splits`, never on sequence lengths. `block_n`
    (keys per tile), `num_warps` and `num_stages` override the tuned launch
    (benchmarks/decode_attention_tuning.py).

    Split (num_splits > 1), each split takes at least `min_split_keys` keys (default:
    `split_keys`; a sequence too short for all of them leaves the last ones empty), and
    the splits' partials are combined by a second launch, or, given `split_counters`
    (int32, zeros, at least `num_seqs * kv_heads`; left zero after each launch), by the
    last split of each (sequence, kv head) to finish: one launch fewer, for CUDA graphs,
    whose buffers can hold the counters between replays; there empty splits end at once,
    and a sequence with one live split writes its output without partials."""
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert 1 <= query_len <= MAX_DECODE_QUERIES and num_tokens % query_len == 0, (
        num_tokens, query_len)
    num_seqs = num_tokens // query_len
    assert seq_lens.shape == (num_seqs,) and block_tables.shape[0] == num_seqs
    assert num_splits >= 1
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.stride(2) == 1 and out.dtype == q.dtype
    if num_seqs == 0:
        return out
    common = _common(q, k_cache, scale, sliding_window, logit_softcap)
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Rows per token: the GQA group, to a power of 2; one token alone pads to 16 rows
    # (tl.dot's least), as the kernel always had.
    group = triton.next_power_of_2(common["group"])
    block_g = max(16, group) if query_len == 1 else group
    block_rows = max(16, triton.next_power_of_2(query_len) * block_g)
    split = num_splits > 1
    if min_split_keys is None:
        min_split_keys = split_keys(num_seqs, num_kv_heads, q.device)
    if split:
        part_o = torch.empty(num_tokens, num_heads, num_splits, head_dim,
                             dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_tokens, num_heads, num_splits,
                               dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    last_combines = split and split_counters is not None
    default_block_n, default_warps = decode_launch(head_dim, num_seqs)
    if last_combines:
        assert split_counters.dtype == torch.int32 and split_counters.is_contiguous()
        assert split_counters.numel() >= num_seqs * num_kv_heads, split_counters.shape
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse,
        split_counters if last_combines else seq_lens,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        num_heads, num_kv_heads, num_splits, min_split_keys, **common,
        QLEN=query_len, BLOCK_G=block_g,
        BLOCK_R=block_rows,
        CAUSAL=query_len > 1, ROW_WINDOW=query_len > 1 and sliding_window is not None,
        BLOCK_N=block_n or default_block_n,
        BLOCK_D=block_d, SPLIT=split, LAST_COMBINES=last_combines,
        BLOCK_S=(combine_block(num_splits, block_rows, block_d, num_warps or default_warps)
                 if last_combines else 0),
        num_warps=num_warps or default_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
        **dependent_launch.launch_options(),
    )
    if split and not last_combines:
        _reduce_kernel[(num_tokens, num_heads)](
            part_o, part_lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
            head_dim, BLOCK_D=block_d, num_warps=4, **dependent_launch.launch_options(),
        )
    return out


def prefill_block_q(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Query tokens per program of the prefill kernel (its tiles hold tokens x the heads of
    one GQA group). Sizes chosen from the sm_90 resource report: no spills at D=128 (181
    registers); D=256 still spills a little (40 B of stack)."""
    block_m = 128 if head_dim <= 128 else 64
    block_g = triton.next_power_of_2(num_heads // num_kv_heads)
    assert block_g <= block_m, f"GQA group {num_heads // num_kv_heads} too large"
    return block_m // block_g


def paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
    max_query_len: int, scale: float, sliding_window: int | None = None,
    logit_softcap: float | None = None, out: torch.Tensor | None = None,
    tile_start: torch.Tensor | None = None, max_tiles: int = 0,
) -> torch.Tensor:
    """Causal attention of the flattened new tokens `[T, H, D]` (sequence i owns rows
    query_start_loc[i]:query_start_loc[i+1], the last tokens of its seq_lens[i]) over the
    paged cache, which already holds their K/V and any cached prefix.

    With `tile_start` (int32 `[num_seqs + 1]`: prefix sums of each sequence's query tiles
    of `prefill_block_q` tokens) the launch is `max_tiles` programs per kv head, whatever
    the lengths, so a CUDA graph can hold it; `max_query_len` is then unused."""
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    head_dim = q.shape[2]
    assert query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype == torch.int32
    assert block_tables.shape[0] == num_seqs
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.stride(2) == 1 and out.dtype == q.dtype
    tiled = tile_start is not None
    if num_seqs == 0 or (max_tiles if tiled else max_query_len) == 0:
        return out
    common = _common(q, k_cache, scale, sliding_window, logit_softcap)
    block_q = prefill_block_q(q.shape[1], num_kv_heads, head_dim)
    grid = ((max_tiles, 1, num_kv_heads) if tiled else
            (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        tile_start if tiled else seq_lens,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), **common, num_seqs=num_seqs,
        BLOCK_Q=block_q, BLOCK_G=triton.next_power_of_2(common["group"]),
        BLOCK_N=32 if head_dim <= 128 else 16, TILED=tiled,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=8, num_stages=2,
    )
    return out
