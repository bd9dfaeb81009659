"""infer's CPU decode attention (`kernels/cpu_attention.cpp`) against the torch reference
path it stands in for, on random paged caches; where it does not apply, the reference
runs."""

from __future__ import annotations

import pytest
import torch

from infer.attention import torch_backend
from infer.attention.metadata import AttentionMetadata
from infer.kernels import cpu_attention, cpu_extension

pytestmark = pytest.mark.skipif(not cpu_extension.available(),
                                reason="infer's CPU kernels cannot be built here")


@pytest.fixture
def kernel_on():
    """The kernel enabled (as by default) for the test, and again after it."""
    cpu_attention.set_enabled(True)
    yield
    cpu_attention.set_enabled(True)


def _step(lens: list[int], heads: int, kv_heads: int, dim: int, seed: int,
          block_size: int = 16, dtype: torch.dtype = torch.float32,
          cache_dtype: torch.dtype | None = None):
    """(q, k_cache, v_cache, metadata) of an all-decode step over random blocks; the caches
    of `cache_dtype` (default `dtype`)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // block_size) for n in lens) + 3
    k = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(cache_dtype or dtype)
    v = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(cache_dtype or dtype)
    order = torch.randperm(blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(order[used:used + count])
        used += count
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size,
                                   torch.device("cpu"))
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    return q, k, v, meta


def _reference(q, k, v, meta, scale, **kw) -> torch.Tensor:
    cpu_attention.set_enabled(False)
    try:
        return torch_backend.paged_attention(q, k, v, meta, scale, **kw)
    finally:
        cpu_attention.set_enabled(True)


def _kernel_and_reference(q, k, v, meta, scale, kw: dict, monkeypatch
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's attention with the kernel on (checked to have run) and the reference's."""
    calls = []
    real = cpu_attention.paged_decode
    monkeypatch.setattr(cpu_attention, "paged_decode",
                        lambda *a: calls.append(1) or real(*a))
    got = torch_backend.paged_attention(q, k, v, meta, scale, **kw)
    assert calls == [1]
    return got, _reference(q, k, v, meta, scale, **kw)


@pytest.mark.parametrize(("lens", "heads", "kv_heads", "dim"), [
    ([1], 9, 3, 64), ([100], 9, 3, 64), ([16, 17, 1, 250], 9, 3, 64), ([33, 5], 4, 4, 128),
    ([40, 41, 42], 8, 2, 80), ([7], 2, 1, 12)])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 16}, {"logit_softcap": 2.0},
                                {"sliding_window": 5, "logit_softcap": 30.0}])
def test_the_kernel_gives_the_torch_paths_attention(lens, heads, kv_heads, dim, kw, kernel_on,
                                                    monkeypatch):
    """Sequences of 1 key to several blocks' (block boundaries both sides), GQA groups of 1
    to 4, head sizes off the 8-lane step, a sliding window shorter and longer than the
    sequences (Gemma 3's local layers), a softcap that bends the scores (Gemma 2's): within
    float32 rounding of the reference, and the kernel is what ran."""
    q, k, v, meta = _step(lens, heads, kv_heads, dim, seed=len(lens) * dim)
    q = q * 3  # scores past the softcap's knee
    got, want = _kernel_and_reference(q, k, v, meta, dim ** -0.5, kw, monkeypatch)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize(("lens", "heads", "kv_heads", "dim"), [
    ([16, 17, 1, 250], 9, 3, 64), ([40, 41, 42], 8, 2, 80), ([7], 2, 1, 12)])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 5, "logit_softcap": 30.0}])
def test_the_kernel_reads_an_fp8_cache_as_the_torch_path_does(lens, heads, kv_heads, dim, kw,
                                                              kernel_on, monkeypatch):
    """An FP8 cache (`kv_cache_dtype`): its bytes made floats (eight at a time through
    float16 bits and F16C, the tail one by one), within float32 rounding of the reference,
    which makes the whole cache float32 first; and the kernel is what ran."""
    q, k, v, meta = _step(lens, heads, kv_heads, dim, seed=dim, cache_dtype=torch.float8_e4m3fn)
    assert k.float().abs().max() > 1  # normal values, and subnormal ones among them:
    assert ((k.float().abs() < 2 ** -6) & (k.float() != 0)).any()
    got, want = _kernel_and_reference(q, k, v, meta, dim ** -0.5, kw, monkeypatch)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() < 1e-5


