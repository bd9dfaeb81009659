"""infer's CPU kernel for INT8 weights with float32 activations
(`kernels/cpu_int8_linear.cpp`) against a float64 computation, and the INT8 layers that
take it (`EngineConfig.cpu_int8_kernel`)."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import cpu_extension, cpu_int8_linear
from infer.quantization.int8 import Int8WeightOnlyLinearMethod

pytestmark = pytest.mark.skipif(not cpu_extension.available(),
                                reason="infer's CPU kernels cannot be built here")


def _operands(rows: int, out: int, cols: int, seed: int, scale_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x[0, cols // 3] = 300.0  # an outlier
    w = torch.randint(-128, 128, (out, cols), generator=gen, dtype=torch.int8)
    scale = (torch.rand(out, generator=gen) / 50 + 1e-4).to(scale_dtype)
    return x, w, scale


def _float64(x, w, scale) -> torch.Tensor:
    return (x.double() @ w.double().T) * scale.double()


@pytest.mark.parametrize(("rows", "out", "cols"), [
    (1, 64, 576), (1, 37, 100), (2, 5, 31), (3, 130, 48), (4, 16, 1536), (5, 3, 7),
    (9, 40, 200), (16, 33, 96), (70, 29, 80)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_gives_the_float64_product(rows, out, cols, scale_dtype):
    """Widths on and off the 8 / 16 / 32-value steps (the tail taken one value at a
    time), one row to past the 64 rows a pass takes, an odd number of channels (the last
    without a pair), -128 in the weights, an x outlier: within float32 rounding of the sums
    (1e-6 of sum |x w| s; bfloat16 rounding of x, as torch's INT8 kernel has, would be
    ~1e-3)."""
    x, w, scale = _operands(rows, out, cols, seed=rows * 1000 + cols, scale_dtype=scale_dtype)
    got = cpu_int8_linear.int8_linear(x, w, scale)
    want = _float64(x, w, scale)
    bound = (x.double().abs() @ w.double().abs().T) * scale.double()
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    assert ((got.double() - want).abs() <= 1e-6 * bound + 1e-30).all()


@pytest.mark.parametrize("rows", [2, 3, 5, 17, 70])
def test_each_row_is_its_one_row_result_bit_for_bit(rows):
    """Whatever rows share the call (and so how the kernel groups them, and channels in
    pairs from 16 rows on), each row's output is the one it has alone: a sequence's
    logits do not depend on the batch beside it."""
    x, w, scale = _operands(rows, 45, 208, seed=rows)
    together = cpu_int8_linear.int8_linear(x, w, scale)
    for r in range(rows):
        alone = cpu_int8_linear.int8_linear(x[r:r + 1].clone(), w, scale)
        assert torch.equal(together[r:r + 1], alone)


@pytest.mark.parametrize(("x", "w", "scale", "message"), [
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(3, 8, dtype=torch.int8),
     torch.ones(3), "x: float32"),
    (torch.zeros(2, 8), torch.zeros(3, 8, dtype=torch.uint8), torch.ones(3), "weight: int8"),
    (torch.zeros(2, 8), torch.zeros(3, 9, dtype=torch.int8), torch.ones(3), "weight: int8"),
    (torch.zeros(2, 8), torch.zeros(3, 8, dtype=torch.int8), torch.ones(4), "scale:"),
    (torch.zeros(2, 8), torch.zeros(3, 8, dtype=torch.int8), torch.ones(3).half(), "scale:")])
def test_operands_it_cannot_take_are_refused_by_name(x, w, scale, message):
    with pytest.raises(RuntimeError, match=message):
        cpu_int8_linear.int8_linear(x, w, scale)


def _int8_layer(out: int, cols: int, seed: int, on: bool) -> torch.nn.Module:
    layer = torch.nn.Linear(cols, out, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out, cols, generator=torch.Generator().manual_seed(seed)))
    Int8WeightOnlyLinearMethod().quantize(layer)
    layer.cpu_int8_kernel = on
    return layer


def test_an_int8_layer_takes_the_kernel_where_set(monkeypatch):
    """With `cpu_int8_kernel` the layer's product is the kernel's on float32 x (x not rounded
    to bfloat16); without it, PyTorch's on x rounded to bfloat16. Both near the float64
    product of the stored weights."""
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    on, off = _int8_layer(40, 96, 2, True), _int8_layer(40, 96, 2, False)
    method = on.quant_method
    want = _float64(x, on.weight, on.weight_scale)
    calls = []
    real = cpu_int8_linear.int8_linear
    monkeypatch.setattr(cpu_int8_linear, "int8_linear", lambda *a: calls.append(1) or real(*a))
    got_on = method.apply(on, x, None)
    assert calls == [1]
    assert torch.equal(got_on, real(x, on.weight, on.weight_scale))
    got_off = method.apply(off, x, None)
    assert calls == [1]
    scale = want.abs().max().item()
    assert (got_on.double() - want).abs().max().item() < 1e-6 * scale
    assert (got_off.double() - want).abs().max().item() < 1e-2 * scale


def test_the_knob_sets_the_kernel_per_engine_and_keeps_greedy_tokens():
    """`cpu_int8_kernel` on the tiny model in INT8: each engine sets its layers (one after
    another does not inherit it); the greedy tokens match with it off and the logprobs
    are within the bfloat16 rounding of x that the off path adds."""
    from tiny_model import same_greedy_either_way

    def check(llm, on):
        int8_layers = [m for m in llm.engine.core.runner.model.modules()
                       if isinstance(getattr(m, "quant_method", None),
                                     Int8WeightOnlyLinearMethod)]
        assert int8_layers and all(m.cpu_int8_kernel is on for m in int8_layers)

    same_greedy_either_way("cpu_int8_kernel", check, 5e-2, quantization="int8")
