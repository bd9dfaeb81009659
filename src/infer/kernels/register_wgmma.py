"""What the Gluon kernels whose weights are decoded into the wgmma's register operand
(`fp8_wgmma.py`, `gguf_wgmma.py`) share: 64 rows of W a program (the wgmma's M, one
warpgroup of 4 warps) as operand A in registers, BLOCK_M rows of x (its N) gathered into
shared memory by 4-byte `cp.async` as operand B, float32 sums.

Gluon is experimental: Triton 3.6 (the device's) and later versions name some calls
differently (`async_load`); importing this module fails on a Triton without Gluon's Hopper
calls (`kernels.gluon_hopper` asks).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

# Triton 3.6 names it async_copy_global_to_shared, later versions async_load
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.constexpr_function
def sums_layout(block_m):
    """The float32 sums `[64, BLOCK_M]`."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, block_m, 16])


@gluon.constexpr_function
def weights_layout(block_m):
    """The 16-bit weights `[64, BLOCK_K]` as the wgmma's register operand."""
    return gl.DotOperandLayout(operand_index=0, parent=sums_layout(block_m), k_width=2)


@gluon.constexpr_function
def x_gather_layout():
    """x's addresses `[BLOCK_M, BLOCK_K]`: two contiguous elements (one `cp.async`) a
    thread, a warp along K."""
    return gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[1, 32],
                            warps_per_cta=[4, 1], order=[1, 0])


@gluon.constexpr_function
def x_shared_layout(block_m, block_k):
    """x's bfloat16 tile `[BLOCK_M, BLOCK_K]` in shared memory, as the wgmma reads it."""
    return gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.bfloat16)
