"""An FP8 (e4m3) KV cache (`EngineConfig.kv_cache_dtype`, `attention/kv_dtype.py`): the
stores round to nearest and saturate at ±448 (hand-computed bytes; the Triton stores in the
interpreter equal the torch one), the attention reads exactly the stored values (the
reference over the FP8 cache equals it over those values in float32; the Triton kernels
against it), and an engine serves with it: half the bytes a token of a bfloat16 cache,
SmolLM2's and Gemma 3's perplexity on a fixed text within a stated bound of their float32
cache's, the server reporting it."""

from __future__ import annotations

import os

import pytest
import torch
from paged_runner import run_paged
from real_models import gemma3_gguf, smollm2_gguf
from test_quantization import TEXT, perplexity_of

from infer.attention import torch_backend
from infer.attention.kv_dtype import FP8_KV, as_cache_values, kv_cache_torch_dtype
from infer.attention.metadata import AttentionMetadata
from infer.engine.config import EngineConfig
from infer.engine.memory import kv_bytes_per_token
from infer.kernels import triton_available

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _fp8_cache(blocks: int, block_size: int, kv_heads: int, head_dim: int,
               fill: int = 0x7F) -> torch.Tensor:
    """A cache of bytes `fill` (0x7F: e4m3's NaN, a slot no store wrote reads as NaN)."""
    return torch.full((blocks, block_size, kv_heads, head_dim), fill, dtype=torch.uint8,
                      device=DEVICE).view(FP8_KV)


def test_the_config_names_the_cache_dtypes_it_takes():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == FP8_KV
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float32) == FP8_KV
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, fp8 or fp8_e4m3"):
        kv_cache_torch_dtype("int8", torch.bfloat16)


def test_a_token_of_an_fp8_cache_is_half_a_bfloat16_one():
    from infer.config import ModelConfig

    cfg = ModelConfig("llama", vocab_size=10, hidden_size=64, intermediate_size=96,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=64)
    # 2 (k and v) x 3 layers x 2 heads x 16 values
    assert kv_bytes_per_token(cfg, FP8_KV) == 192
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 384


def test_stores_round_to_nearest_and_saturate():
    """Hand-computed e4m3 values: 0.1 -> 13/128 (the nearer of 12/128 and 13/128), 1e-4
    below half the smallest subnormal (2^-9) -> 0, 2^-9 exact, beyond ±448 -> ±448 (not
    NaN); a slot of -1 is skipped (its bytes stay NaN)."""
    values = [0.1, -3.3, 500.0, -1000.0, 1e-4, 2.0 ** -9, 447.0, 1.0]
    want = [13 / 128, -3.25, 448.0, -448.0, 0.0, 2.0 ** -9, 448.0, 1.0]
    k = torch.tensor(values, device=DEVICE).view(1, 1, 8).repeat(3, 1, 1)
    v = -k
    k_cache, v_cache = _fp8_cache(2, 2, 1, 8), _fp8_cache(2, 2, 1, 8)
    slots = torch.tensor([3, -1, 0], device=DEVICE)
    torch_backend.write_kv(k_cache, v_cache, k, v, slots)
    stored_k = k_cache.view(-1, 8).float().cpu()
    stored_v = v_cache.view(-1, 8).float().cpu()
    for slot in (0, 3):
        assert stored_k[slot].tolist() == want
        assert stored_v[slot].tolist() == [-w for w in want]
    assert stored_k[1:3].isnan().all() and stored_v[1:3].isnan().all()


@needs_triton
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_the_triton_store_writes_the_bytes_the_torch_store_does(model_dtype):
    from infer.kernels.kv_store import store_kv

    torch.manual_seed(0)
    tokens, kv_heads, head_dim = 9, 2, 64
    k = (torch.randn(tokens, kv_heads, head_dim, device=DEVICE) * 40).to(model_dtype)
    v = (torch.randn(tokens, kv_heads, head_dim, device=DEVICE) * 200).to(model_dtype)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 449.0, 2.0 ** -12])  # saturating, subnormal
    slots = torch.randperm(24, device=DEVICE)[:tokens]
    slots[4] = -1
    want_k, want_v = _fp8_cache(6, 4, kv_heads, head_dim), _fp8_cache(6, 4, kv_heads, head_dim)
    torch_backend.write_kv(want_k, want_v, k, v, slots)
    got_k, got_v = _fp8_cache(6, 4, kv_heads, head_dim), _fp8_cache(6, 4, kv_heads, head_dim)
    store_kv(got_k, got_v, k, v, slots)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


