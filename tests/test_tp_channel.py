"""Rank 0's announcements to the workers it spawned: through a pipe each (distributed/
channel.py): every worker gets every message, in order; a worker gone breaks the send."""

from __future__ import annotations

import multiprocessing

import pytest

from infer.distributed.channel import PipeReceiver, PipeSender
from infer.engine.model_runner import StepInputs


def _pipes(n: int):
    ctx = multiprocessing.get_context("spawn")
    pairs = [ctx.Pipe(duplex=False) for _ in range(n)]
    return [PipeReceiver(r) for r, _ in pairs], PipeSender([w for _, w in pairs])


def test_every_worker_gets_every_message_in_order():
    receivers, sender = _pipes(3)
    step = StepInputs([5, 6], [7, 8], [1, 1], [8, 9], [[0, 1], [2, 3]], [0, 1], ["a", "b"],
                      [1, 1])
    messages = [("forward", step, 2, "int64"), ("logits",), ("rows", [3, 4], 256), ("stop",)]
    for m in messages:
        sender.send(m)
    for r in receivers:
        assert [r.receive() for _ in messages] == messages


def test_a_worker_gone_breaks_the_send_and_rank_0_gone_ends_the_read():
    receivers, sender = _pipes(2)
    receivers[1].pipe.close()
    with pytest.raises(BrokenPipeError):
        sender.send(("logits",))
    sender.close()
    assert receivers[0].receive() == ("logits",)  # what was sent before is still read
    with pytest.raises(EOFError):
        receivers[0].receive()
