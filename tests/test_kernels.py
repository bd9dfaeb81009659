"""Triton kernels vs their torch references, in the Triton interpreter on the CPU.

Small random shapes, fresh inputs per case, outputs poisoned (NaN) before each run.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from infer.kernels import triton_available

if not triton_available():
    pytest.skip("triton is not installed (pip install triton; Linux x86-64 only)",
                allow_module_level=True)

from token_masks import allowed_by, random_token_masks

from infer.attention import torch_backend
from infer.attention.metadata import AttentionMetadata
from infer.attention.triton_backend import paged_attention_kernels
from infer.kernels import reference as ref
from infer.kernels.activation import geglu_tanh, swiglu
from infer.kernels.argmax import BLOCK, argmax_rows
from infer.kernels.kv_store import store_kv
from infer.kernels.paged_attention import paged_decode, paged_prefill, prefill_block_q
from infer.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
from infer.kernels.rope import rope_
from infer.kernels.rope_kv_store import rope_store_kv
from infer.models.layers import RMSNorm

# conftest.py sets TRITON_INTERPRET (1 unless INFER_TEST_DEVICE asks for a GPU run).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def assert_close(out: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert torch.isfinite(out).all(), "non-finite (unwritten?) output"
    err = (out.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= rel * scale + 1e-6, f"max error {err:.3g} vs max |ref| {scale:.3g}"


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE)


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 80)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rmsnorm(shape: tuple[int, ...], offset: float) -> None:
    x, w = randn(*shape) * 3, randn(shape[-1])
    assert_close(rmsnorm(x, w, 1e-6, offset), ref.rmsnorm_ref(x, w, 1e-6, offset))


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fused_add_rmsnorm(offset: float) -> None:
    x, residual, w = randn(6, 96), randn(6, 96), randn(96)
    expected_out, expected_res = ref.fused_add_rmsnorm_ref(x, residual, w, 1e-5, offset)
    out, res = fused_add_rmsnorm(x, residual, w, 1e-5, offset)
    assert res.data_ptr() == residual.data_ptr(), "residual must be updated in place"
    assert_close(res, expected_res)
    assert_close(out, expected_out)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rmsnorm_bf16_bit_exact(bf16_rounds_to_nearest, offset: float) -> None:
    """Kernel, fused kernel, torch path and reference all round as transformers does."""
    rows, dim, eps = 16, 200, 1e-6
    x = (randn(rows, dim) * 3).bfloat16()
    residual = (randn(rows, dim) * 3).bfloat16()
    w = (randn(dim) * 0.2 + (0.0 if offset else 1.0)).bfloat16()
    norm = RMSNorm(dim, eps, offset).to(device=DEVICE, dtype=torch.bfloat16)
    norm.weight.data.copy_(w)
    with torch.no_grad():
        expected = norm(x)
        expected_fused, expected_sum = norm(x, residual.clone())
    assert expected.dtype == torch.bfloat16
    assert torch.equal(rmsnorm(x, w, eps, offset), expected)
    assert torch.equal(ref.rmsnorm_ref(x, w, eps, offset), expected)
    out, summed = fused_add_rmsnorm(x, residual.clone(), w, eps, offset)
    assert torch.equal(summed, expected_sum)
    assert torch.equal(out, expected_fused)
    pytest.importorskip("transformers")
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = (Gemma3RMSNorm if offset else LlamaRMSNorm)(dim, eps=eps)
    hf = hf.to(device=DEVICE, dtype=torch.bfloat16)
    hf.weight.data.copy_(w)
    with torch.no_grad():
        assert torch.equal(hf(x), expected)


@pytest.mark.parametrize("head_dim", [64, 80])
def test_rope_in_place_on_qkv_views(head_dim: int) -> None:
    tokens, heads, kv_heads, max_pos = 7, 4, 2, 50
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim)
    before = qkv.clone()
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angles = torch.rand(max_pos, head_dim // 2, device=DEVICE) * 6.3
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    expected_q, expected_k = ref.rope_ref(q.clone(), k.clone(), cos, sin, positions)
    rope_(q, k, cos, sin, positions)
    assert_close(q, expected_q)
    assert_close(k, expected_k)
    v_cols = slice((heads + kv_heads) * head_dim, None)
    assert torch.equal(qkv[:, v_cols], before[:, v_cols]), "v must be untouched"


@pytest.mark.parametrize(("kernel", "reference"), [(swiglu, ref.swiglu_ref),
                                                   (geglu_tanh, ref.geglu_tanh_ref)])
def test_gated_activations(kernel, reference) -> None:
    gate_up = randn(5, 2 * 96) * 4
    assert_close(kernel(gate_up), reference(gate_up))


def test_store_kv_skips_minus_one() -> None:
    num_blocks, block_size, kv_heads, head_dim, tokens = 6, 4, 2, 64, 9
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[3] = -1
    k, v = randn(tokens, kv_heads, head_dim), randn(tokens, kv_heads, head_dim)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"),
                         device=DEVICE)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    torch_backend.write_kv(k_ref, v_ref, k, v, slots)
    store_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))


@pytest.mark.parametrize(("head_dim", "norm", "dtype"), [
    (64, None, torch.float32), (80, 0.0, torch.float32), (64, 1.0, torch.float32),
    (64, 0.0, torch.bfloat16), (128, 1.0, torch.bfloat16)])
def test_rope_store_kv_equals_the_unfused_kernels(head_dim: int, norm: float | None,
                                                  dtype: torch.dtype) -> None:
    """The fused prologue + store against the references one after the other (q/k norm,
    RoPE, the store), on q/k/v views of one qkv row as the models pass them."""
    tokens, heads, kv_heads, max_pos, blocks, block_size = 7, 6, 2, 50, 5, 4
    qkv = (randn(tokens, (heads + 2 * kv_heads) * head_dim) * 2).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = q.view(tokens, heads, head_dim)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    angles = torch.rand(max_pos, head_dim // 2, device=DEVICE) * 6.3
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    slots = torch.randperm(blocks * block_size, device=DEVICE)[:tokens]
    slots[2] = -1
    q_w, k_w = randn(head_dim).to(dtype), randn(head_dim).to(dtype)
    exp_q, exp_k = q.clone(), k.clone()
    if norm is not None:
        exp_q = ref.rmsnorm_ref(exp_q, q_w, 1e-6, norm)
        exp_k = ref.rmsnorm_ref(exp_k, k_w, 1e-6, norm)
    exp_q, exp_k = ref.rope_ref(exp_q, exp_k, cos, sin, positions)
    k_cache = torch.full((blocks, block_size, kv_heads, head_dim), float("nan"),
                         device=DEVICE, dtype=dtype)
    v_cache = k_cache.clone()
    exp_kc, exp_vc = k_cache.clone(), v_cache.clone()
    torch_backend.write_kv(exp_kc, exp_vc, exp_k, v, slots)
    q_before, k_before, v_before = q.clone(), k.clone(), v.clone()

    out = rope_store_kv(q, k, v, k_cache, v_cache, slots, positions, cos, sin,
                        q_w if norm is not None else None, k_w if norm is not None else None,
                        1e-6, norm or 0.0)
    assert out is q
    # bf16: the norm's float32 sum runs in another order, so a value may round one ulp off.
    rel = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close(q, exp_q, rel)
    assert_close(k_cache.nan_to_num(7.0), exp_kc.nan_to_num(7.0), rel)
    assert torch.equal(v_cache.nan_to_num(7.0), exp_vc.nan_to_num(7.0))
    assert torch.equal(k, k_before) and torch.equal(v, v_before), "k and v are only read"
    if dtype == torch.bfloat16:
        # The unfused kernels round bf16 as this one does (the interpreter's rounding
        # too): equal but for a rare one-ulp difference from the norm's summation order.
        unfused_q, unfused_k = q_before.clone(), k_before.clone()
        if norm is not None:
            unfused_q = rmsnorm(unfused_q, q_w, 1e-6, norm)
            unfused_k = rmsnorm(unfused_k, k_w, 1e-6, norm)
        rope_(unfused_q, unfused_k, cos, sin, positions)
        stored = k_cache.view(-1, kv_heads, head_dim)[slots[slots >= 0]]
        assert (q == unfused_q).float().mean().item() > 0.98
        assert (stored == unfused_k[slots >= 0]).float().mean().item() > 0.98


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows(dtype: torch.dtype) -> None:
    """Rows of one part and of several (the last one ragged); ties go to the lowest index,
    as torch's, also across parts; a -inf row (every token banned) gives column 0."""
    for rows, cols in [(1, 50), (4, 2 * BLOCK + 7)]:
        x = (randn(rows, cols) * 4).to(dtype)
        x[0, 3] = x[0, -1] = x[0].max() + 1
        if rows > 1:
            x[1, BLOCK + 5] = x[1, 2 * BLOCK + 1] = x[1].max() + 1
            x[2] = float("-inf")
        assert torch.equal(argmax_rows(x), x.float().argmax(dim=-1))


