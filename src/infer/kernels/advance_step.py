"""A prepared graph step moved on by per-sequence offsets known only on the device, in one
launch (`GraphMetadata.advance`): each sequence's length grows by its offset, its new
tokens' positions too, and their cache slots are looked up again in its block table.

The same in torch takes a dozen small launches, each costing the host more than this
whole kernel costs the GPU; the host is what a proposal round queued ahead waits for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _advance_kernel(offsets_ptr, seq_lens_ptr, positions_ptr, slots_ptr, tables_ptr,
                    stride_tables, query_len, block_size, BLOCK_Q: tl.constexpr):
    seq = tl.program_id(0)
    offset = tl.load(offsets_ptr + seq)
    length = tl.load(seq_lens_ptr + seq)
    tl.store(seq_lens_ptr + seq, length + offset.to(tl.int32))
    tokens = seq * query_len + tl.arange(0, BLOCK_Q)
    mask = tl.arange(0, BLOCK_Q) < query_len
    positions = tl.load(positions_ptr + tokens, mask=mask, other=0) + offset
    tl.store(positions_ptr + tokens, positions, mask=mask)
    blocks = tl.load(tables_ptr + seq * stride_tables + positions // block_size, mask=mask,
                     other=0)
    tl.store(slots_ptr + tokens, blocks.to(tl.int64) * block_size + positions % block_size,
             mask=mask)


def advance_step(offsets: torch.Tensor, seq_lens: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_len: int,
                 block_size: int) -> None:
    """In place, for the `len(offsets)` first sequences (each `query_len` consecutive
    tokens): `seq_lens` (int32) += offset, `positions` (int64) += offset, `slot_mapping`
    (int64) = the moved positions' slots in `block_tables` (int32 rows)."""
    n = offsets.shape[0]
    assert offsets.dtype == torch.int64 and seq_lens.dtype == torch.int32, offsets.dtype
    assert positions.dtype == torch.int64 and slot_mapping.dtype == torch.int64
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert seq_lens.shape[0] >= n and positions.shape[0] >= n * query_len
    if n:
        _advance_kernel[(n,)](offsets, seq_lens, positions, slot_mapping, block_tables,
                              block_tables.stride(0), query_len, block_size,
                              BLOCK_Q=triton.next_power_of_2(query_len), num_warps=1)


def compile_for(device: torch.device, query_len: int, block_size: int,
                max_blocks_per_seq: int) -> None:
    """Launch once on scratch buffers laid out as a graph's (16-byte aligned rows, block
    tables `max_blocks_per_seq` wide), so that the kernel is compiled while graphs are
    captured and not by the first step moved on (~0.5 s on an H200's host when Triton's
    cache is cold)."""
    def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    advance_step(zeros(1), zeros(1, dtype=torch.int32), zeros(query_len), zeros(query_len),
                 zeros(1, max_blocks_per_seq, dtype=torch.int32), query_len, block_size)
