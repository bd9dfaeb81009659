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


def _plain_eager_and_replayed(chain, inputs, stage=lambda i: None):
    """`chain(x)` for each input launched plainly, with dependent launch eagerly, and with
    it replayed from one CUDA graph; `stage(i)` before input i's (as a graph's metadata is
    staged before it runs)."""
    from infer.engine.runner_setup import set_dependent_launch
    from infer.kernels import dependent_launch

    device = torch.device("cuda")

    def each(run):
        out = []
        for i, x in enumerate(inputs):
            stage(i)
            out.append(tuple(t.clone() for t in run(x)))
        return out

    try:
        set_dependent_launch(False, device)
        plain = each(chain)
        set_dependent_launch(True, device)
        assert dependent_launch.enabled()
        eager = each(chain)
        static = inputs[0].clone()
        stage(0)
        chain(static)  # compiled before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static)

        def replay(x):
            static.copy_(x)
            graph.replay()
            return out

        replayed = each(replay)
        torch.cuda.synchronize()
    finally:
        set_dependent_launch(False, device)
    return plain, eager, replayed


def _int8(gen: torch.Generator, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 weights `[rows, cols]` and small per-row bfloat16 scales, on the GPU."""
    w = torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8).cuda()
    return w, (torch.rand(rows, generator=gen) * 1e-3).to("cuda", torch.bfloat16)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA GPU of compute capability 9+")
def test_dependent_launches_read_what_the_kernel_before_wrote():
    gen = torch.Generator().manual_seed(0)
    hidden, inter = 1024, 2816

    def rand(*shape):
        return torch.randn(*shape, generator=gen).mul_(0.05).to("cuda", torch.bfloat16)

    weights = [(rand(2 * inter, hidden), rand(hidden, inter)) for _ in range(6)]
    norm_weight = rand(hidden) + 1
    w8, w8_scale = _int8(gen, hidden, inter)
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


@pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA GPU of compute capability 9+")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dependent_launches_of_a_layers_attention(head_dim):
    """qkv GEMV, RoPE + KV store, split decode attention combined by its last split (a
    graph's launch, made for 64 splits: those past the sequence's keys end before their
    wait), o GEMV: each reading what the one before wrote, the lengths, positions and
    slots staged before each run, sequences of 1 to 300 tokens."""
    from infer.kernels.gemv import gemv
    from infer.kernels.paged_attention import paged_decode
    from infer.kernels.rope_kv_store import rope_store_kv

    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, block_size, blocks = 8, 2, 16, 32
    hidden = heads * head_dim
    qkv_width = (heads + 2 * kv_heads) * head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen).mul_(0.05).to("cuda", torch.bfloat16)

    w_qkv, w_o = rand(qkv_width, hidden), rand(hidden, hidden)
    pristine = [rand(blocks, block_size, kv_heads, head_dim) * 20 for _ in range(2)]
    caches = [c.clone() for c in pristine]
    angles = torch.arange(512.0)[:, None] / 10000 ** (torch.arange(head_dim // 2) / (head_dim // 2))
    cos, sin = angles.cos().cuda(), angles.sin().cuda()
    table = torch.randperm(blocks, generator=gen)[None].to("cuda", torch.int32)
    seq_lens = torch.zeros(1, device="cuda", dtype=torch.int32)
    positions = torch.zeros(1, device="cuda", dtype=torch.int64)
    slots = torch.zeros(1, device="cuda", dtype=torch.int64)
    counters = torch.zeros(kv_heads, device="cuda", dtype=torch.int32)
    out = torch.empty(1, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    lengths = [300, 1, 65, 129]

    def stage(i):  # every run from the same caches: each stores its token's keys
        for cache, start in zip(caches, pristine):
            cache.copy_(start)
        n = lengths[i]
        seq_lens.fill_(n)
        positions.fill_(n - 1)
        slots.fill_(int(table[0, (n - 1) // block_size]) * block_size + (n - 1) % block_size)

    def chain(x):
        qkv = gemv(x, w_qkv)
        q = qkv[:, :hidden].view(1, heads, head_dim)
        k = qkv[:, hidden:hidden + kv_heads * head_dim].view(1, kv_heads, head_dim)
        v = qkv[:, hidden + kv_heads * head_dim:].view(1, kv_heads, head_dim)
        rope_store_kv(q, k, v, *caches, slots, positions, cos, sin)
        paged_decode(q, *caches, seq_lens, table, head_dim ** -0.5, num_splits=64, out=out,
                     split_counters=counters, min_split_keys=64)
        return (gemv(out.view(1, hidden), w_o),)

    inputs = [rand(1, hidden) for _ in lengths]
    plain, eager, replayed = _plain_eager_and_replayed(chain, inputs, stage)
    assert len({float(p[0].float().norm()) for p in plain}) == len(lengths)
    for want, got_eager, got_graph in zip(plain, eager, replayed):
        assert torch.isfinite(want[0]).all()
        assert torch.equal(want[0], got_eager[0]) and torch.equal(want[0], got_graph[0])


@pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA GPU of compute capability 9+")
def test_dependent_launches_around_a_launch_that_does_nothing():
    """Two rows through norms, the gate_up GEMV a row at a time whose first launch does
    nothing where the row-skip flag is set (only its program 0 waits for the kernel before:
    the kernels after still find what came before done), and the two-row down GEMV that
    skips the first row with it; the flag staged set, clear, set: the second row (and,
    where clear, the first) bit for bit the plain launches'."""
    from infer.kernels.gemv import gemv, gemv_gate_up_rows_apart
    from infer.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
    from infer.kernels.row_skip import first_row_skipped_where

    gen = torch.Generator().manual_seed(3)
    hidden, inter = 1024, 4096

    layers = [(_int8(gen, 2 * inter, hidden), _int8(gen, hidden, inter)) for _ in range(4)]
    norm_weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    flag = torch.zeros(1, device="cuda", dtype=torch.int32)
    flags = [1, 0, 1]

    def chain(x):
        residual = x.clone()
        h = rmsnorm(x, norm_weight, 1e-6)
        with first_row_skipped_where(flag):
            for (up, up_scale), (down, down_scale) in layers:
                act = gemv_gate_up_rows_apart(h, up, "silu", up_scale)
                h, residual = fused_add_rmsnorm(gemv(act, down, scale=down_scale), residual,
                                                norm_weight, 1e-6)
        return (h,)

    inputs = [torch.randn(2, hidden, generator=gen).to("cuda", torch.bfloat16)
              for _ in flags]
    plain, eager, replayed = _plain_eager_and_replayed(
        chain, inputs, lambda i: flag.fill_(flags[i]))
    for set_flag, want, got_eager, got_graph in zip(flags, plain, eager, replayed):
        rows = slice(1, 2) if set_flag else slice(0, 2)
        want, got_eager, got_graph = (t[0][rows] for t in (want, got_eager, got_graph))
        assert torch.isfinite(want).all()
        assert torch.equal(want, got_eager) and torch.equal(want, got_graph)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA GPU of compute capability 9+")
def test_dependent_launches_of_the_int8_dp4a_one_row_path():
    """One row through INT8 layers as the engine takes it (`int8_x16_gemv`): the norm
    splitting its output into halves in its own launch, the gate_up GEMV by dp4a storing
    the activation, the down projection by the float GEMV, each reading what the one
    before wrote: bit for bit the plain launches'."""
    from infer.kernels.gemv import gemv
    from infer.kernels.int8_x16_gemv import int8_x16_gemv
    from infer.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

    gen = torch.Generator().manual_seed(5)
    hidden, inter = 1024, 4096

    layers = [(_int8(gen, 2 * inter, hidden), _int8(gen, hidden, inter)) for _ in range(4)]
    norm_weight = (torch.rand(hidden, generator=gen) + 0.5).to("cuda", torch.bfloat16)

    def chain(x):
        residual = x.clone()
        h, halves = rmsnorm(x, norm_weight, 1e-6, x16_rows=True)
        for (up, up_scale), (down, down_scale) in layers:
            act = int8_x16_gemv(h, up, up_scale, "silu", halves=halves)
            h, residual, halves = fused_add_rmsnorm(
                gemv(act, down, scale=down_scale), residual, norm_weight, 1e-6,
                x16_rows=True)
        return h, residual

    inputs = [torch.randn(1, hidden, generator=gen).to("cuda", torch.bfloat16)
              for _ in range(3)]
    plain, eager, replayed = _plain_eager_and_replayed(chain, inputs)
    for want, got_eager, got_graph in zip(plain, eager, replayed):
        assert torch.isfinite(want[0]).all()
        for a, b, c in zip(want, got_eager, got_graph):
            assert torch.equal(a, b) and torch.equal(a, c)