def test_argmax_rows_leaves_its_counters_at_zero_launch_after_launch() -> None:
    """Each row's last part picks the row's best (a counter per row): launches of other
    sizes back to back, each right, the counters zero after each."""
    from infer.kernels import launch_counters
    from infer.kernels.argmax import MAX_ROWS

    for rows in [3, 40, 3, 17] * (5 if DEVICE != "cpu" else 1):
        x = randn(rows, 3 * BLOCK + 11)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
        assert not launch_counters("argmax", x.device, MAX_ROWS).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_among_the_tokens_masks_allow(dtype: torch.dtype) -> None:
    rows, cols = 5, 2 * BLOCK + 7
    x = (randn(rows, cols) * 4).to(dtype)
    masks = random_token_masks(rows, cols)
    x[2, 5] = float("nan")  # a NaN counts as the largest value where it is allowed
    masks[2, 0] |= 1 << 5
    x[3, 9] = float("nan")
    masks[3, 0] &= ~(1 << 9)  # and not where the mask refuses it
    want = x.float().cpu().masked_fill(~allowed_by(masks, cols), float("-inf"))
    want[2, 5] = float("inf")
    want[3, 9] = float("-inf")
    got = argmax_rows(x.to(DEVICE), masks.to(DEVICE)).cpu()
    assert torch.equal(got, want.argmax(dim=-1))
    assert got[1] == 40


