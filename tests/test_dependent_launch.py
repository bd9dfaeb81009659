"""Programmatic dependent launch (kernels/dependent_launch.py): never on without a GPU that
has it; on one (INFER_TEST_DEVICE=cuda, compute capability 9+), a chain of infer's decode
kernels launched so -- each reading what the one before wrote, eagerly and replayed from
a CUDA graph -- gives bit for bit what the same chain gives launched plainly."""

from __future__ import annotations

import os

import pytest
import torch

from infer.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

ON_HOPPER = (os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()
             and torch.cuda.get_device_capability()[0] >= 9)


def test_a_cpu_engine_never_launches_dependently():
    from infer.engine.runner_setup import set_dependent_launch
    from infer.kernels import dependent_launch

    set_dependent_launch(True, torch.device("cpu"))
    assert not dependent_launch.enabled()
    assert dependent_launch.launch_options() == {"PDL": False}


def _chain(x, weights, norm_weight, w8, w8_scale):
    """Layers of a decode step at one row: norm, GEMV, add + norm, gated GEMV, W8A16."""
    from infer.kernels.activation import swiglu
    from infer.kernels.gemv import gemv
    from infer.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
    from infer.kernels.w8a16_matmul import w8a16_matmul

    residual = x.clone()
    h = rmsnorm(x, norm_weight, 1e-6)
    for up, down in weights:
        gate_up = gemv(h, up)
        h, residual = fused_add_rmsnorm(gemv(gate_up, down, act="silu"), residual,
                                        norm_weight, 1e-6)
        h = w8a16_matmul(swiglu(gemv(h, up)), w8, w8_scale)
    return h, residual


@pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA GPU of compute capability 9+")
def test_dependent_launches_read_what_the_kernel_before_wrote():
    from infer.engine.runner_setup import set_dependent_launch
    from infer.kernels import dependent_launch

    gen = torch.Generator().manual_seed(0)
    hidden, inter = 1024, 2816

    def rand(*shape):
        return torch.randn(*shape, generator=gen).mul_(0.05).to("cuda", torch.bfloat16)

    weights = [(rand(2 * inter, hidden), rand(hidden, inter)) for _ in range(6)]
    norm_weight = rand(hidden) + 1
    w8 = torch.randint(-127, 128, (hidden, inter), generator=gen, dtype=torch.int8).cuda()
    w8_scale = (torch.rand(hidden, generator=gen) * 1e-3).to("cuda", torch.bfloat16)
    inputs = [rand(1, hidden) for _ in range(3)]
    device = torch.device("cuda")
    try:
        set_dependent_launch(False, device)
        plain = [_chain(x, weights, norm_weight, w8, w8_scale) for x in inputs]
        set_dependent_launch(True, device)
        assert dependent_launch.enabled()
        eager = [_chain(x, weights, norm_weight, w8, w8_scale) for x in inputs]
        static = inputs[0].clone()
        _chain(static, weights, norm_weight, w8, w8_scale)  # compiled before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(static, weights, norm_weight, w8, w8_scale)
        replayed = []
        for x in inputs:
            static.copy_(x)
            graph.replay()
            replayed.append(tuple(t.clone() for t in out))
        torch.cuda.synchronize()
    finally:
        set_dependent_launch(False, device)
    for want, got_eager, got_graph in zip(plain, eager, replayed):
        for a, b, c in zip(want, got_eager, got_graph):
            assert torch.equal(a, b) and torch.equal(a, c)
