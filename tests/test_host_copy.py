"""Results copied to the host (`transfer.HostCopy`): the values the device tensors held
when the copy was queued, whatever the stream does after; on CUDA through the driver, with
a result dropped before it was waited for keeping its pinned buffers until its copies have
run. `INFER_TEST_DEVICE=cuda` runs the driver's path; on the CPU the tensors pass through."""

import os

import pytest
import torch

from infer import transfer
from infer.transfer import HostCopy

DEVICE = torch.device(os.environ.get("INFER_TEST_DEVICE", "cpu"))


def test_copies_hold_the_values_queued():
    ids = torch.arange(300, device=DEVICE)
    logprobs = torch.randn(300, 4, device=DEVICE)
    column = logprobs[:, 1]  # not contiguous: torch's own copy
    empty = torch.empty(0, 3, device=DEVICE)
    expected = [ids.cpu().clone(), None, column.cpu().clone(), empty.cpu()]
    result = HostCopy(ids, None, column, empty)
    if DEVICE.type == "cuda":  # later work on the stream does not reach the copies
        torch.cuda._sleep(10_000_000)
        ids += 1
        logprobs.zero_()
    got = result.wait()
    assert got[1] is None
    for g, e in zip(got, expected):
        if e is not None:
            assert g.device.type == "cpu" and g.dtype == e.dtype and g.shape == e.shape
            assert torch.equal(g, e)
    assert result.wait() is got  # waiting again gives the same tensors


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the driver's events are CUDA's")
def test_a_result_dropped_unwaited_keeps_its_buffers_until_its_copies_ran():
    events = None
    for round_ in range(3):
        x = torch.full((1 << 16,), round_, device=DEVICE)
        torch.cuda._sleep(50_000_000)  # the copy waits behind ~tens of ms of the stream
        result = HostCopy(x)
        events = transfer._EVENTS[x.device]
        buffers = result._host
        del result
        assert len(events.dropped) == 1 and events.dropped[0][1] is buffers
        torch.cuda.synchronize()
        kept = HostCopy(x)  # takes an event: the dropped one's has passed, and goes
        assert not events.dropped
        assert torch.equal(buffers[0], torch.full((1 << 16,), round_))
        assert torch.equal(kept.wait()[0], buffers[0])
    assert len(events.free) <= 2  # events are reused, not made anew each time


def test_dropped_results_wait_in_order_for_their_events(monkeypatch):
    """The events' bookkeeping (`transfer._Events`) with a stand-in for the driver: a
    dropped result's buffers stay until its event has passed, then its event is reused;
    one not passed yet holds up the ones dropped after it."""

    class Driver:
        def __init__(self) -> None:
            self.made, self.passed = 0, set()

        def event(self) -> int:
            self.made += 1
            return self.made

        def done(self, event: int) -> bool:
            return event in self.passed

    driver = Driver()
    monkeypatch.setattr(transfer, "cuda_driver", lambda: driver)
    events = transfer._Events(torch.device("cuda", 0))
    first, second = events.take(), events.take()
    assert (first, second) == (1, 2)
    events.dropped.extend([(first, ["buffers 1"]), (second, ["buffers 2"])])
    driver.passed.add(second)  # the second passed, the first not yet: both stay
    assert events.take() == 3 and len(events.dropped) == 2
    driver.passed.add(first)
    got = events.take()
    assert got in (first, second) and not events.dropped
    assert events.take() == ({first, second} - {got}).pop()  # both reused
    assert events.take() == 4  # none free: a new one