def _paged_case(query_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int,
                head_dim: int, block_size: int = 16):
    """Random q and a pool with scattered block tables. Returns the metadata, q, the pool
    for the kernel (unused slots NaN: any read of them shows) and the reference's pool
    (unused slots 0)."""
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks).tolist()
    tables, used = [], torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for n, s in zip(need, seq_lens):
        tables.append(order[:n])
        order = order[n:]
        used.view(-1)[torch.tensor([tables[-1][p // block_size] * block_size + p % block_size
                                    for p in range(s)], dtype=torch.long)] = True
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, DEVICE)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_ref, v_ref = randn(*shape), randn(*shape)
    used = used.to(DEVICE)[:, :, None, None]
    k_ref, v_ref = k_ref * used, v_ref * used
    nan = torch.tensor(float("nan"), device=DEVICE)
    k_cache, v_cache = torch.where(used, k_ref, nan), torch.where(used, v_ref, nan)
    q = randn(sum(query_lens), heads, head_dim)
    return meta, q, (k_cache, v_cache), (k_ref, v_ref)


ATTN_CASES = [
    # heads, kv_heads, head_dim, window, softcap
    (2, 2, 64, None, None),
    (4, 2, 64, 20, None),
    (8, 2, 64, None, 30.0),
    (6, 2, 80, 7, 20.0),
    (4, 2, 128, None, None),  # the tuned decode launches (paged_attention.decode_launch)
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "window", "softcap"), ATTN_CASES)
@pytest.mark.parametrize(("num_splits", "counters", "min_keys"),
                         [(1, False, 256), (3, False, 16), (3, True, 16), (4, True, 256)])
