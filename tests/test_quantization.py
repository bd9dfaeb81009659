"""Quantized weights: INT8 weight-only (W8A16) against a float64 computation from the
quantized integers and scales, the rounding bound of per-channel quantization, every
linear layer of a real model converted, and SmolLM2's perplexity on a fixed text within
1 % of the unquantized model's (the 8-bit target)."""

from __future__ import annotations

import math

import pytest
import torch
from paged_runner import run_paged
from real_models import smollm2_gguf

from infer.engine.config import EngineConfig
from infer.models.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from infer.quantization import quantize_model
from infer.quantization.int8 import Int8WeightOnlyLinearMethod, quantize_per_row


def test_per_channel_rounding_is_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.rand(64, 1) * 3
    w[5] = 0  # a row of zeros
    q, scale = quantize_per_row(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale.shape == (64,)
    err = (w.double() - q.double() * scale.double()[:, None]).abs()
    assert (err <= scale.double()[:, None] / 2 + 1e-7).all()
    assert (q[5] == 0).all()
    # each row's largest magnitude lands on the end of the range
    assert (q.abs().amax(dim=1)[torch.arange(64) != 5] == 127).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_int8_matmul_matches_float64_from_the_integers(dtype, rows):
    torch.manual_seed(rows)
    layer = RowParallelLinear(96, 80, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96))
        layer.bias.copy_(torch.randn(80))
    Int8WeightOnlyLinearMethod().quantize(layer)
    assert layer.weight.dtype == torch.int8
    x = torch.randn(rows, 96).to(dtype)
    y = torch.full((rows, 80), float("nan"), dtype=dtype)  # poisoned
    y = layer(x)
    # A16: the activations as the kernel takes them (bfloat16), everything else float64
    x16 = x.to(torch.bfloat16).double()
    ref = x16 @ (layer.weight.double() * layer.weight_scale.double()[:, None]).T \
        + layer.bias.double()
    assert y.dtype == dtype and torch.isfinite(y).all()
    tol = 2e-2 * ref.abs().max().item()
    assert (y.double() - ref).abs().max().item() < tol


def test_every_linear_layer_of_a_real_model_is_converted():
    from infer.loader import load_gguf

    model, _ = load_gguf(smollm2_gguf())
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert quantize_model(model, "int8") == "int8" and linears
    assert all(m.weight.dtype == torch.int8 for m in linears)
    assert any(isinstance(m, MergedColumnParallelLinear) for m in linears)
    # SmolLM2's LM head is tied to its embedding: both read the same INT8 rows
    tables = [m for m in model.modules() if isinstance(m, (VocabParallelEmbedding, ParallelLMHead))]
    assert len(tables) == 2 and tables[0].weight is tables[1].weight
    assert all(m.weight.dtype == torch.int8 for m in tables)
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(model, "fp4")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")

TEXT = ("The history of the city goes back more than two thousand years. It grew along the "
        "river, where traders stopped on their way to the sea, and over the centuries its "
        "markets, bridges and churches made it one of the busiest places in the region. "
        "Today it is known for its museums, its old town and the food sold in its streets.")


def _perplexity(model, ids: list[int]) -> float:
    return perplexity_of(run_paged(model, [ids], [len(ids)], block_size=16)[0], ids)


def perplexity_of(logits: torch.Tensor, ids: list[int]) -> float:
    """The perplexity of `ids` under `logits [len(ids), vocab]` (position i's predicts
    token i + 1)."""
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    return math.exp(nll)


def smollm2_perplexities(quantization: str) -> tuple[float, float, torch.nn.Module]:
    """SmolLM2's perplexity on TEXT as loaded and with its weights in `quantization`
    (`quantize_model`), and that quantized model."""
    from infer.loader import load_gguf
    from infer.loader.tokenizer import Tokenizer

    path = smollm2_gguf()
    ids = Tokenizer.from_gguf(path).encode(TEXT)
    full, _ = load_gguf(path)
    quantized, _ = load_gguf(path)
    assert quantize_model(quantized, quantization) == quantization
    before, after = _perplexity(full, ids), _perplexity(quantized, ids)
    assert len(ids) > 60 and 1 < before < 100
    print(f"perplexity: {before:.3f} unquantized, {after:.3f} {quantization}")
    return before, after, quantized


def test_int8_smollm2_perplexity_within_one_percent():
    before, after, _ = smollm2_perplexities("int8")
    assert abs(after - before) / before < 0.01, (before, after)


def test_an_engine_serves_int8_weights():
    from infer import LLM, SamplingParams

    llm = LLM(str(smollm2_gguf()), device="cpu", quantization="int8")
    linears = [m for m in llm.engine.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == torch.int8 for m in linears)
    [out] = llm.generate("The capital of France is",
                         SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert "Paris" in out.outputs[0].text


def test_the_server_reports_the_weights_format():
    import httpx
    from server_fixtures import live_server

    from infer import LLM
    from infer.server.async_engine import AsyncEngine

    engine = AsyncEngine.in_thread(LLM(str(smollm2_gguf()), device="cpu",
                                       quantization="int8").engine)
    with live_server(engine) as server:
        [card] = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert card["quantization"] == "int8"


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantizing_as_the_weights_load_equals_quantizing_after(quantization):
    """The engine builds int8 / fp8 layers before loading, so each tensor is quantized as it
    arrives and the float weights are never all held: the same weights and scales, bit for
    bit, as quantizing the loaded float model."""
    from infer.loader import load_gguf
    from infer.quantization import method_made_at_load

    path = smollm2_gguf()
    after, _ = load_gguf(path)
    assert quantize_model(after, quantization) == quantization
    during, _ = load_gguf(path, linear_method=method_made_at_load(quantization))
    linears = [m for m in during.modules() if isinstance(m, LinearBase)]
    assert all(m.weight.dtype in (torch.int8, torch.float8_e4m3fn) for m in linears)
    assert quantize_model(during, quantization) == quantization
    want, got = dict(after.named_parameters()), dict(during.named_parameters())
    assert want.keys() == got.keys()
    for name, param in want.items():
        assert got[name].dtype == param.dtype and torch.equal(got[name], param), name
