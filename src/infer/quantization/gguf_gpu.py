"""GGUF weights on the GPU as the file stores them: each layer keeps its rows' ggml blocks
(Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) in GPU memory, unchanged.

Decode-sized steps multiply by the blocks directly (`kernels/gguf_matmul.py` decodes them
in registers: the step reads only the quantized bytes); larger steps dequantize the layer
for cuBLAS, one layer at a time. A fused layer whose shards the file stores in different
types (Q4_K_M keeps some v projections in Q6_K beside Q4_K q and k) keeps one run of
blocks per type, multiplied one after the other. An embedding table looks its rows up by
dequantizing only the rows asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType
from torch import nn

from infer.models.linear import LinearMethod
from infer.quantization.gguf_blocks import GGUFBlocks

# The most rows of a step that multiply by the blocks directly, per type; more rows
# dequantize the weight for cuBLAS. Q4_K, Q6_K, Q8_0 (gguf_gemm.py from two rows): on the
# H100, 8B shapes at 8, 32 and 64 rows (benchmarks/quantized_gemv.py --gemm-sweep), than
# dequantize-then-cuBLAS: Q4_K 1.6-3.8x faster, Q6_K 1.5-3.1x, Q8_0 1.0-1.8x (at parity
# only for o at 64 rows); 64 rows is gguf_gemm's largest tile of x.
# The other types' generic kernel is slower than cuBLAS from two rows up.
FUSED_ROWS: dict[QType, int] = {QType.Q4_K: 64, QType.Q6_K: 64, QType.Q8_0: 64}


def set_gguf_int8_activations(model: nn.Module, on: bool, fused: bool = False) -> None:
    """Whether `model`'s GGUF Q4_K / Q6_K / Q8_0 layers multiply one row by x rounded to
    int8 (dp4a); `fused`: x rounded by the launch that makes it where it can be (the
    model's RMSNorms before a projection, `RMSNorm.feeds_projection`, hand out their
    one-row outputs rounded; the gated activation before a down projection is rounded in
    its own launch: kernels/int8_rows.py)."""
    from infer.models.layers import RMSNorm

    found = False
    for m in model.modules():
        if isinstance(getattr(m, "quant_method", None), GGUFBlocksLinearMethod):
            m.gguf_int8_activations = on
            m.gguf_fused_x_rounding = on and fused
            found = True
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.int8_rows = on and fused and found and m.feeds_projection


@functools.cache
def int8x_kernels() -> dict[QType, tuple[Callable, Callable]]:
    """The types one row multiplies with x rounded to int8 (`gguf_int8_activations`): each
    kernel's launch rule and its matmul."""
    from infer.kernels import gguf_q4k_int8x as q4k
    from infer.kernels import gguf_q6k_int8x as q6k
    from infer.kernels import gguf_q8_0_int8x as q8_0

    return {QType.Q4_K: (q4k.launch, q4k.q4k_gemv_int8x),
            QType.Q6_K: (q6k.launch, q6k.q6k_gemv_int8x),
            QType.Q8_0: (q8_0.launch, q8_0.q8_0_gemv_int8x)}


def gpu_types() -> tuple[QType, ...]:
    """The GGUF types the GPU kernels decode."""
    from infer.kernels.gguf_matmul import SUPPORTED

    return SUPPORTED


