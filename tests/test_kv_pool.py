"""The KV pool on a CPU: zeros that cost no memory until a block is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infer.attention.layer import zeroed_pool

pytestmark = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_pool_is_zeros_aligned_and_taken_only_as_written(dtype):
    shape = (4, 2, 1024, 16, 8, 64)  # 512 MiB in float32, 256 MiB in bfloat16
    before = resident_bytes()
    pool = zeroed_pool(shape, dtype, torch.device("cpu"))
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert pool.data_ptr() % 64 == 0
    assert pool.count_nonzero() == 0  # reading untouched pages maps the zero page
    grown = resident_bytes() - before
    assert grown < 64 << 20, f"{grown >> 20} MiB resident after allocating and reading"
    block = pool[1, 0, 7]
    block.fill_(3.0)
    assert pool[1, 0, 7].eq(3).all() and pool.count_nonzero() == block.numel()
    assert resident_bytes() - before < grown + (64 << 20)


def test_a_pool_elsewhere_is_plain_zeros():
    pool = zeroed_pool((2, 3), torch.float16, torch.device("meta"))
    assert pool.device.type == "meta" and pool.shape == (2, 3)
