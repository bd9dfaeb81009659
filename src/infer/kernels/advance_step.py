"""A prepared graph step moved on by per-sequence offsets known only on the device, in one
launch (`GraphMetadata.advance`): each sequence's length grows by its offset, its new
tokens' positions too, and their cache slots are looked up again in its block table.

With `done_below` (a draft's two-token graph, `GraphMetadata(catch_up=True)`) a sequence
moved on fewer than that many tokens has its first token marked done: slot -1, and for a
lone sequence the flag `kernels/row_skip.py` describes.

The same in torch takes a dozen small launches, each costing the host more than this
whole kernel costs the GPU; the host is what a proposal round queued ahead waits for.

`round_inputs`: where such a round starts (its first token ids, the offsets), from the
verdict it follows, in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# One compiled form for every `done_below` and flag address (compile_for's among them).
@triton.jit(do_not_specialize=["done_below"], do_not_specialize_on_alignment=["skip_ptr"])
def _advance_kernel(offsets_ptr, seq_lens_ptr, positions_ptr, slots_ptr, tables_ptr,
                    skip_ptr, stride_tables, query_len, block_size, done_below,
                    BLOCK_Q: tl.constexpr):
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
    slots = blocks.to(tl.int64) * block_size + positions % block_size
    done = (tl.arange(0, BLOCK_Q) == 0) & (offset < done_below)
    tl.store(slots_ptr + tokens, tl.where(done, -1, slots), mask=mask)
    if done_below > 0:
        tl.store(skip_ptr, ((offset < done_below) & (tl.num_programs(0) == 1)).to(tl.int32))


def advance_step(offsets: torch.Tensor, seq_lens: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_len: int,
                 block_size: int, done_below: int = 0,
                 first_row_skipped: torch.Tensor | None = None) -> None:
    """In place, for the `len(offsets)` first sequences (each `query_len` consecutive
    tokens): `seq_lens` (int32) += offset, `positions` (int64) += offset, `slot_mapping`
    (int64) = the moved positions' slots in `block_tables` (int32 rows); with `done_below`,
    -1 for the first token of each sequence moved on fewer than that many, and
    `first_row_skipped` (int32 `[1]`) = whether that holds of a lone sequence."""
    n = offsets.shape[0]
    assert offsets.dtype == torch.int64 and seq_lens.dtype == torch.int32, offsets.dtype
    assert positions.dtype == torch.int64 and slot_mapping.dtype == torch.int64
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert seq_lens.shape[0] >= n and positions.shape[0] >= n * query_len
    if done_below:
        assert first_row_skipped is not None and first_row_skipped.dtype == torch.int32
    if n:
        _advance_kernel[(n,)](offsets, seq_lens, positions, slot_mapping, block_tables,
                              seq_lens if first_row_skipped is None else first_row_skipped,
                              block_tables.stride(0), query_len, block_size, done_below,
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
                 zeros(1, max_blocks_per_seq, dtype=torch.int32), query_len, block_size,
                 0, zeros(1, dtype=torch.int32))


@triton.jit
def _round_inputs_kernel(verify_ids_ptr, tokens_ptr, num_tokens_ptr, ids_ptr, accepted_ptr,
                         K1, Q: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    accepted = tl.load(num_tokens_ptr + seq) - 1
    tl.store(accepted_ptr + seq, accepted)
    if Q == 2:
        tl.store(ids_ptr + 2 * seq, tl.load(verify_ids_ptr + seq * K1 + accepted))
    tl.store(ids_ptr + Q * seq + Q - 1, tl.load(tokens_ptr + seq * K1 + accepted))


def round_inputs(verify_ids: torch.Tensor, token_ids: torch.Tensor, num_tokens: torch.Tensor,
                 with_input: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`spec.model_drafter.round_inputs` in one launch (a few small ones in torch)."""
    n, k1 = token_ids.shape
    assert verify_ids.shape == (n, k1) and num_tokens.shape == (n,), (verify_ids.shape, n)
    assert token_ids.dtype == verify_ids.dtype == num_tokens.dtype == torch.int64
    q = 2 if with_input else 1
    ids = torch.empty(n * q, dtype=torch.int64, device=token_ids.device)
    accepted = torch.empty(n, dtype=torch.int64, device=token_ids.device)
    if n:
        _round_inputs_kernel[(n,)](verify_ids.contiguous(), token_ids.contiguous(),
                                   num_tokens.contiguous(), ids, accepted, k1, Q=q,
                                   num_warps=1)
    return ids, accepted