def test_paged_decode(heads, kv_heads, head_dim, window, softcap, num_splits,
                      counters, min_keys) -> None:
    """Split, the partials are combined by a second launch, or (`counters`) by the last
    split to finish, which leaves the counters at zero for the next launch. With at least
    `min_keys` keys a split, the shorter sequences have fewer live splits than the launch
    (256: each but the longest one only)."""
    seq_lens = [1, 40, 17, 66, 300]
    meta, q, (k_cache, v_cache), (k_ref, v_ref) = _paged_case(
        [1] * len(seq_lens), seq_lens, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    expected = torch_backend.paged_attention(q, k_ref, v_ref, meta, scale, window, softcap)
    split_counters = (torch.zeros(len(seq_lens) * kv_heads + 3, dtype=torch.int32,
                                  device=DEVICE) if counters else None)
    for _ in range(2 if counters else 1):
        out = torch.full_like(q, float("nan"))
        paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale, window,
                     softcap, num_splits=num_splits, out=out, split_counters=split_counters,
                     min_split_keys=min_keys)
        assert_close(out, expected)
        if counters:
            assert not split_counters.any(), "the counters must be back at zero"


@pytest.mark.parametrize(("block_n", "warps"), [(64, 8), (128, 4)])
@pytest.mark.parametrize(("num_splits", "counters"), [(1, False), (3, True)])
@pytest.mark.parametrize("query_len", [1, 5])
def test_both_decode_launches_of_head_size_128(block_n, warps, num_splits, counters,
                                               query_len) -> None:
    """`decode_launch`'s two launches for head size 128 (64 keys a tile and 8 warps for a
    lone sequence's step, 128 and 4 otherwise), each against the reference, for one token
    a sequence and for a verify step's five."""
    seq_lens = [5, 63, 64, 65, 300]
    meta, q, (k_cache, v_cache), (k_ref, v_ref) = _paged_case(
        [query_len] * len(seq_lens), seq_lens, 8, 2, 128)
    scale = 128 ** -0.5
    expected = torch_backend.paged_attention(q, k_ref, v_ref, meta, scale)
    split_counters = (torch.zeros(len(seq_lens) * 2, dtype=torch.int32, device=DEVICE)
                      if counters else None)
    out = torch.full_like(q, float("nan"))
    paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale,
                 num_splits=num_splits, out=out, split_counters=split_counters,
                 min_split_keys=block_n, block_n=block_n, num_warps=warps,
                 query_len=query_len)
    assert_close(out, expected)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "window", "softcap"), ATTN_CASES)
@pytest.mark.parametrize(("num_splits", "counters"), [(1, False), (3, True), (4, False)])
@pytest.mark.parametrize("query_len", [2, 5])
def test_paged_decode_of_several_tokens_per_sequence(heads, kv_heads, head_dim, window,
                                                     softcap, num_splits, counters,
                                                     query_len) -> None:
    """A verify step's shape: every sequence brings `query_len` tokens, each attending up
    to its own position (and within its own window), split or not, as the reference's
    causal attention; one sequence no longer than its new tokens."""
    seq_lens = [query_len, 40, 17, 66, 300]
    meta, q, (k_cache, v_cache), (k_ref, v_ref) = _paged_case(
        [query_len] * len(seq_lens), seq_lens, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    expected = torch_backend.paged_attention(q, k_ref, v_ref, meta, scale, window, softcap)
    split_counters = (torch.zeros(len(seq_lens) * kv_heads, dtype=torch.int32,
                                  device=DEVICE) if counters else None)
    for _ in range(2 if counters else 1):
        out = torch.full_like(q, float("nan"))
        paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale, window,
                     softcap, num_splits=num_splits, out=out, split_counters=split_counters,
                     min_split_keys=16, query_len=query_len)
        assert_close(out, expected)
        if counters:
            assert not split_counters.any(), "the counters must be back at zero"


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "window", "softcap"), ATTN_CASES)
@pytest.mark.parametrize(("num_splits", "min_keys", "query_len", "tile"),
                         [(3, 16, 1, 64), (8, 16, 1, 64), (24, 16, 1, 8), (4, 256, 1, 64),
                          (8, 16, 5, 64), (8, 16, 5, 16)])
