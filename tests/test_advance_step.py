"""A prepared graph step moved on by offsets on the device (`GraphMetadata.advance`, a
proposal round queued behind the verify step it follows): the Triton kernel (the
interpreter on a CPU) and the torch path, against the same step worked out in Python."""

from __future__ import annotations

import os
import random

import pytest
import torch

from infer.attention.graph_metadata import GraphMetadata

DEVICE = torch.device(os.environ.get("INFER_TEST_DEVICE", "cpu"))
BLOCK = 4


def moved_by_hand(tables: list[list[int]], seq_lens: list[int], q: int,
                  offsets: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Lengths, positions and slots of each sequence's last q tokens, `offsets` on."""
    lens, positions, slots = [], [], []
    for table, length, offset in zip(tables, seq_lens, offsets):
        lens.append(length + offset)
        for p in range(length + offset - q, length + offset):
            positions.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
    return lens, positions, slots


@pytest.mark.parametrize("q", [1, 2, 5])
@pytest.mark.parametrize("kernel", [True, False])
def test_a_step_moved_on_by_offsets_is_the_step_prepared_there(q, kernel):
    rng = random.Random(q)
    n, batch, width = 3, 4, 6
    blocks = rng.sample(range(1, 64), n * width)
    tables = [blocks[i * width:(i + 1) * width] for i in range(n)]
    seq_lens = [rng.randrange(q + 1, width * BLOCK - 8) for _ in range(n)]
    offsets = [0, 3, rng.randrange(1, 8)]
    meta = GraphMetadata(batch, q, width, BLOCK, DEVICE)
    positions = [p for length in seq_lens for p in range(length - q, length)]
    meta.prepare_replay(batch, seq_lens, tables, [None, positions])
    moved = torch.tensor(offsets, device=DEVICE)
    if kernel:
        from infer.kernels.advance_step import advance_step

        advance_step(moved, meta.seq_lens, meta.token_rows[1], meta.slot_mapping,
                     meta.block_tables, q, BLOCK)
    elif DEVICE.type == "cpu":
        meta.advance(n, moved, meta.token_rows[1])
    else:
        pytest.skip("on a GPU `advance` takes the kernel")
    lens, want_positions, want_slots = moved_by_hand(tables, seq_lens, q, offsets)
    assert meta.seq_lens[:n].tolist() == lens
    assert meta.token_rows[1][:n * q].tolist() == want_positions
    assert meta.slot_mapping[:n * q].tolist() == want_slots
    # the padding row is left as prepared: length q, no slot
    assert meta.seq_lens[n:batch].tolist() == [q] * (batch - n)
    assert meta.slot_mapping[n * q:batch * q].tolist() == [-1] * ((batch - n) * q)


@pytest.mark.parametrize("q", [1, 2])
def test_compiling_the_kernel_ahead_leaves_a_graphs_buffers_as_prepared(q):
    """`compile_advance` (at capture, for rounds queued ahead) launches on scratch buffers
    only: a prepared step is left exactly as it was."""
    meta = GraphMetadata(4, q, 6, BLOCK, DEVICE)
    meta.prepare_replay(4, [9, 13], [[1, 2, 3], [4, 5, 6, 7]],
                        [None, [p for n in (9, 13) for p in range(n - q, n)]])
    before = [t.clone() for t in (meta.seq_lens, meta.slot_mapping, meta.token_rows,
                                  meta.block_tables)]
    meta.compile_advance()
    after = (meta.seq_lens, meta.slot_mapping, meta.token_rows, meta.block_tables)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("offsets", [[0], [2], [3], [1, 3, 0]])
@pytest.mark.parametrize("kernel", [True, False])
def test_a_catch_up_token_moved_on_fewer_than_k_is_marked_done(offsets, kernel):
    """`catch_up` graphs (a draft's two-token ones) moved on with `done_below = k`: a
    sequence moved on fewer than k tokens has its first token's slot -1 (its KV is in the
    cache already), the other slots where the step prepared there puts them; the first-row
    flag is set only for a lone sequence so moved, and `prepare_replay` clears it."""
    k, q, batch, width = 3, 2, 4, 6
    n = len(offsets)
    tables = [[1 + i * width + j for j in range(width)] for i in range(n)]
    seq_lens = [7 + 2 * i for i in range(n)]
    meta = GraphMetadata(batch, q, width, BLOCK, DEVICE, catch_up=True)
    meta.first_row_skipped.fill_(1)
    positions = [p for length in seq_lens for p in range(length - q, length)]
    meta.prepare_replay(batch, seq_lens, tables, [None, positions])
    assert meta.first_row_skipped.item() == 0
    moved = torch.tensor(offsets, device=DEVICE)
    if kernel:
        from infer.kernels.advance_step import advance_step

        advance_step(moved, meta.seq_lens, meta.token_rows[1], meta.slot_mapping,
                     meta.block_tables, q, BLOCK, k, meta.first_row_skipped)
    elif DEVICE.type == "cpu":
        meta.advance(n, moved, meta.token_rows[1], done_below=k)
    else:
        pytest.skip("on a GPU `advance` takes the kernel")
    lens, want_positions, want_slots = moved_by_hand(tables, seq_lens, q, offsets)
    for i, offset in enumerate(offsets):
        if offset < k:
            want_slots[i * q] = -1
    assert meta.seq_lens[:n].tolist() == lens
    assert meta.token_rows[1][:n * q].tolist() == want_positions
    assert meta.slot_mapping[:n * q].tolist() == want_slots
    assert meta.first_row_skipped.item() == int(n == 1 and offsets[0] < k)


def test_catch_up_goes_with_two_tokens_a_sequence():
    with pytest.raises(ValueError, match="two tokens"):
        GraphMetadata(4, 3, 6, BLOCK, DEVICE, catch_up=True)


@pytest.mark.parametrize("with_input", [True, False])
def test_a_rounds_inputs_are_where_its_verdict_ends(with_input):
    """`round_inputs`: per sequence, accepted = num_tokens - 1, then (the verify step's
    input at accepted, with_input) and the verdict's token there; the kernel (the
    interpreter on a CPU) as the torch path and a hand-worked case."""
    from infer.kernels.advance_step import round_inputs as kernel
    from infer.spec.model_drafter import round_inputs

    verify_ids = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]])
    tokens = torch.tensor([[11, 12, 7, -1], [8, -1, -1, -1], [31, 32, 33, 9]])
    num_tokens = torch.tensor([3, 1, 4])
    ids, accepted = round_inputs(verify_ids, tokens, num_tokens, with_input)
    assert accepted.tolist() == [2, 0, 3]
    assert ids.tolist() == ([12, 7, 20, 8, 33, 9] if with_input else [7, 8, 9])
    on = [t.to(DEVICE) for t in (verify_ids, tokens, num_tokens)]
    got = kernel(*on, with_input)
    assert [t.tolist() for t in got] == [ids.tolist(), accepted.tolist()]
