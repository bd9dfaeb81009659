"""A GGUF tensor's quantized blocks, read without dequantizing, and the 4-bit ones turned
into plain groups of 32: `w = q * a + b` with `q` in 0..15 and one `(a, b)` per group.

Block layouts (ggml's `block_q4_0`, `block_q4_1`, `block_q4_K`), each row of a weight being
its own run of blocks along the input dim:
- Q4_0, 18 bytes per 32 weights: fp16 `d`, 16 bytes of nibbles; `w = d * (q - 8)`.
- Q4_1, 20 bytes per 32: fp16 `d`, fp16 `m`, 16 bytes of nibbles; `w = d * q + m`.
  (In both, byte j holds weight j in its low nibble and weight j + 16 in its high one.)
- Q4_K, 144 bytes per 256: fp16 `d` and `dmin`, 12 bytes packing eight 6-bit scales `sc`
  and eight 6-bit mins `mn`, 128 bytes of nibbles; sub-block s of 32 weights is
  `w = d * sc[s] * q - dmin * mn[s]`; each 32 bytes of nibbles hold two sub-blocks (low
  nibbles the first, high nibbles the second).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf.constants import GGML_QUANT_SIZES

GROUP = 32  # weights per (a, b) pair of the 4-bit types
INT4_TYPES = (QType.Q4_0, QType.Q4_1, QType.Q4_K)


@dataclass
class GGUFBlocks:
    """One GGUF weight `[rows, cols]` as stored: `data` is `[rows, bytes per row]` (a view
    of the memory-mapped file); `row_order[i]`: the file row that is row i of the
    checkpoint-layout weight (None: the same order)."""

    name: str
    qtype: QType
    rows: int
    cols: int
    data: np.ndarray
    row_order: torch.Tensor | None = None

    @classmethod
    def of(cls, name: str, qtype: QType, shape: tuple[int, int], raw: np.ndarray
           ) -> GGUFBlocks:
        rows, cols = shape
        block, size = GGML_QUANT_SIZES[qtype]
        return cls(name, qtype, rows, cols, np.asarray(raw).reshape(rows, cols // block * size))

    def part(self, dim: int, start: int, size: int) -> GGUFBlocks:
        """Rows (`dim` 0) or columns (`dim` 1) `[start, start + size)` of the checkpoint-layout
        weight; columns only on block boundaries (a block's values share its scales).
        Rows past the end are zero blocks (every type's zero bytes decode to 0): the
        padding of a tensor-parallel rank's last part of a vocabulary."""
        if dim == 1:
            block, nbytes = GGML_QUANT_SIZES[self.qtype]
            if start % block or size % block:
                raise ValueError(f"{self.name}: columns [{start}, {start + size}) cut a "
                                 f"{self.qtype.name} block of {block} values")
            data = self.data[:, start // block * nbytes:(start + size) // block * nbytes]
            return GGUFBlocks(self.name, self.qtype, self.rows, size, data, self.row_order)
        end = min(start + size, self.rows)
        data = self.data[start:end] if self.row_order is None else \
            self.data[self.row_order[start:end].numpy()]
        if len(data) < size:
            data = np.concatenate([data, np.zeros((size - len(data), data.shape[1]),
                                                  dtype=data.dtype)])
        return GGUFBlocks(self.name, self.qtype, size, self.cols, data)


def int4_groups(blocks: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(q, a, b)` of a 4-bit GGUF weight, rows in checkpoint order: `q` uint8
    `[rows, cols]` in 0..15, `a` and `b` float32 `[rows, cols // 32]`, so that weight
    `[r, c] = q[r, c] * a[r, c // 32] + b[r, c // 32]` exactly as ggml dequantizes it."""
    if blocks.qtype not in INT4_TYPES:
        raise ValueError(f"{blocks.name}: {blocks.qtype.name} is not a 4-bit GGUF type")
    raw = torch.from_numpy(np.array(blocks.data))  # a copy: the file's map is read-only
    if blocks.row_order is not None:
        raw = raw[blocks.row_order]
    rows = blocks.rows
    if blocks.qtype == QType.Q4_K:
        q, a, b = _q4_k(raw.reshape(rows, -1, 144))
    else:
        size = 18 if blocks.qtype == QType.Q4_0 else 20
        cells = raw.reshape(rows, -1, size)
        d = _f16(cells[..., 0:2])
        nibbles = cells[..., size - 16:]
        q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1)  # [rows, blocks, 32]
        if blocks.qtype == QType.Q4_0:
            a, b = d, -8 * d
        else:
            a, b = d, _f16(cells[..., 2:4])
    return q.reshape(rows, blocks.cols), a.reshape(rows, -1), b.reshape(rows, -1)


def _q4_k(cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, dmin = _f16(cells[..., 0:2]), _f16(cells[..., 2:4])
    packed = cells[..., 4:16].to(torch.int32)  # [rows, superblocks, 12]
    lo, mid, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=-1)  # [rows, sb, 8]
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    nibbles = cells[..., 16:].reshape(*cells.shape[:2], 4, 32)  # 4 chunks of 2 sub-blocks
    q = torch.stack([nibbles & 0xF, nibbles >> 4], dim=3)  # [rows, sb, 4, 2, 32]
    a = d[..., None] * sc.float()
    b = -dmin[..., None] * mn.float()
    return q.reshape(*cells.shape[:2], 256), a, b


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 fields `[..., 2]` (uint8) as float32 `[...]`."""
    return two_bytes.contiguous().view(torch.float16)[..., 0].float()