class GGUFBlocksLinearMethod(LinearMethod):
    format = "gguf"

    def load(self, layer: nn.Module, shards: list[GGUFBlocks]) -> None:
        """`layer`'s weight (a linear layer, an embedding table, an LM head) replaced by the
        blocks of its shards, in order, rows in checkpoint order."""
        device = layer.weight.device
        runs: list[tuple[QType, list[torch.Tensor]]] = []
        for b in shards:
            raw = torch.from_numpy(np.array(b.data))  # a copy: the file's map is read-only
            if b.row_order is not None:
                raw = raw[b.row_order]
            if runs and runs[-1][0] == b.qtype:
                runs[-1][1].append(raw)
            else:
                runs.append((b.qtype, [raw]))
        layer.cols = shards[0].cols
        layer.dtype = layer.weight.dtype
        del layer.weight
        layer.gguf_runs = []
        for i, (qtype, parts) in enumerate(runs):
            name = "weight" if i == 0 else f"weight_{i}"
            data = torch.cat(parts).to(device)
            layer.register_parameter(name, nn.Parameter(data, requires_grad=False))
            layer.gguf_runs.append((name, qtype))
        layer.quant_method = self

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return self._dequantized(layer, torch.float32)

    def _dequantized(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        from infer.kernels.gguf_matmul import gguf_dequantize

        parts = [gguf_dequantize(getattr(layer, name), qtype, layer.cols, dtype)
                 for name, qtype in layer.gguf_runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        from infer.kernels.gguf_matmul import gguf_matmul

        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        if len(x2) > 1 and not self._fused(layer, len(x2)):
            y = F.linear(x2, self._dequantized(layer, x.dtype))
        else:
            if len(x2) == 1 and getattr(layer, "gguf_int8_activations", False):
                from infer.kernels.int8_rows import attached

                parts = self._int8_x_row(layer, x2, attached(x))
            else:
                parts = [gguf_matmul(x2, getattr(layer, name), qtype, layer.cols)
                         for name, qtype in layer.gguf_runs]
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        y = y.reshape(*shape[:-1], y.shape[-1])
        return y if bias is None else y + bias

    def apply_gated(self, layer: nn.Module, gate_up: torch.Tensor, act: str,
                    bias: torch.Tensor | None) -> torch.Tensor | None:
        """With `gguf_fused_x_rounding`, one row whose runs all take x rounded to int8:
        the activation and x's rounding in one launch, then the runs' int8-x matmuls."""
        from infer.kernels.int8_rows import quantize_x

        if not (getattr(layer, "gguf_fused_x_rounding", False)
                and gate_up.numel() == gate_up.shape[-1]):
            return None
        words = self._int8x_words(layer)
        if any(w is None for w in words):
            return None
        row = gate_up.reshape(1, -1).contiguous()
        parts = self._int8_x_row(layer, row[:, :layer.cols], quantize_x(row, act), words)
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        y = y.reshape(*gate_up.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias

    def _int8x_words(self, layer: nn.Module) -> list[torch.Tensor | None]:
        """Each run's blocks as words for its int8-x kernel; None for a run without one
        (another type, or not whole words a row: Q6_K needs K a multiple of 512, Q8_0 of
        64), which the exact path multiplies."""
        from infer.kernels.gguf_gemv import row_words

        kernels = int8x_kernels()
        return [row_words(getattr(layer, name)) if qtype in kernels else None
                for name, qtype in layer.gguf_runs]

    def _int8_x_row(self, layer: nn.Module, x: torch.Tensor,
                    quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
                    words: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """One row by each run: the Q4_K, Q6_K and Q8_0 runs by x rounded to int8 (once
        for all of them, or `quantized` already: kernels/int8_rows.py; where every run
        takes it, x then gives only the dtype and device), dp4a; the other runs as
        gguf_matmul multiplies them. `words`: `_int8x_words(layer)`, if the caller has
        them."""
        from infer.kernels.gguf_matmul import gguf_matmul
        from infer.kernels.int8_rows import quantize_x

        kernels = int8x_kernels()
        parts = []
        for (name, qtype), run_words in zip(layer.gguf_runs,
                                              words or self._int8x_words(layer)):
            if run_words is None:
                parts.append(gguf_matmul(x, getattr(layer, name), qtype, layer.cols))
                continue
            quantized = quantized or quantize_x(x)
            launch, gemv = kernels[qtype]
            parts.append(gemv(x, run_words, layer.cols, quantized=quantized,
                              **launch(len(run_words), layer.cols, x.device)))
        return parts

    def _fused(self, layer: nn.Module, rows: int) -> bool:
        """Whether `rows` (> 1) rows multiply by every run of `layer`'s blocks directly."""
        from infer.kernels.gguf_gemm import gemm_words

        return all(rows <= FUSED_ROWS.get(qtype, 1)
                   and gemm_words(getattr(layer, name), qtype, layer.cols) is not None
                   for name, qtype in layer.gguf_runs)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        from infer.kernels.gguf_matmul import gguf_dequantize

        (name, qtype), = layer.gguf_runs
        rows = getattr(layer, name)[ids.reshape(-1)]
        return gguf_dequantize(rows, qtype, layer.cols, layer.dtype).reshape(
            *ids.shape, layer.cols)
