"""infer's CPU matmuls by GGUF-style blocks of 32 weights (`cpu_block_linear.cpp`): 4-bit
`{fp16 d, fp16 m, 16 bytes of nibbles}` and 8-bit `{fp16 d, 32 int8}` blocks, x rounded to
int8 per 32 values and each block's dot product taken in integers, as llama.cpp's CPU
kernels do (AVX2; `_mm256_dpbusd` where the compiler targets AVX-512 VNNI).

Part of infer's CPU extension (`cpu_extension.py`: built at first use; `available()` says
whether it loaded, else callers take PyTorch's kernels).
"""

from __future__ import annotations

import torch

BLOCK = 32
Q4_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
Q8_BLOCK_BYTES = 34  # fp16 d, 32 int8


def on_by_default() -> bool:
    """Whether GGUF models on this CPU take these kernels unless told (
    `EngineConfig.cpu_int8_activations`): where torch's own CPU kernels are AVX2 ones; with
    AVX-512 PyTorch's INT4 kernel is as fast at one row and faster at eight."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def q4_1_linear(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """float32 `x [rows, in]` times the 4-bit `blocks [out, in / 32 * 20]` (uint8)
    transposed: float32 `[rows, out]`."""
    return torch.ops.infer_cpu.q4_1_linear(x, blocks)


def q8_0_linear(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """float32 `x [rows, in]` times the 8-bit `blocks [out, in / 32 * 34]` (uint8)
    transposed: float32 `[rows, out]`."""
    return torch.ops.infer_cpu.q8_0_linear(x, blocks)
