"""The fused all-reduce + residual add + RMSNorm (kernels/all_reduce_norm.py) in the Triton
interpreter (on the GPU with INFER_TEST_DEVICE=cuda), as one rank of a world whose other
ranks write their partials into this rank's staging buffer, before the call or while it
waits; and on a GPU as two ranks in two threads and streams making a chain of calls.

Against the unfused path: the partials summed in rank order and rounded once (NCCL's sum
of two), then the model's own (add +) RMSNorm, bit for bit in bf16 (float32: the residual
bit for bit, the norm to rounding). Also what the peers rely on: this rank's partial
written into every peer's buffer as tagged words, in the half its call count picks, its
counts advanced per row; and that it waits for words of its own call, not those of the
call two before that the same half still holds. Across GPUs the kernel meets real peers
in benchmarks/all_reduce_norm.py and benchmarks/tensor_parallel.py.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import torch

from infer.kernels import triton_available

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from infer.distributed.peer_add_rmsnorm import HALF_BYTES, MAX_ROWS, PeerAddRMSNorm
from infer.kernels.all_reduce_norm import all_reduce_add_rmsnorm
from infer.models.layers import RMSNorm

HIDDEN, SLOTS = 72, 4
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def words(values: torch.Tensor, tag: int) -> torch.Tensor:
    """A row as a peer sends it: each 4 bytes of it (little-endian: a 16-bit pair's first
    value in the low bits) in the low half of an int64 word, `tag` in the high half."""
    data = values.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return data | (tag << 32)


class World:
    """Every rank's staging buffer, as symmetric memory lays it out (two halves of int64
    words: per row, a place per source rank)."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        self.size = size
        self.row_words = HIDDEN * dtype.itemsize // 4
        self.half = SLOTS * size * self.row_words
        self.staging = [torch.zeros(2, self.half, dtype=torch.int64, device=DEVICE)
                        for _ in range(size)]
        self.buffers = torch.tensor([b.data_ptr() for b in self.staging], device=DEVICE)

    def part(self, half: int, source: int, row: int, reader: int) -> torch.Tensor:
        """Where `reader` finds `source`'s words of `row`: in its own buffer, at the
        source's place."""
        start = (row * self.size + source) * self.row_words
        return self.staging[reader][half, start:start + self.row_words]


def on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def model_norm(dtype: torch.dtype, offset: float = 0.0) -> RMSNorm:
    """The model's norm; on a GPU through its Triton kernels, as the engine's unfused path
    runs it there (torch's CUDA reductions may round a bf16 result differently)."""
    norm = RMSNorm(HIDDEN, 1e-6, offset).to(DEVICE, dtype).requires_grad_(False)
    norm.weight.copy_(torch.randn(HIDDEN) * 0.2 + (0.0 if offset else 1.0))
    norm.use_triton = DEVICE == "cuda"
    return norm


