"""Triton kernels, each beside a wrapper that asserts shapes/strides/dtypes.

Importing this package never needs Triton; the kernel modules (`rmsnorm`, `rope`,
`activation`, `kv_store`, `paged_attention`, `token_bitmask`, `w8a16_matmul`) import it, so check
`triton_available()` first. Torch references for every kernel live in `reference.py`
(attention's reference is `infer.attention.torch_backend`).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


def triton_available() -> bool:
    """True when `triton` can be imported (kernels then run on CUDA, or on the CPU under
    `TRITON_INTERPRET=1`)."""
    return importlib.util.find_spec("triton") is not None


def gpu_compiled(device: torch.device) -> bool:
    """True when a kernel on `device` is compiled for a GPU rather than run by Triton's
    interpreter, which has neither inline PTX nor launch options."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


@functools.cache
def gluon_hopper(device: torch.device, module: str) -> bool:
    """Whether the Gluon kernel module `infer.kernels.<module>` runs on `device`: a Hopper GPU
    (compute capability 9.x) and a Triton whose Gluon has the Hopper calls the module makes
    (importing it succeeds; Gluon is experimental and renames them between versions)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    try:
        importlib.import_module(f"infer.kernels.{module}")
    except (ImportError, AttributeError):
        return False
    return True


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    """The device's multiprocessors, which launch rules fill (4 stand-ins on a CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


_COUNTERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def launch_counters(kernel: str, device: torch.device, size: int, used: int = 0
                    ) -> torch.Tensor:
    """`kernel`'s `size` int32 counters on `device`, of which a launch uses the first `used`
    (the last program of a group counts itself in and resets its counter): zeros, which
    every launch leaves as it found them. One buffer per kernel and device, made once and
    never replaced, since captured graphs hold its address."""
    if used > size:
        raise ValueError(f"{kernel}: a launch of {used} counters, more than its {size}")
    key = (kernel, device)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return _COUNTERS[key]
