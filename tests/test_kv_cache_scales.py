"""Calibrated FP8 KV-cache scales from a checkpoint, in the layout llm-compressor writes
(it cannot be downloaded here): `quantization_config.kv_cache_scheme` of static 8-bit float
scales per tensor, and each attention layer's `self_attn.k_scale` / `self_attn.v_scale`,
F32 of shape []. With an FP8 cache a layer stores `k / k_scale` and `v / v_scale` rounded
to e4m3 and attends over `byte * scale`: checked against a reference that rounds the same
keys and values in torch and stores the floats they stand for in a float32 cache. A cache of
the model's dtype ignores the scales (as vLLM's does); bad scales are refused by name."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from paged_runner import run_paged
from test_quantized_checkpoints import VOCAB, _rewrite_config, _rewrite_tensor, write_quantized

from infer.attention import Attention, set_attention_backend, torch_backend
from infer.attention.kv_dtype import FP8_KV, UNSCALED
from infer.attention.torch_backend import TorchAttentionBackend
from infer.loader import ModelLoadError, load_hf_dir
from infer.loader import model_loader as model_loader_module

KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
             "symmetric": True}
# (k_scale, v_scale) per layer of the two-layer test model, whose keys and values reach
# 1.1-4.1 (medians ~0.25): scaled by these they reach ~50-330, inside e4m3's ±448
SCALES = [(1 / 64, 1 / 48), (1 / 80, 0.03)]
DEVICE = os.environ.get("INFER_TEST_DEVICE", "cpu")


def _attention_layers(model) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def write_calibrated(tmp_path, qwen3: bool = False) -> None:
    """A compressed-tensors FP8 checkpoint with KV-cache scales."""
    write_quantized(tmp_path, "ct-fp8-channel", qwen3=qwen3)
    _rewrite_config(tmp_path, kv_cache_scheme=KV_SCHEME)
    for i, (k, v) in enumerate(SCALES):
        _rewrite_tensor(tmp_path, f"model.layers.{i}.self_attn.k_scale", torch.tensor(k))
        _rewrite_tensor(tmp_path, f"model.layers.{i}.self_attn.v_scale", torch.tensor(v))


class _RoundingReference(TorchAttentionBackend):
    """Stores each layer's keys and values as the floats its scaled e4m3 bytes stand for,
    `fp8(x / scale) * scale` in torch, into a float32 cache; attends as the reference does."""

    def __init__(self, layers: list[Attention]) -> None:
        self.layers = layers

    def _scales(self, k_cache: torch.Tensor) -> tuple[float, float]:
        return next(m.kv_scales for m in self.layers if m.k_cache is k_cache)

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping, scales=UNSCALED):
        ks, vs = self._scales(k_cache)
        torch_backend.write_kv(k_cache, v_cache, _rounded(k, ks), _rounded(v, vs), slot_mapping)

    def write_kv_with_prologue(self, k_cache, v_cache, q, k, v, slot_mapping, positions,
                               prologue, scales=UNSCALED):
        q, k = prologue.apply(positions, q, k)
        self.write_kv(k_cache, v_cache, k, v, slot_mapping)
        return q


def _rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x divided by `scale` as the stores divide (times its float32 inverse), rounded to
    e4m3 saturating at 448, times the scale."""
    scaled = x.float() * torch.tensor(1 / scale, dtype=torch.float32)
    return (scaled.clamp(-448, 448).to(FP8_KV).double() * scale).to(x.dtype)


def _sequences() -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(VOCAB, (n,), generator=gen).tolist() for n in (7, 13, 20)], [3, 8, 20]


def test_a_calibrated_checkpoint_gives_each_layer_its_scales(tmp_path):
    write_calibrated(tmp_path)
    model, _ = load_hf_dir(tmp_path)
    got = [m.kv_scales for m in _attention_layers(model)]
    assert got == [(float(torch.tensor(k)), float(torch.tensor(v))) for k, v in SCALES]


@pytest.mark.parametrize("qwen3", [False, True], ids=["llama", "qwen3-qk-norm"])
def test_an_fp8_cache_stores_and_reads_through_the_scales(tmp_path, qwen3):
    write_calibrated(tmp_path, qwen3=qwen3)
    model, _ = load_hf_dir(tmp_path)
    seqs, lens = _sequences()
    got = run_paged(model, seqs, lens, kv_dtype=FP8_KV)
    layers = _attention_layers(model)
    set_attention_backend(model, _RoundingReference(layers))
    want = run_paged(model, seqs, lens, kv_dtype=torch.float32)
    set_attention_backend(model, "torch")
    for layer in layers:
        layer.kv_scales = UNSCALED
    unscaled = run_paged(model, seqs, lens, kv_dtype=FP8_KV)
    error = max((g - w).abs().max().item() for g, w in zip(got, want))
    ignored = max((u - w).abs().max().item() for u, w in zip(unscaled, want))
    top = max(w.abs().max().item() for w in want)
    print(f"max |logit error| with the scales {error:.2e}, without them {ignored:.2e} "
          f"(largest logit {top:.2f})")
    # Equal up to float32 rounding (the scales multiply q.k and the attention's output
    # rather than each value), which can send a later layer's key or value across an e4m3
    # midpoint (measured: 1.6e-4 at most, without the scales 9e-2).
    assert error < 1e-3 * top
    assert ignored > 50 * error


