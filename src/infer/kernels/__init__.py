"""Triton kernels, each beside a wrapper that asserts shapes/strides/dtypes.

Importing this package never needs Triton; the kernel modules (`rmsnorm`, `rope`,
`activation`, `kv_store`, `paged_attention`, `token_bitmask`, `w8a16_matmul`) import it, so check
`triton_available()` first. Torch references for every kernel live in `reference.py`
(attention's reference is `infer.attention.torch_backend`).
"""

from __future__ import annotations

import functools
import importlib.util

import torch


def triton_available() -> bool:
    """True when `triton` can be imported (kernels then run on CUDA, or on the CPU under
    `TRITON_INTERPRET=1`)."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    """The device's multiprocessors, which launch rules fill (4 stand-ins on a CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