@needs_triton
def test_the_triton_rounding_is_torchs_at_every_midpoint_and_beyond_the_range():
    """Every e4m3 value, every midpoint between two (ties to even) and the floats either
    side of it, ±0, saturating values and random ones, through `store_kv`: the bytes of
    torch's saturated conversion (the interpreter's own conversion fails this: it rounds a
    value carrying into the next power of two down)."""
    from infer.kernels.kv_store import store_kv

    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_KV).float()
    values = values[~values.isnan()].sort().values
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    x = torch.cat([values, mids, mids.nextafter(up), mids.nextafter(down),
                   torch.tensor([0.0, -0.0, 1e-30, 448.0, 449.0, 464.0, -465.0, 1e9]),
                   torch.randn(4000) * 50, torch.randn(1000) * 0.01])
    x = torch.cat([x, torch.zeros(-x.numel() % 64)]).view(-1, 1, 64).to(DEVICE)
    k_cache, v_cache = _fp8_cache(x.shape[0], 1, 1, 64), _fp8_cache(x.shape[0], 1, 1, 64)
    store_kv(k_cache, v_cache, x, -x, torch.arange(x.shape[0], device=DEVICE))
    want = x.clamp(-448, 448).to(FP8_KV).view(torch.uint8)
    assert torch.equal(k_cache.view(x.shape).view(torch.uint8), want)
    assert torch.equal(v_cache.view(x.shape).view(torch.uint8),
                       (-x).clamp(-448, 448).to(FP8_KV).view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.0123, 3.7)], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("norm", [None, 1.0])
def test_the_fused_rope_store_writes_the_unfused_bytes(norm, scales):
    """`rope_store_kv` into an FP8 cache against the reference RoPE (and q/k norm) then the
    torch store: the same bytes but where the float32 rotation lands a value within
    rounding of the midpoint between two e4m3 values (then one step apart). With a
    checkpoint's KV scales (test_kv_cache_scales.py) both divide by them."""
    from infer.attention.kv_dtype import inverses
    from infer.kernels import reference as ref
    from infer.kernels.rope_kv_store import rope_store_kv

    torch.manual_seed(1)
    tokens, heads, kv_heads, head_dim, max_pos = 7, 4, 2, 64, 50
    q = torch.randn(tokens, heads, head_dim, device=DEVICE) * 3
    k = torch.randn(tokens, kv_heads, head_dim, device=DEVICE) * 3
    v = torch.randn(tokens, kv_heads, head_dim, device=DEVICE) * 3
    angles = torch.rand(max_pos, head_dim // 2, device=DEVICE) * 6.3
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    slots = torch.randperm(20, device=DEVICE)[:tokens]
    slots[2] = -1
    q_w, k_w = torch.randn(head_dim, device=DEVICE), torch.randn(head_dim, device=DEVICE)
    exp_q, exp_k = q.clone(), k.clone()
    if norm is not None:
        exp_q = ref.rmsnorm_ref(exp_q, q_w, 1e-6, norm)
        exp_k = ref.rmsnorm_ref(exp_k, k_w, 1e-6, norm)
    exp_q, exp_k = ref.rope_ref(exp_q, exp_k, cos, sin, positions)
    want_k, want_v = _fp8_cache(5, 4, kv_heads, head_dim), _fp8_cache(5, 4, kv_heads, head_dim)
    torch_backend.write_kv(want_k, want_v, exp_k, v, slots, scales)
    got_k, got_v = _fp8_cache(5, 4, kv_heads, head_dim), _fp8_cache(5, 4, kv_heads, head_dim)
    rope_store_kv(q, k, v, got_k, got_v, slots, positions, cos, sin,
                  q_w if norm else None, k_w if norm else None, 1e-6, norm or 0.0,
                  inverses(scales))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    same = got_k.view(torch.uint8) == want_k.view(torch.uint8)
    assert same.float().mean().item() > 0.99
    # one e4m3 step apart where they differ: adjacent byte values of the same sign
    steps = (got_k.view(torch.uint8)[~same].int() - want_k.view(torch.uint8)[~same].int())
    assert (steps.abs() == 1).all()
    assert torch.allclose(q, exp_q, rtol=1e-5, atol=1e-5)


def _fp8_paged_case(query_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int,
                    head_dim: int, fill: int = 0x7F, block_size: int = 16):
    """Random q and an FP8 pool with scattered block tables, unused slots of bytes `fill`
    (NaN: the kernels must not read them; the reference's decode reads a block's padding,
    masked, as the engine's zeroed pool holds it)."""
    need = [-(-s // block_size) for s in seq_lens]
    blocks = sum(need) + 2
    order = torch.randperm(blocks).tolist()
    tables = []
    for n in need:
        tables.append(order[:n])
        order = order[n:]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, DEVICE)
    k_cache = _fp8_cache(blocks, block_size, kv_heads, head_dim, fill)
    v_cache = _fp8_cache(blocks, block_size, kv_heads, head_dim, fill)
    for table, s in zip(tables, seq_lens):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(s)], device=DEVICE)
        torch_backend.write_kv(k_cache, v_cache,
                               torch.randn(s, kv_heads, head_dim, device=DEVICE) * 4,
                               torch.randn(s, kv_heads, head_dim, device=DEVICE), slots)
    q = torch.randn(sum(query_lens), heads, head_dim, device=DEVICE)
    return meta, q, k_cache, v_cache


def _as_float32(cache: torch.Tensor) -> torch.Tensor:
    return cache.float().nan_to_num(0.0)  # unwritten slots: the reference never reads them


