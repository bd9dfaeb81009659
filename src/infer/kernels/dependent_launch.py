"""Programmatic dependent launch (Hopper and later): a kernel launched with it may be
scheduled while the kernel before it in the stream is still running, so that its launch,
and the reads that depend on no earlier kernel (weights), overlap that kernel's last wave.
A batch-1 decode step is ~140 launches of a few microseconds each, and the gap between
two of them is a large part of each.

The contract of every kernel launched with `launch_options()`:
- `wait(PDL)` before it reads anything an earlier kernel of the step wrote, or writes
  anything one reads: only what no kernel of the step writes may be read before (weights;
  a graph's metadata, staged by copies or by kernels before the graph starts);
- `release(PDL)` after `wait`, which lets the next kernel be scheduled (so at most one
  kernel runs ahead of the one it waits for).
`wait` returns once the kernel before has finished and its writes are visible; a kernel
launched without the option, or without a kernel before it, does not wait.

On by `EngineConfig.dependent_launch` (`set_enabled`, at engine setup), for CUDA devices of
compute capability 9 and later; never under Triton's CPU interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import gpu_compiled

_enabled = False


def supported(device: torch.device) -> bool:
    return gpu_compiled(device) and torch.cuda.get_device_capability(device)[0] >= 9


def set_enabled(on: bool) -> None:
    """Launch infer's decode kernels with programmatic dependent launch (from now on,
    graphs captured after this included)."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def launch_options() -> dict:
    """The keyword arguments a kernel launch adds: its `PDL` constexpr, and Triton's
    `launch_pdl` when on."""
    return {"PDL": True, "launch_pdl": True} if _enabled else {"PDL": False}


@triton.jit
def wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
