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
    """Layers of a decode step at one row: norm, GEMV storing its activation, GEMV,
    add + norm, activation, W8A16."""
    from infer.kernels.activation import swiglu
    from infer.kernels.gemv import gemv, gemv_gate_up
    from infer.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
    from infer.kernels.w8a16_matmul import w8a16_matmul

    residual = x.clone()
    h = rmsnorm(x, norm_weight, 1e-6)
    for up, down in weights:
        h, residual = fused_add_rmsnorm(gemv(gemv_gate_up(h, up, "silu"), down), residual,
                                        norm_weight, 1e-6)
        h = w8a16_matmul(swiglu(gemv(h, up)), w8, w8_scale)
    return h, residual


def _plain_eager_and_replayed(chain, inputs):
    """`chain(x)` for each input launched plainly, with dependent launch eagerly, and with
    it replayed from one CUDA graph."""
    from infer.engine.runner_setup import set_dependent_launch
    from infer.kernels import dependent_launch

    device = torch.device("cuda")
    try:
        set_dependent_launch(False, device)
        plain = [chain(x) for x in inputs]
        set_dependent_launch(True, device)
        assert dependent_launch.enabled()
        eager = [chain(x) for x in inputs]
        static = inputs[0].clone()
        chain(static)  # compiled before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static)
        replayed = []
        for x in inputs:
            static.copy_(x)
            graph.replay()
            replayed.append(tuple(t.clone() for t in out))
        torch.cuda.synchronize()
    finally:
        set_dependent_launch(False, device)
    return plain, eager, replayed


@pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA GPU of compute capability 9+")
def test_dependent_launches_read_what_the_kernel_before_wrote():
    gen = torch.Generator().manual_seed(0)
    hidden, inter = 1024, 2816

    def rand(*shape):
        return torch.randn(*shape, generator=gen).mul_(0.05).to("cuda", torch.bfloat16)

    weights = [(rand(2 * inter, hidden), rand(hidden, inter)) for _ in range(6)]
    norm_weight = rand(hidden) + 1
    w8 = torch.randint(-127, 128, (hidden, inter), generator=gen, dtype=torch.int8).cuda()
    w8_scale = (torch.rand(hidden, generator=gen) * 1e-3).to("cuda", torch.bfloat16)
    inputs = [rand(1, hidden) for _ in range(3)]
    plain, eager, replayed = _plain_eager_and_replayed(
        lambda x: _chain(x, weights, norm_weight, w8, w8_scale), inputs)
    for want, got_eager, got_graph in zip(plain, eager, replayed):
        for a, b, c in zip(want, got_eager, got_graph):
            assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA GPU of compute capability 9+")
def test_dependent_launches_of_the_gguf_one_row_kernels():
    """x's rounding, the int8-x Q4_K and Q6_K kernels (K split: the split counters too) and
    the exact GGUF path, each reading what the one before wrote."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from test_gguf_models import random_kquant_blocks

    from infer.kernels import gguf_q4k_int8x as q4k
    from infer.kernels import gguf_q6k_int8x as q6k
    from infer.kernels.gguf_gemv import gemv_words
    from infer.kernels.gguf_matmul import gguf_matmul
    from infer.kernels.rmsnorm import rmsnorm

    hidden = 1024
    rng = np.random.default_rng(0)
    blocks = {qtype: torch.from_numpy(random_kquant_blocks(hidden * hidden, qtype, rng)
                                      .reshape(hidden, -1)).cuda() for qtype in (Q.Q4_K, Q.Q6_K)}
    words = {qtype: gemv_words(data, qtype) for qtype, data in blocks.items()}
    norm_weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)

    def chain(x):
        h = x
        for _ in range(3):
            h = rmsnorm(q4k.q4k_gemv_int8x(h, words[Q.Q4_K], hidden, block_n=16, split=4),
                        norm_weight, 1e-6)
            h = rmsnorm(q6k.q6k_gemv_int8x(h, words[Q.Q6_K], hidden, block_n=16, split=2),
                        norm_weight, 1e-6)
            h = rmsnorm(gguf_matmul(h, blocks[Q.Q4_K], Q.Q4_K, hidden), norm_weight, 1e-6)
        return (h,)

    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1, hidden, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]
    plain, eager, replayed = _plain_eager_and_replayed(chain, inputs)
    for want, got_eager, got_graph in zip(plain, eager, replayed):
        assert torch.isfinite(want[0]).all()
        assert torch.equal(want[0], got_eager[0]) and torch.equal(want[0], got_graph[0])