def test_the_kernel_reads_every_e4m3_byte_as_its_value(kernel_on):
    """One key, so the output is its value row exactly: a row of every e4m3 byte but the
    two NaN ones (subnormals, both zeros, ±448) comes out as torch's values of them."""
    fp8 = torch.float8_e4m3fn
    everything = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    row = torch.where((everything & 0x7F) == 0x7F, 0, everything).view(fp8)
    v = row.view(1, 1, 1, 256).repeat(2, 1, 1, 1)
    k = torch.zeros_like(v)
    meta = AttentionMetadata.build([1], [1], [[1]], 1, torch.device("cpu"))
    got = cpu_attention.paged_decode(torch.randn(1, 1, 256), k, v, meta.block_tables,
                                     meta.seq_lens, 0.1)
    assert torch.equal(got.view(256), row.float())


@pytest.mark.parametrize("case", ["bfloat16", "off"])
def test_what_the_kernel_does_not_cover_takes_the_torch_path(case, kernel_on, monkeypatch):
    q, k, v, meta = _step([20, 3], 4, 2, 64, seed=7,
                          dtype=torch.bfloat16 if case == "bfloat16" else torch.float32)
    if case == "off":
        cpu_attention.set_enabled(False)
    monkeypatch.setattr(cpu_attention, "paged_decode",
                        lambda *a: pytest.fail("the kernel ran"))
    torch_backend.paged_attention(q, k, v, meta, 0.125)


def test_the_knob_sets_the_kernel_per_engine_and_keeps_greedy_tokens(kernel_on):
    """`cpu_attention_kernel`: each engine sets it (one after another does not inherit it);
    the tiny model's greedy tokens and logprobs match with it off, to float32 rounding."""
    from tiny_model import same_greedy_either_way

    def check(llm, on):
        assert cpu_attention._enabled is on

    same_greedy_either_way("cpu_attention_kernel", check, 1e-4)


