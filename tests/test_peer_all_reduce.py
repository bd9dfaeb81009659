"""The custom all-reduce's choices that hold on any machine: which tensors it takes (by
size and dtype only, so that every rank makes the same choice) and why it stays off
where it cannot run. Its sums are checked on GPUs by benchmarks/all_reduce.py and by
tensor_parallel.py's token comparison."""

from __future__ import annotations

import pytest
import torch

from infer.distributed.peer_all_reduce import PeerAllReduce, why_not


@pytest.fixture
def peer() -> PeerAllReduce:
    # A plain buffer: only the decisions are under test here, no kernel runs.
    return PeerAllReduce(torch.empty(1024, dtype=torch.uint8), "unused", max_bytes=1024)


@pytest.mark.parametrize("shape, dtype, taken", [
    ((1, 512), torch.bfloat16, True),     # 1024 bytes: exactly the buffer
    ((2, 128), torch.float32, True),
    ((8,), torch.float16, True),          # 16 bytes: one vector
    ((513,), torch.bfloat16, False),      # 1026 bytes: larger than the buffer
    ((4,), torch.bfloat16, False),        # 8 bytes: not a whole vector
    ((0,), torch.bfloat16, False),
    ((16,), torch.int64, False),          # sums of ints go through NCCL
    ((64,), torch.float64, False),
])
def test_takes_tensors_by_size_and_dtype(peer, shape, dtype, taken):
    assert peer.takes(torch.zeros(shape, dtype=dtype)) is taken


def test_a_declined_tensor_is_left_untouched(peer):
    x = torch.arange(600, dtype=torch.bfloat16)
    assert peer(x) is False
    assert torch.equal(x, torch.arange(600, dtype=torch.bfloat16))


def test_stays_off_on_cpu_ranks_and_says_why():
    assert why_not(torch.device("cpu"), 2) == "the ranks run on cpu, not CUDA"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() > 1,
                    reason="needs exactly one GPU")
def test_more_ranks_than_gpus_is_named():
    assert "2 ranks but 1 GPUs" in why_not(torch.device("cuda", 0), 2)