def test_the_last_split_combines_the_partials_at_once(heads, kv_heads, head_dim, window,
                                                      softcap, num_splits, min_keys,
                                                      query_len, tile, monkeypatch) -> None:
    """`set_combine_at_once`: the last split loads several splits' partials a load (with
    a smaller tile, more live splits than a load holds, in several; live splits fewer
    than the launch's; a verify step's five tokens), the reference's attention, the
    counters back at zero."""
    from infer.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "COMBINE_FLOATS_PER_THREAD", tile)

    seq_lens = [query_len, 40, 17, 66, 300]
    meta, q, (k_cache, v_cache), (k_ref, v_ref) = _paged_case(
        [query_len] * len(seq_lens), seq_lens, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    expected = torch_backend.paged_attention(q, k_ref, v_ref, meta, scale, window, softcap)
    split_counters = torch.zeros(len(seq_lens) * kv_heads, dtype=torch.int32, device=DEVICE)
    try:
        paged_attention.set_combine_at_once(True)
        for _ in range(2):
            out = torch.full_like(q, float("nan"))
            paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale,
                         window, softcap, num_splits=num_splits, out=out,
                         split_counters=split_counters, min_split_keys=min_keys,
                         query_len=query_len)
            assert_close(out, expected)
            assert not split_counters.any(), "the counters must be back at zero"
    finally:
        paged_attention.set_combine_at_once(False)


def test_a_combine_loads_as_many_splits_as_its_threads_hold() -> None:
    """`combine_block`: the launch's splits to a power of 2, COMBINE_FLOATS_PER_THREAD a
    thread at most; 0 (one split at a time) unless set."""
    from infer.kernels import paged_attention
    from infer.kernels.paged_attention import COMBINE_FLOATS_PER_THREAD, combine_block

    assert combine_block(16, 16, 64, 8) == 0
    try:
        paged_attention.set_combine_at_once(True)
        assert combine_block(16, 16, 64, 8) == 16  # 1B, one sequence: 16 x 16 x 64 floats
        assert combine_block(16, 16, 128, 8) == 8  # 8B, one sequence's token
        assert combine_block(16, 16, 128, 4) == 4  # 8B, more sequences
        assert combine_block(16, 32, 128, 8) == 4  # a verify step's 5 tokens x 4 heads
        assert combine_block(3, 16, 64, 8) == 4
        assert combine_block(64, 64, 256, 4) == 1
        for splits, rows, dims, warps in [(16, 16, 64, 8), (64, 32, 128, 4), (5, 16, 256, 4)]:
            held = combine_block(splits, rows, dims, warps) * rows * dims / (32 * warps)
            assert held <= max(COMBINE_FLOATS_PER_THREAD, rows * dims / (32 * warps))
    finally:
        paged_attention.set_combine_at_once(False)