def _layer_inputs(tokens: int, heads: int, kv_heads: int, dim: int, seed: int,
                  dtype: torch.dtype = torch.float32):
    """q, k, v as views of one fused projection output (as the models make them), random
    caches, positions, and slots with one token not stored (-1)."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, v = fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (t.view(tokens, -1, dim) for t in (q, k, v))
    caches = [torch.randn(6, 4, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
    positions = torch.randint(0, 60, (tokens,), generator=gen)
    slots = torch.randperm(24, generator=gen)[:tokens]
    slots[tokens // 2] = -1
    return q, k, v, caches, positions, slots


def _prologue(dim: int, qk_norm: bool):
    from infer.attention.qk_prologue import QKPrologue
    from infer.config import RopeConfig
    from infer.models.layers import RMSNorm, RotaryEmbedding

    rotary = RotaryEmbedding(dim, 64, RopeConfig(theta=500000.0))
    if not qk_norm:
        return QKPrologue(rotary)
    norms = [RMSNorm(dim, 1e-6) for _ in range(2)]
    for i, norm in enumerate(norms):
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.5, 1.5, dim) + i)
    return QKPrologue(rotary, *norms)


def _rope_store_both_ways(caches, q, k, v, slots, positions, prologue, monkeypatch):
    """The torch path's RoPE and store into copies of `caches`, then the kernel's into
    `caches` (checked to have run): (its q, the torch path's q, the torch path's caches,
    the caches before)."""
    want_caches = [c.clone() for c in caches]
    cpu_attention.set_enabled(False)
    want_q = torch_backend.write_kv_with_prologue(*want_caches, q, k, v, slots, positions,
                                                  prologue)
    cpu_attention.set_enabled(True)
    calls = []
    real = cpu_attention.rope_store
    monkeypatch.setattr(cpu_attention, "rope_store", lambda *a: calls.append(1) or real(*a))
    before = [c.clone() for c in caches]
    got_q = torch_backend.write_kv_with_prologue(*caches, q, k, v, slots, positions, prologue)
    assert calls == [1]
    return got_q, want_q, want_caches, before


@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim", "qk_norm"), [
    (1, 9, 3, 64, False), (5, 4, 2, 128, False), (7, 8, 8, 32, True), (3, 2, 1, 10, False)])
def test_rope_store_gives_the_torch_paths_q_and_caches(tokens, heads, kv_heads, dim, qk_norm,
                                                      kernel_on, monkeypatch):
    """RoPE at random positions, a token with no slot, GQA, head norms first (Qwen3): the
    returned q and both caches as the torch path leaves them, to float32 rounding (the
    slots not written untouched), and the kernel is what ran."""
    q, k, v, caches, positions, slots = _layer_inputs(tokens, heads, kv_heads, dim, seed=dim)
    got_q, want_q, want_caches, before = _rope_store_both_ways(
        caches, q, k, v, slots, positions, _prologue(dim, qk_norm), monkeypatch)
    assert got_q.shape == want_q.shape
    assert (got_q - want_q).abs().max().item() < 1e-5
    for got, want, old in zip(caches, want_caches, before):
        assert (got - want).abs().max().item() < 1e-5
        written = torch.zeros(got.shape[0] * got.shape[1], dtype=torch.bool)
        written[slots[slots >= 0]] = True
        assert torch.equal(got.flatten(0, 1)[~written], old.flatten(0, 1)[~written])


@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim", "qk_norm"), [
    (5, 4, 2, 128, False), (7, 8, 8, 32, True)])
def test_rope_store_into_an_fp8_cache_as_the_torch_path(tokens, heads, kv_heads, dim,
                                                        qk_norm, kernel_on, monkeypatch):
    """The same q; the values' bytes the torch path's (each float rounded to e4m3 alike),
    the rotated keys' too but where the two rotations' float32 rounding puts a key on the
    other side of a midpoint (then one step apart); the slots not written untouched."""
    q, k, v, caches, positions, slots = _layer_inputs(tokens, heads, kv_heads, dim, seed=dim)
    caches = [(c * 3).to(torch.float8_e4m3fn) for c in caches]
    got_q, want_q, want_caches, before = _rope_store_both_ways(
        caches, q, k, v, slots, positions, _prologue(dim, qk_norm), monkeypatch)
    assert (got_q - want_q).abs().max().item() < 1e-5
    (got_k, got_v), (want_k, want_v) = ([c.view(torch.uint8) for c in pair]
                                        for pair in (caches, want_caches))
    assert torch.equal(got_v, want_v)
    same = got_k == want_k
    assert same.float().mean().item() > 0.99
    assert ((got_k[~same].int() - want_k[~same].int()).abs() == 1).all()
    written = torch.zeros(got_k.shape[0] * got_k.shape[1], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for got, old in zip((got_k, got_v), before):
        old = old.view(torch.uint8).flatten(0, 1)
        assert torch.equal(got.flatten(0, 1)[~written], old[~written])


def test_the_kernels_e4m3_rounding_is_torchs_at_every_midpoint(kernel_on):
    """Every e4m3 value, every midpoint between two (ties to even) and the floats either
    side, ±0, values beyond ±448, random ones, stored as values by `rope_store`: the bytes
    of torch's saturated conversion."""
    fp8 = torch.float8_e4m3fn
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    values = values[~values.isnan()].sort().values
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, mids.nextafter(torch.tensor(float("inf"))),
                   mids.nextafter(torch.tensor(float("-inf"))),
                   torch.tensor([0.0, -0.0, 1e-30, 449.0, 464.0, -465.0, 1e9]),
                   torch.randn(3000) * 50, torch.randn(1000) * 0.01])
    x = torch.cat([x, torch.zeros(-x.numel() % 16)]).view(-1, 1, 16)
    tokens = x.shape[0]
    caches = [torch.zeros(tokens, 1, 1, 16, dtype=fp8) for _ in range(2)]
    rotary = _prologue(16, False).rotary
    cpu_attention.rope_store(torch.zeros(tokens, 1, 16), torch.zeros(tokens, 1, 16), x,
                             rotary, torch.zeros(tokens, dtype=torch.long),
                             torch.arange(tokens), *caches)
    want = x.clamp(-448, 448).to(fp8).view(torch.uint8)
    assert torch.equal(caches[1].view(tokens, 1, 16).view(torch.uint8), want)


@pytest.mark.parametrize("case", ["bfloat16", "off"])
def test_rope_store_not_taken_where_it_does_not_apply(case, kernel_on, monkeypatch):
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    q, k, v, caches, positions, slots = _layer_inputs(3, 4, 2, 16, seed=1, dtype=dtype)
    if case == "off":
        cpu_attention.set_enabled(False)
    monkeypatch.setattr(cpu_attention, "rope_store", lambda *a: pytest.fail("the kernel ran"))
    torch_backend.write_kv_with_prologue(*caches, q, k, v, slots, positions,
                                         _prologue(16, False))


@pytest.mark.parametrize(("position", "slot", "message"), [
    (64, 0, "position 64 outside the RoPE table"), (-1, 0, "position -1"),
    (0, 24, "slot 24 outside the cache"), (0, -2, "slot -2")])
def test_rope_store_refuses_a_position_or_slot_out_of_range(position, slot, message):
    q, k, v, caches, positions, slots = _layer_inputs(2, 4, 2, 16, seed=2)
    positions[1], slots[1] = position, slot
    rotary = _prologue(16, False).rotary
    with pytest.raises(RuntimeError, match=message):
        cpu_attention.rope_store(q, k, v, rotary, positions, slots, *caches)
