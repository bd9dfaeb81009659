"""The L2 prefetch a GEMV issues before its dependent-launch wait (kernels/l2_prefetch.py):
the parts its first programs' threads take cover the weight's bytes once each, in
16-byte multiples, whatever the launch; a GPU-less engine never prefetches. (That the
prefetch changes no result, eagerly and in graphs: test_dependent_launch.py on a GPU.)"""

from __future__ import annotations

import pytest
import torch

from infer.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

if triton_available():
    import triton
    import triton.language as tl

    from infer.kernels.l2_prefetch import part_of

    @triton.jit
    def _parts_kernel(start_ptr, size_ptr, total, part, THREADS: tl.constexpr):
        start, size = part_of(total, part, tl.program_id(0), THREADS)
        at = tl.program_id(0) * THREADS + tl.arange(0, THREADS)
        tl.store(start_ptr + at, start)
        tl.store(size_ptr + at, size)


def _parts(plan, grid):
    """Every thread's (start, size) of `plan` over a `grid`-program launch, from the
    kernels' own `part_of` (Triton's interpreter on a CPU)."""
    starts = torch.full((grid * plan.threads,), -1, dtype=torch.int64)
    sizes = torch.full((grid * plan.threads,), -1, dtype=torch.int32)
    _parts_kernel[(grid,)](starts, sizes, plan.total, plan.part, THREADS=plan.threads)
    return [(int(a), int(b)) for a, b in zip(starts, sizes)]


@pytest.mark.parametrize(("rows", "k", "row_stride", "dtype", "grid", "num_warps"), [
    (4096, 4096, 4096, torch.int8, 1024, 8),      # 8B o, INT8: 132 programs prefetch
    (2048, 2048, 2048, torch.bfloat16, 256, 8),   # 1B o, bf16
    (300, 40, 40, torch.int8, 75, 4),             # fewer programs than SMs, 16-byte tail
    (6, 1000, 1003, torch.bfloat16, 2, 4),        # rows apart (a view): the span to the last
])
def test_the_parts_cover_the_weight_once(monkeypatch, rows, k, row_stride, dtype, grid,
                                         num_warps):
    from infer.kernels import dependent_launch, l2_prefetch

    store = torch.zeros(rows * row_stride, dtype=dtype)
    weight = store.view(rows, row_stride)[:, :k]
    _prefetching(monkeypatch, dependent_launch, l2_prefetch, 1 << 30)
    plan = l2_prefetch.plan(weight, grid, num_warps)
    total = ((rows - 1) * row_stride + k) * weight.element_size()
    assert plan.total == total and plan.threads == 32 * num_warps
    parts = _parts(plan, grid)
    taken = sorted((start, size) for start, size in parts if size > 0)
    assert all(start % 16 == 0 and size % 16 == 0 for start, size in taken)
    ends = [start + size for start, size in taken]
    assert taken[0][0] == 0 and ends[-1] == total // 16 * 16
    assert all(end == start for end, (start, _) in zip(ends, taken[1:]))  # no gap, no overlap
    busy = {i // plan.threads for i, (_, size) in enumerate(parts) if size > 0}
    assert max(busy) < min(grid, 132)  # the first wave only


def _prefetching(monkeypatch, dependent_launch, l2_prefetch, max_bytes):
    """A GPU's setting, on a CPU: 132 SMs, dependent launch and the prefetch on, a launch
    inside `prefetch_weights`."""
    monkeypatch.setattr(l2_prefetch, "sm_count", lambda device: 132)
    monkeypatch.setattr(dependent_launch, "_enabled", True)
    monkeypatch.setattr(l2_prefetch, "_enabled", True)
    monkeypatch.setattr(l2_prefetch, "prefetching_weights", lambda: True)
    monkeypatch.setattr(l2_prefetch, "MAX_BYTES", max_bytes)


def test_no_prefetch_on_a_cpu_outside_its_scope_or_past_its_size(monkeypatch):
    from infer.engine.runner_setup import set_dependent_launch
    from infer.kernels import dependent_launch, l2_prefetch, prefetch_weights

    weight = torch.zeros(64, 64, dtype=torch.bfloat16)
    set_dependent_launch(True, torch.device("cpu"), l2_prefetch=True)
    prefetch_weights(True)
    try:
        assert l2_prefetch.plan(weight, 8, 4) == l2_prefetch.NO_PREFETCH
    finally:
        prefetch_weights(False)
    _prefetching(monkeypatch, dependent_launch, l2_prefetch, 64 * 64 * 2)
    assert l2_prefetch.plan(weight, 8, 4).threads == 128
    monkeypatch.setattr(l2_prefetch, "MAX_BYTES", 64 * 64 * 2 - 1)
    assert l2_prefetch.plan(weight, 8, 4) == l2_prefetch.NO_PREFETCH
    monkeypatch.setattr(l2_prefetch, "prefetching_weights", lambda: False)
    monkeypatch.setattr(l2_prefetch, "MAX_BYTES", 64 * 64 * 2)
    assert l2_prefetch.plan(weight, 8, 4) == l2_prefetch.NO_PREFETCH


def test_an_engine_prefetches_its_output_projections_weights_only(monkeypatch):
    """`l2_prefetch_after_attention`: every attention's output projection runs inside
    `prefetch_weights` (its launches may prefetch), the down projections and everything
    after outside it; off, none does."""
    from server_fixtures import tiny_model_dir

    from infer import LLM, SamplingParams
    from infer.kernels import prefetching_weights
    from infer.models.linear import RowParallelLinear

    seen = []
    forward = RowParallelLinear.forward

    def recording(self, x):
        seen.append((id(self), prefetching_weights()))
        return forward(self, x)

    monkeypatch.setattr(RowParallelLinear, "forward", recording)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for on in (True, False):
        llm = LLM(str(tiny_model_dir()), device="cpu", num_blocks=32, max_model_len=64,
                  kernel_backend="triton", attention_backend="triton",
                  l2_prefetch_after_attention=on)
        layers = llm.engine.core.runner.model.model.layers
        outputs = {id(layer.self_attn.o_proj) for layer in layers}
        seen.clear()
        llm.generate(["The tiny model says"], params, use_tqdm=False)
        assert {i for i, _ in seen} == outputs | {id(layer.mlp.down_proj) for layer in layers}
        assert all(prefetching == (on and i in outputs) for i, prefetching in seen), on
        assert not prefetching_weights()
        del llm
