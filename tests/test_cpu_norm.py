"""infer's CPU RMSNorm kernels (`kernels/cpu_norm.cpp`) against a float64 computation and
against the torch path of `RMSNorm` they stand in for (`EngineConfig.cpu_norm_kernel`)."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import cpu_extension, cpu_norm
from infer.models.layers import RMSNorm

pytestmark = pytest.mark.skipif(not cpu_extension.available(),
                                reason="infer's CPU kernels cannot be built here")


def _float64_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize(("shape", "eps"), [
    ((1, 576), 1e-5), ((3, 640), 1e-6), ((2, 5, 13), 1e-6), ((1, 7), 1e-5), ((40, 96), 1e-5),
    ((1, 8), 1.0)])
def test_rms_norm_is_the_float64_norm(shape, eps):
    """Widths on and off the eight partial sums (7, 13 leave a tail), rows past the
    threads' grain, a leading batch dimension, an eps that dominates: within float32
    rounding."""
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=gen) * 3
    x.view(-1, shape[-1])[0, 0] = 80.0  # an outlier
    weight = torch.randn(shape[-1], generator=gen)
    got = cpu_norm.rms_norm(x, weight, eps)
    want = _float64_norm(x, weight, eps)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= 2e-6 * (want.abs() + 1e-3)).all()


def test_add_rms_norm_returns_the_norm_of_the_sum_and_the_sum():
    gen = torch.Generator().manual_seed(3)
    x, residual = torch.randn(4, 100, generator=gen), torch.randn(4, 100, generator=gen)
    weight = torch.rand(100, generator=gen) + 0.5
    before = residual.clone()
    out, total = cpu_norm.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, before + x)
    assert torch.equal(residual, before)  # a new tensor, as the torch path's `residual + x`
    want = _float64_norm(before.double() + x.double(), weight, 1e-6)
    assert ((out.double() - want).abs() <= 2e-6 * (want.abs() + 1e-3)).all()


def test_each_row_is_its_one_row_result_bit_for_bit():
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(37, 200, generator=gen), torch.randn(200, generator=gen)
    together = cpu_norm.rms_norm(x, weight, 1e-5)
    for r in range(37):
        assert torch.equal(together[r], cpu_norm.rms_norm(x[r:r + 1].clone(), weight,
                                                                  1e-5)[0])


@pytest.mark.parametrize(("x", "weight", "message"), [
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8), "x: contiguous float32"),
    (torch.zeros(8, 2).t(), torch.ones(8), "x: contiguous float32"),
    (torch.zeros(2, 8), torch.ones(9), "weight:"),
    (torch.zeros(2, 8), torch.ones(8, dtype=torch.float64), "weight:")])
def test_operands_it_cannot_take_are_refused_by_name(x, weight, message):
    with pytest.raises(RuntimeError, match=message):
        cpu_norm.rms_norm(x, weight, 1e-6)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True])
def test_the_layer_takes_the_kernel_where_set_and_matches_its_torch_path(offset, with_residual,
                                                                         monkeypatch):
    """`RMSNorm.cpu_kernel`: float32 CPU rows go to the kernel (Gemma's `1 + w` too), with
    the torch path's results to float32 rounding; a bfloat16 input keeps the torch path."""
    gen = torch.Generator().manual_seed(11)
    norm = RMSNorm(64, 1e-6, offset=offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen) * 0.1)
    x, residual = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)
    args = (x, residual.clone()) if with_residual else (x,)
    want = norm(*args)
    calls = []
    for name in ("rms_norm", "add_rms_norm"):
        real = getattr(cpu_norm, name)
        monkeypatch.setattr(cpu_norm, name,
                            lambda *a, _real=real: calls.append(1) or _real(*a))
    norm.cpu_kernel = True
    got = norm(*((x, residual.clone()) if with_residual else (x,)))
    assert calls == [1]
    for g, w in zip(got, want) if with_residual else [(got, want)]:
        assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item()
    norm.bfloat16()
    norm(x.bfloat16())
    assert calls == [1]


def test_the_knob_sets_the_kernel_per_engine_and_keeps_greedy_tokens():
    """`cpu_norm_kernel` on the tiny float32 model: each engine sets its norms (one after
    another does not inherit it); greedy tokens and logprobs as with it off, to float32
    rounding."""
    from tiny_model import same_greedy_either_way

    def check(llm, on):
        norms = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, RMSNorm)]
        assert norms and all(m.cpu_kernel is on for m in norms)

    same_greedy_either_way("cpu_norm_kernel", check, 1e-4)
