"""The fused all-reduce + residual add + RMSNorm (kernels/all_reduce_norm.py) in the Triton
interpreter, as one rank of a world whose other ranks have already written their partials
and raised their flags (in one process a rank cannot wait for a peer still to come).

Against the unfused path: the partials summed in rank order and rounded once (NCCL's sum
of two), then the model's own (add +) RMSNorm, bit for bit in bf16 (float32: the residual
bit for bit, the norm to rounding). Also what the peers rely on: this rank's partial
written into every rank's buffer, in the half its call count picks, its flag raised on
every peer, its counts advanced per row. On GPUs the kernel meets real peers in
benchmarks/all_reduce_norm.py and benchmarks/tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from infer.kernels import triton_available

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from infer.distributed.peer_add_rmsnorm import HALF_BYTES, MAX_ROWS, PeerAddRMSNorm
from infer.kernels.all_reduce_norm import all_reduce_add_rmsnorm
from infer.models.layers import RMSNorm

HIDDEN, SLOTS, HALF = 72, 4, 4 * 3 * 72  # HALF: elements per half of a staging buffer


class World:
    """Every rank's staging buffer and flag array, as symmetric memory lays them out."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        self.size = size
        self.staging = [torch.full((2, HALF), float("nan"), dtype=dtype) for _ in range(size)]
        self.flags = [torch.zeros(SLOTS, size, dtype=torch.int64) for _ in range(size)]
        self.buffers = torch.tensor([b.data_ptr() for b in self.staging])
        self.flag_ptrs = torch.tensor([f.data_ptr() for f in self.flags])

    def part(self, half: int, source: int, row: int, reader: int) -> torch.Tensor:
        """Where `reader` finds `source`'s partial of `row`: in its own buffer, at the
        source's place."""
        start = (row * self.size + source) * HIDDEN
        return self.staging[reader][half, start:start + HIDDEN]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("size, rank", [(2, 0), (2, 1), (3, 1)])
@pytest.mark.parametrize("offset, with_residual", [(0.0, True), (1.0, True), (1.0, False)])
def test_one_rank_of_a_world_equals_the_unfused_path(bf16_rounds_to_nearest, dtype, size,
                                                     rank, offset, with_residual):
    """With a residual as Llama's norms take it; without, as Gemma 3's sandwich norms."""
    world = World(size, dtype)
    epochs = torch.zeros(SLOTS, dtype=torch.int64)
    counts = [0] * SLOTS  # what epochs must hold
    norm = RMSNorm(HIDDEN, 1e-6, offset).to(dtype).requires_grad_(False)
    norm.weight.copy_(torch.randn(HIDDEN) * 0.2 + (0.0 if offset else 1.0))
    for call, rows in enumerate([3, 1, 4, 2, 3]):  # rows' counts drift apart
        partials = [(torch.randn(rows, HIDDEN) * 2).to(dtype) for _ in range(size)]
        residual = (torch.randn(rows, HIDDEN) * 2).to(dtype)
        for row in range(rows):
            epoch = counts[row] + 1
            for peer in range(size):
                if peer != rank:
                    world.part(epoch % 2, peer, row, rank).copy_(partials[peer][row])
                    # The other half: what a peer staged for another call (never read).
                    world.part(1 - epoch % 2, peer, row, rank).fill_(1e4)
                    # A peer may already have raised the next call's flag.
                    world.flags[rank][row, peer] = epoch + (call % 2) * (peer % 2)
        total = partials[0].float()
        for p in partials[1:]:
            total = total + p.float()
        if with_residual:
            want_out, want_res = norm(total.to(dtype), residual.clone())
            out, res = all_reduce_add_rmsnorm(
                partials[rank].clone(), residual, norm.weight, norm.eps, offset,
                world.buffers, world.flag_ptrs, epochs, rank, HALF)
            assert res.data_ptr() == residual.data_ptr(), "the residual is updated in place"
            assert torch.equal(res, want_res)
        else:
            want_out = norm(total.to(dtype))
            out = all_reduce_add_rmsnorm(
                partials[rank].clone(), None, norm.weight, norm.eps, offset,
                world.buffers, world.flag_ptrs, epochs, rank, HALF)
        if dtype == torch.bfloat16:
            assert torch.equal(out, want_out)
        else:  # torch's float32 norm sums the squares in another order
            torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
        for row in range(rows):
            counts[row] += 1
            for peer in range(size):
                staged = world.part(counts[row] % 2, rank, row, peer)
                assert torch.equal(staged, partials[rank][row])
                if peer != rank:
                    assert world.flags[peer][row, rank] == counts[row]
        assert epochs.tolist() == counts


def test_takes_decode_rows_only_by_shape_and_dtype():
    fused = PeerAddRMSNorm(torch.zeros(2, dtype=torch.int64),  # two ranks
                           torch.zeros(2, dtype=torch.int64), rank=0)
    row_bytes = 4096 * 2 * 2  # pushed to both ranks' places

    def takes(rows: int, dtype=torch.bfloat16, residual_dtype=None) -> bool:
        x = torch.zeros(rows, 4096, dtype=dtype)
        return fused.takes(x, torch.zeros(rows, 4096, dtype=residual_dtype or dtype))

    assert MAX_ROWS * row_bytes <= HALF_BYTES
    assert takes(1) and takes(MAX_ROWS)
    assert not takes(MAX_ROWS + 1)  # larger batches and prefills: NCCL, then the norm
    assert not takes(0)
    assert not takes(1, torch.float64)
    assert not takes(1, torch.bfloat16, torch.float32)
    assert fused.takes(torch.zeros(1, 4096, dtype=torch.bfloat16), None)  # Gemma's norms
    x = torch.zeros(2, 8192, dtype=torch.bfloat16)[:, :4096]  # a view with gaps
    assert not fused.takes(x, torch.zeros(2, 4096, dtype=torch.bfloat16))