def test_decode_splits_take_a_tile_only_where_the_gpu_is_underfilled() -> None:
    from infer.kernels import sm_count
    from infer.kernels.paged_attention import (
        MIN_SPLIT_KEYS,
        SMALL_GRID_SPLIT_KEYS,
        default_num_splits,
        split_keys,
    )

    cpu = torch.device("cpu")
    sms = sm_count(cpu)
    assert split_keys(1, sms - 1, cpu) == SMALL_GRID_SPLIT_KEYS < MIN_SPLIT_KEYS
    assert split_keys(1, sms, cpu) == MIN_SPLIT_KEYS
    # One sequence of 300 keys, one kv head, 4 "SMs" on a CPU: min(2 x 4 programs to fill
    # them twice, 300 / 64 -> 5 splits of a tile) -> 5, rounded up to a power of 2.
    assert sms == 4
    assert default_num_splits(1, 1, 300, cpu) == 8
    assert default_num_splits(sms, 1, 300, cpu) == 2  # a full GPU: 256 keys a split


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "window", "softcap"), ATTN_CASES)
def test_paged_prefill_with_cached_prefix(heads, kv_heads, head_dim, window, softcap) -> None:
    # A fresh prompt (several query tiles when the group is > 1), a decode token, a chunk
    # after a cached prefix, an idle sequence.
    query_lens, seq_lens = [37, 1, 9, 0], [37, 30, 45, 12]
    meta, q, (k_cache, v_cache), (k_ref, v_ref) = _paged_case(
        query_lens, seq_lens, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    expected = torch_backend.paged_attention(q, k_ref, v_ref, meta, scale, window, softcap)
    out = paged_attention_kernels(q, k_cache, v_cache, meta, scale, window, softcap)
    assert_close(out, expected)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "window", "softcap"), ATTN_CASES)
def test_paged_prefill_tiled_launch(heads, kv_heads, head_dim, window, softcap) -> None:
    """The launch CUDA graphs hold: a fixed number of programs that find their sequence
    from the tile prefix sums; sequences without queries (one in the middle, padding rows
    at the end), and programs past the last tile, do nothing."""
    query_lens, seq_lens = [37, 1, 0, 9, 2, 0, 0], [37, 30, 12, 45, 2, 0, 0]
    meta, q, (k_cache, v_cache), (k_ref, v_ref) = _paged_case(
        query_lens, seq_lens, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    expected = torch_backend.paged_attention(q, k_ref, v_ref, meta, scale, window, softcap)
    block_q = prefill_block_q(heads, kv_heads, head_dim)
    starts = np.cumsum([0] + [-(-n // block_q) for n in query_lens]).tolist()
    tile_start = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                  0, scale, window, softcap, out=out, tile_start=tile_start,
                  max_tiles=starts[-1] + 5)
    assert_close(out, expected)


@pytest.mark.parametrize(("query_lens", "seq_lens", "window", "num_dense"), [
    # a decode, a short prompt, then a long prompt and a long chunk after a cached prefix
    ([1, 3, 9, 6], [20, 3, 9, 30], None, 2),
    ([8, 12], [40, 12], None, 2),  # every sequence long
    ([9, 1], [9, 12], None, 0),  # the long one is not at the end: all through our kernel
    ([9, 6], [9, 30], 5, 0),  # sliding window: our kernel
])
def test_triton_backend_sends_long_prefills_to_sdpa(monkeypatch, query_lens, seq_lens, window,
                                                   num_dense) -> None:
    from infer.attention import triton_backend

    monkeypatch.setattr(triton_backend, "DENSE_PREFILL_MIN_TOKENS", 6)
    calls = []
    real = triton_backend.dense_prefill
    monkeypatch.setattr(triton_backend, "dense_prefill",
                        lambda *args: calls.append(1) or real(*args))
    meta, q, (k_cache, v_cache), (k_ref, v_ref) = _paged_case(query_lens, seq_lens, 8, 2, 64,
                                                              block_size=4)
    expected = torch_backend.paged_attention(q, k_ref, v_ref, meta, 0.125, window)
    assert_close(triton_backend.paged_attention(q, k_cache, v_cache, meta, 0.125, window),
                 expected)
    assert len(calls) == num_dense


def test_paged_attention_dispatches_decode() -> None:
    meta, q, (k_cache, v_cache), (k_ref, v_ref) = _paged_case([1, 1], [5, 37], 4, 1, 64)
    expected = torch_backend.paged_attention(q, k_ref, v_ref, meta, 0.125)
    assert_close(paged_attention_kernels(q, k_cache, v_cache, meta, 0.125), expected)