def test_a_cache_of_the_models_dtype_ignores_the_scales(tmp_path):
    write_calibrated(tmp_path)
    model, _ = load_hf_dir(tmp_path)
    seqs, lens = _sequences()
    got = run_paged(model, seqs, lens)
    for layer in _attention_layers(model):
        layer.kv_scales = UNSCALED
    for g, w in zip(got, run_paged(model, seqs, lens)):
        assert torch.equal(g, w)


def test_the_triton_store_divides_by_the_scales_as_torchs():
    """In Triton's interpreter on the CPU (on a GPU with INFER_TEST_DEVICE=cuda): the bytes
    the torch store writes with the same scales (the store fused with RoPE:
    test_kv_cache_fp8.py)."""
    pytest.importorskip("triton")
    from infer.attention.kv_dtype import inverses
    from infer.kernels.kv_store import store_kv

    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(5, 2, 16, generator=gen) * 0.3).to(DEVICE)
    v = (torch.randn(5, 2, 16, generator=gen) * 20).to(DEVICE)
    slots = torch.tensor([3, 0, -1, 9, 14], device=DEVICE)
    scales = (0.0123, 3.7)
    want, got = ([torch.zeros(4, 4, 2, 16, dtype=FP8_KV, device=DEVICE) for _ in range(2)]
                 for _ in range(2))
    torch_backend.write_kv(*want, k, v, slots, scales)
    store_kv(*got, k, v, slots, inverses(scales))
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    unscaled = [torch.zeros_like(w) for w in want]
    torch_backend.write_kv(*unscaled, k, v, slots)
    assert not torch.equal(unscaled[0].view(torch.uint8), want[0].view(torch.uint8))


def test_an_engine_serves_a_calibrated_checkpoint_with_an_fp8_cache(tmp_path, caplog):
    """`LLM(kv_cache_dtype="fp8")` on the checkpoint: its greedy tokens are the rounding
    reference's (the model driven step by step over its float32 cache), and its log says
    the scales are in use."""
    from checkpoints import save_word_tokenizer

    from infer import LLM, SamplingParams

    write_calibrated(tmp_path)
    save_word_tokenizer(tmp_path, VOCAB)
    with caplog.at_level(logging.INFO, logger="infer"):
        llm = LLM(str(tmp_path), device="cpu", max_model_len=64, max_num_seqs=4,
                  kv_cache_dtype="fp8")
    assert "FP8 KV cache with the checkpoint's calibrated scales (2 layers)" in caplog.text
    prompt = [5, 17, 200, 3, 42]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    model, _ = load_hf_dir(tmp_path)
    set_attention_backend(model, _RoundingReference(_attention_layers(model)))
    want: list[int] = []
    for _ in range(5):
        seq = prompt + want
        logits = run_paged(model, [seq], [len(seq)], kv_dtype=torch.float32)[0]
        want.append(int(logits[-1].argmax()))
    assert list(out[0].outputs[0].token_ids) == want


K0 = "model.layers.0.self_attn.k_scale"
BAD = {
    "dynamic scheme": (lambda p: _rewrite_config(p, kv_cache_scheme={**KV_SCHEME,
                                                                       "dynamic": True}),
                       "kv_cache_scheme"),
    "per-head strategy": (lambda p: _rewrite_config(p, kv_cache_scheme={**KV_SCHEME,
                                                                         "strategy": "head"}),
                          "kv_cache_scheme"),
    "a layer without its key scale": (lambda p: _rewrite_tensor(p, K0, None), K0),
    "a scale of two values": (lambda p: _rewrite_tensor(p, K0, torch.ones(2)), K0),
    "a scale that is not float": (
        lambda p: _rewrite_tensor(p, K0, torch.ones(1, dtype=torch.int32)), K0),
    "a scale without the scheme": (lambda p: _rewrite_config(p, kv_cache_scheme=None),
                                   "no kv_cache_scheme"),
    "a legacy kv_scale": (lambda p: _rewrite_tensor(p, "model.layers.0.self_attn.kv_scale",
                                                    torch.tensor(1.0)), "kv_scale"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_kv_scales_are_refused_before_the_model_is_built(tmp_path, monkeypatch, case):
    write_calibrated(tmp_path)
    spoil, named = BAD[case]
    spoil(tmp_path)

    def build_model(*args, **kwargs):
        raise AssertionError("the model was built before the checkpoint was checked")

    monkeypatch.setattr(model_loader_module, "build_model", build_model)
    with pytest.raises(ModelLoadError, match=named.replace(".", r"\.")):
        load_hf_dir(tmp_path)


@pytest.mark.parametrize("value", [0.0, -0.5, float("inf")])
def test_a_scale_that_is_not_a_positive_finite_float_is_refused_by_name(tmp_path, value):
    write_calibrated(tmp_path)
    _rewrite_tensor(tmp_path, K0, torch.tensor(value))
    with pytest.raises(ModelLoadError, match=K0.replace(".", r"\.")):
        load_hf_dir(tmp_path)