def exactly(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def unfused(norm: RMSNorm, partials: list[torch.Tensor], residual: torch.Tensor | None):
    total = partials[0].float()
    for p in partials[1:]:
        total = total + p.float()
    summed = total.to(partials[0].dtype)
    return norm(summed) if residual is None else norm(summed, residual.clone())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("size, rank", [(2, 0), (2, 1), (3, 1)])
@pytest.mark.parametrize("offset, with_residual", [(0.0, True), (1.0, True), (1.0, False)])
def test_one_rank_of_a_world_equals_the_unfused_path(bf16_rounds_to_nearest, dtype, size,
                                                     rank, offset, with_residual):
    """With a residual as Llama's norms take it; without, as Gemma 3's sandwich norms."""
    world = World(size, dtype)
    epochs = torch.zeros(SLOTS, dtype=torch.int64, device=DEVICE)
    counts = [0] * SLOTS  # what epochs must hold
    norm = model_norm(dtype, offset)
    for rows in [3, 1, 4, 2, 3]:  # rows' counts drift apart
        partials = [(torch.randn(rows, HIDDEN) * 2).to(DEVICE, dtype) for _ in range(size)]
        residual = (torch.randn(rows, HIDDEN) * 2).to(DEVICE, dtype)
        for row in range(rows):
            epoch = counts[row] + 1
            for peer in range(size):
                if peer != rank:
                    world.part(epoch % 2, peer, row, rank).copy_(
                        words(partials[peer][row], epoch))
                    # A peer may already be a call ahead, in the other half.
                    world.part(1 - epoch % 2, peer, row, rank).copy_(
                        words(torch.full((HIDDEN,), 1e4, dtype=dtype, device=DEVICE),
                              epoch + 1))
        want = unfused(norm, partials, residual if with_residual else None)
        got = all_reduce_add_rmsnorm(partials[rank].clone(),
                                     residual if with_residual else None, norm.weight,
                                     norm.eps, offset, world.buffers, epochs, rank, world.half)
        if with_residual:
            (want_out, want_res), (out, res) = want, got
            assert res.data_ptr() == residual.data_ptr(), "the residual is updated in place"
            exactly(res, want_res)
        else:
            want_out, out = want, got
        if dtype == torch.bfloat16:
            exactly(out, want_out)
        else:  # torch's float32 norm sums the squares in another order
            torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
        for row in range(rows):
            counts[row] += 1
            for peer in range(size):
                if peer != rank:
                    sent = world.part(counts[row] % 2, rank, row, peer)
                    assert torch.equal(sent, words(partials[rank][row], counts[row]))
        assert epochs.tolist() == counts


def test_waits_for_its_calls_words_not_the_stale_ones_in_the_same_half(
        bf16_rounds_to_nearest):
    """Rank 0 of two, at its third call of a row: the half holds the peer's words of the
    first call (a tag two behind) until the peer's third call writes them, while the
    kernel runs; the kernel must have waited for them."""
    dtype = torch.bfloat16
    world = World(2, dtype)
    epochs = torch.tensor([2, 0, 0, 0], dtype=torch.int64, device=DEVICE)  # 2 calls done
    norm = model_norm(dtype)
    mine, peers, stale = ((torch.randn(1, HIDDEN) * 2).to(DEVICE, dtype) for _ in range(3))
    world.part(1, 1, 0, 0).copy_(words(stale[0], 1))
    world.part(0, 1, 0, 0).copy_(words(stale[0], 2))  # the call before's half

    arriving = words(peers[0], 3)

    def peer_arrives() -> None:
        time.sleep(0.3)
        with on_stream(torch.cuda.Stream() if DEVICE == "cuda" else None):
            world.part(1, 1, 0, 0).copy_(arriving)

    sync()
    writer = threading.Thread(target=peer_arrives)
    writer.start()
    residual = (torch.randn(1, HIDDEN) * 2).to(DEVICE, dtype)
    want_out, want_res = unfused(norm, [mine, peers], residual)
    sync()
    # On a GPU off the default stream, which a copy on another stream would wait for.
    with on_stream(torch.cuda.Stream() if DEVICE == "cuda" else None):
        out, res = all_reduce_add_rmsnorm(mine.clone(), residual, norm.weight, norm.eps,
                                          0.0, world.buffers, epochs, 0, world.half)
    writer.join()
    sync()
    exactly(out, want_out)
    exactly(res, want_res)
    assert epochs.tolist() == [3, 0, 0, 0]


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter runs one kernel at a time")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_ranks_in_threads_make_a_chain_of_calls(bf16_rounds_to_nearest, dtype):
    """Each rank's calls in a thread of its own (on a GPU, its own stream; its kernels run
    beside the other rank's), each call on the residual stream the call before left, row
    counts changing between calls so that the halves and tags of rows drift apart: every
    output and every final residual equal the unfused path's, on both ranks."""
    world = World(2, dtype)
    norm = model_norm(dtype)
    row_counts = [1, 3, 3, 2, 4, 1, 1, 4]
    partials = [[(torch.randn(rows, HIDDEN) * 2).to(DEVICE, dtype) for _ in range(2)]
                for rows in row_counts]
    start = (torch.randn(max(row_counts), HIDDEN) * 2).to(DEVICE, dtype)
    want, residual = [], start.clone()
    for rows, parts in zip(row_counts, partials):
        out, head = unfused(norm, parts, residual[:rows])
        residual[:rows] = head
        want.append(out)
    got: list[list] = [[], []]
    residuals = [start.clone(), start.clone()]
    errors: list[BaseException] = []

    def rank_calls(rank: int) -> None:
        try:
            epochs = torch.zeros(SLOTS, dtype=torch.int64, device=DEVICE)
            with on_stream(torch.cuda.Stream() if DEVICE == "cuda" else None):
                for rows, parts in zip(row_counts, partials):
                    head = residuals[rank][:rows]
                    out, _ = all_reduce_add_rmsnorm(parts[rank].clone(), head, norm.weight,
                                                    norm.eps, 0.0, world.buffers, epochs,
                                                    rank, world.half)
                    got[rank].append(out)
                if DEVICE == "cuda":
                    torch.cuda.current_stream().synchronize()
        except BaseException as exc:
            errors.append(exc)

    sync()
    threads = [threading.Thread(target=rank_calls, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank still waits"
    assert not errors, errors
    for rank in range(2):
        exactly(residuals[rank], residual)
        for out, want_out in zip(got[rank], want):
            if dtype == torch.bfloat16:
                exactly(out, want_out)
            else:
                torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)


def test_takes_decode_rows_only_by_shape_and_dtype():
    fused = PeerAddRMSNorm(torch.zeros(2, dtype=torch.int64), rank=0)  # two ranks
    row_bytes = 4096 * 2 * 2 * 2  # 8-byte words of 4 bytes, from both ranks

    def takes(rows: int, dtype=torch.bfloat16, residual_dtype=None, n=4096) -> bool:
        x = torch.zeros(rows, n, dtype=dtype)
        return fused.takes(x, torch.zeros(rows, n, dtype=residual_dtype or dtype))

    assert MAX_ROWS * row_bytes <= HALF_BYTES
    assert takes(1) and takes(MAX_ROWS)
    assert takes(MAX_ROWS, n=8192)  # a 70B's rows
    assert not takes(MAX_ROWS + 1)  # larger batches and prefills: NCCL, then the norm
    assert not takes(0)
    assert not takes(1, torch.float64)
    assert not takes(1, torch.bfloat16, torch.float32)
    assert not takes(1, n=4095)  # an odd row of 16-bit values fills no whole word
    assert takes(1, torch.float32, n=4095)
    assert fused.takes(torch.zeros(1, 4096, dtype=torch.bfloat16), None)  # Gemma's norms
    x = torch.zeros(2, 8192, dtype=torch.bfloat16)[:, :4096]  # a view with gaps
    assert not fused.takes(x, torch.zeros(2, 4096, dtype=torch.bfloat16))