@pytest.mark.parametrize(("query_lens", "seq_lens"), [
    ([1, 1, 1], [1, 40, 70]),  # decodes
    ([37, 1, 9], [37, 30, 45]),  # a prompt, a decode, a chunk after a cached prefix
])
def test_the_reference_reads_exactly_the_stored_values(query_lens, seq_lens, monkeypatch):
    """Attention over the FP8 cache is attention over its values in float32, bit for bit
    (e4m3 -> float32 is exact): the cache costs only the stores' rounding. (Both on
    torch's path: the CPU kernel, which would take either cache, is off.)"""
    from infer.kernels import cpu_attention

    monkeypatch.setattr(cpu_attention, "_enabled", False)
    torch.manual_seed(2)
    meta, q, k_cache, v_cache = _fp8_paged_case(query_lens, seq_lens, 4, 2, 64, fill=0)
    got = torch_backend.paged_attention(q, k_cache, v_cache, meta, 0.125, None, None)
    want = torch_backend.paged_attention(q, _as_float32(k_cache), _as_float32(v_cache), meta,
                                         0.125, None, None)
    assert torch.isfinite(got).all() and torch.equal(got, want)


@needs_triton
@pytest.mark.parametrize(("query_lens", "seq_lens", "window", "softcap"), [
    ([1, 1, 1, 1], [1, 40, 17, 300], None, None),  # split-K decode
    ([1, 1, 1], [5, 40, 66], 20, 30.0),  # decode, sliding window and softcap
    ([37, 1, 9, 0], [37, 30, 45, 12], None, None),  # varlen prefill, a cached prefix
])
@pytest.mark.parametrize("q_dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        DEVICE == "cpu", reason="the interpreter's bfloat16 attention is wrong with any cache "
        "(test_kernels.py tests float32 only)"))])
def test_the_triton_kernels_over_an_fp8_cache_match_the_reference(query_lens, seq_lens,
                                                                  window, softcap, q_dtype):
    from infer.attention.triton_backend import paged_attention_kernels

    torch.manual_seed(3)
    meta, q, k_cache, v_cache = _fp8_paged_case(query_lens, seq_lens, 8, 2, 64)
    q = q.to(q_dtype)
    want = torch_backend.paged_attention(q.float(), _as_float32(k_cache),
                                         _as_float32(v_cache), meta, 0.125, window, softcap)
    got = paged_attention_kernels(q, k_cache, v_cache, meta, 0.125, window, softcap)
    assert got.dtype == q_dtype and torch.isfinite(got).all()
    # float32: the reference's summation order; bfloat16: p and the values' tiles rounded
    # to bfloat16 for the dot, and the output
    tol = 1e-4 if q_dtype == torch.float32 else 2e-2
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol * want.abs().max().item(), err


@pytest.mark.parametrize(("model", "bound"), [
    # measured: SmolLM2-135M 17.18 -> 17.66 (+2.8 %; with every value scaled up 16x before
    # the rounding, +2.1 %: its loss is the 3 significant bits, not the range), Gemma 3
    # 270M 13.43 -> 13.47 (+0.3 %)
    (smollm2_gguf, 0.035), (gemma3_gguf, 0.01)])
def test_perplexity_with_an_fp8_cache_within_a_bound_of_float32s(model, bound):
    from infer.loader import load_gguf
    from infer.loader.tokenizer import Tokenizer

    path = model()
    ids = Tokenizer.from_gguf(path).encode(TEXT)
    weights, _ = load_gguf(path)
    # half prefilled, half decoded: both of the reference's paths read the cache
    before, after = (perplexity_of(run_paged(weights, [ids], [len(ids) // 2], block_size=16,
                                             kv_dtype=kv_dtype)[0], ids)
                     for kv_dtype in (None, FP8_KV))
    print(f"{path.name}: perplexity {before:.3f} float32 cache, {after:.3f} FP8 cache")
    assert 1 < before < 100 and abs(after - before) / before < bound, (before, after)
    assert after != before  # the cache was FP8


def test_an_engine_serves_with_an_fp8_cache_and_the_server_says_so():
    import httpx
    from server_fixtures import live_server

    from infer import LLM, SamplingParams
    from infer.server.async_engine import AsyncEngine

    llm = LLM(str(smollm2_gguf()), device="cpu", kv_cache_dtype="fp8", max_model_len=256,
              num_blocks=40)
    pool = llm.engine.runner.kv_pool
    assert pool.dtype == FP8_KV and pool.element_size() == 1
    assert llm.engine.info.kv_cache_dtype == "float8_e4m3fn"
    [out] = llm.generate("The capital of France is",
                         SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    with live_server(AsyncEngine.in_thread(llm.engine)) as server:
        [card] = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert card["kv_cache_dtype"] == "float8_e4m3fn"


def test_as_cache_values_leaves_other_caches_alone():
    x = torch.tensor([1e6, -2.5])
    assert as_cache_values(x, torch.float32) is x
    assert as_cache_values(x, FP8_KV).float().tolist() == [448.0, -2.5]
