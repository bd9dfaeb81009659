"""GGUF weights on the CPU through infer's block kernels (`kernels/cpu_block_linear.py`):
x rounded to int8 per 32 values, as llama.cpp does (`EngineConfig.cpu_int8_activations`).

- 4-bit layers (Q4_0, Q4_1, Q4_K) as blocks of 32 `{fp16 a, fp16 b, 16 bytes of nibbles}`,
  `w = q * a + b`: a Q4_1 file's own bytes, Q4_0's with `b = -8 a` (exact), Q4_K's
  sub-block scale and min products `d * sc`, `-dmin * mn` rounded to fp16 (relative error
  2^-11, under the 4-bit rounding by far).
- A Q8_0 embedding table and the LM head it is tied to (or a Q8_0 LM head of its own), as
  the file stores them; embedding lookups decode the rows they gather.

Steps of many rows (long prompts) decode the weight to float32 for `F.linear`: the kernels'
work grows with the rows, the GEMM's much less (`DEQUANTIZE_ROWS`, measured with one
thread on SmolLM2's shapes).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from infer.kernels.cpu_block_linear import (
    BLOCK,
    Q4_BLOCK_BYTES,
    Q8_BLOCK_BYTES,
    q4_1_linear,
    q8_0_linear,
)
from infer.models.linear import LinearMethod
from infer.quantization.gguf_blocks import GGUFBlocks

# Steps of at least this many rows decode the weight and use F.linear: on SmolLM2's
# shapes, one thread, the kernel took 0.43-0.53 s for 30 layers at 128 rows against
# 0.72-1.0 s decoded, 0.88-1.08 s against 0.99-1.25 at 256 (AVX2 and AVX-512 torch).
DEQUANTIZE_ROWS = 384


def q4_blocks(q: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """uint8 `[out, in / 32 * 20]` blocks of the weight `q * a + b` (`int4_groups`'s
    `q [out, in]` in 0..15, `a`, `b` `[out, in / 32]`)."""
    rows, cols = q.shape
    groups = q.view(rows, cols // BLOCK, BLOCK)
    nibbles = groups[..., :16] | (groups[..., 16:] << 4)
    scales = torch.stack([a, b], dim=-1).to(torch.float16).view(torch.uint8)
    return torch.cat([scales.view(rows, -1, 4), nibbles], dim=-1).view(rows, -1).contiguous()


def decode_q4_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """The float32 weight `[out, in]` that 4-bit `blocks` stand for."""
    cells = blocks.view(len(blocks), -1, Q4_BLOCK_BYTES)
    scales = cells[..., :4].contiguous().view(torch.float16).float()  # [out, groups, 2]
    nibbles = cells[..., 4:]
    q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).float()
    return (q * scales[..., :1] + scales[..., 1:]).view(len(blocks), -1)


def decode_q8_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """The float32 weight `[out, in]` (or rows of it) that Q8_0 `blocks` stand for."""
    cells = blocks.view(len(blocks), -1, Q8_BLOCK_BYTES)
    d = cells[..., :2].contiguous().view(torch.float16).float()
    q = cells[..., 2:].contiguous().view(torch.int8).float()
    return (q * d).view(len(blocks), -1)


class _CpuBlocksMethod(LinearMethod):
    """`layer.weight`: uint8 blocks `[out, blocks * bytes]`; float32 activations."""

    def _kernel(self, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        flat = x.dim() == 2  # the models' activations are already: no reshape calls then
        x2 = (x if flat else x.reshape(-1, x.shape[-1])).float()
        if len(x2) >= DEQUANTIZE_ROWS:
            y = F.linear(x2, self.dequantize(layer))
        else:
            y = self._kernel(x2, layer.weight)
        if not flat:
            y = y.reshape(*x.shape[:-1], y.shape[-1])
        y = y.to(x.dtype)
        return y if bias is None else y + bias

    def _replace_weight(self, layer: nn.Module, blocks: torch.Tensor) -> None:
        layer.dtype = layer.weight.dtype
        del layer.weight
        layer.register_parameter("weight", nn.Parameter(blocks, requires_grad=False))
        layer.quant_method = self


class Q4BlocksLinearMethod(_CpuBlocksMethod):
    format = "gguf-4bit"

    def load(self, layer: nn.Module, q: torch.Tensor, a: torch.Tensor, b: torch.Tensor
             ) -> None:
        """`layer`'s weight replaced by the blocks of `q * a + b` (`q4_blocks`)."""
        if layer.weight.device.type != "cpu":
            raise ValueError("infer's block kernels run on the CPU only")
        self._replace_weight(layer, q4_blocks(q, a, b))

    def _kernel(self, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return q4_1_linear(x, blocks)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return decode_q4_blocks(layer.weight)


class Q8BlocksTableMethod(_CpuBlocksMethod):
    """A Q8_0 embedding table / LM head as stored."""

    format = "gguf-q8_0"

    def load(self, table: nn.Module, blocks: GGUFBlocks) -> None:
        """`table`'s weight replaced by `blocks`' bytes (its rows, this rank's part)."""
        raw = torch.from_numpy(np.array(blocks.data))  # a copy: the file's map is read-only
        self._replace_weight(table, raw if blocks.row_order is None else raw[blocks.row_order])

    def _kernel(self, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return q8_0_linear(x, blocks)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return decode_q8_blocks(layer.weight)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows = decode_q8_blocks(layer.weight[ids.reshape(-1)])
        return rows.view(*ids.shape, -1).to(layer.dtype)
