"""AsyncEngine without HTTP: add errors before streaming, cancellation, step failures."""

from __future__ import annotations

import asyncio
import threading

import pytest
from server_fixtures import make_engine

from infer import SamplingParams
from infer.cli import build_parser, serve_engine_config
from infer.server import EngineDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def engine():
    engine = make_engine(num_blocks=64)
    yield engine
    engine.shutdown()


async def _text(engine, rid: str, params: SamplingParams = GREEDY) -> str:
    outputs = [o async for o in engine.generate("The sky is", params, rid)]
    assert outputs[-1].finished
    return outputs[-1].outputs[0].text


def test_generate_and_add_errors_surface_before_streaming(engine):
    async def run():
        text = await _text(engine, "a")
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("b", [], GREEDY)
        return text

    assert asyncio.run(run())
    assert engine.engine.kv.pool.num_used == 0


def test_duplicate_request_ids_are_refused_and_nothing_is_queued(engine):
    async def run():
        with pytest.raises(ValueError, match="duplicate request id 'x'"):
            await engine.add_requests([("x", "The sky"), ("x", "The sea")], GREEDY)
        assert not engine.engine.has_unfinished_requests()
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        first = await engine.add_requests([("y", "The sky")], long)
        with pytest.raises(ValueError, match="duplicate request id 'y'"):
            await engine.add_requests([("z", "The sea"), ("y", "The sea")], GREEDY)
        assert set(engine.engine.output_processor.groups) == {"y"}  # z was not queued
        first[0].abort()

    asyncio.run(run())


def test_cancelled_consumer_aborts_the_request(engine):
    async def run():
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        task = asyncio.ensure_future(_text(engine, "c", params))
        while engine.engine.kv.pool.num_used == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        for _ in range(500):  # the request side forgets at once, the core a message later
            if not engine.engine.has_unfinished_requests() and not engine.engine.core.sequences:
                return
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert engine.engine.kv.pool.num_used == 0


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(engine, monkeypatch):
    real_step = engine.engine.core.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine.engine.core, "step", failing_step)

    async def run():
        with pytest.raises(EngineDeadError, match="boom"):
            await _text(engine, "d")
        return await _text(engine, "e")

    assert asyncio.run(run())
    assert engine.step_errors == 1 and engine.engine.kv.pool.num_used == 0


@pytest.mark.parametrize(("argv", "expected"), [
    (["--device", "cuda"], 256), (["--device", "cpu"], 64),
    (["--device", "cuda", "--max-num-seqs", "8"], 8)])
def test_the_server_sizes_its_batch_to_the_device(argv, expected):
    args = build_parser().parse_args(["serve", *argv])
    assert serve_engine_config(args).max_num_seqs == expected


@pytest.mark.parametrize(("argv", "cores", "expected"), [
    (["--device", "cpu"], 64, 1),
    (["--device", "cuda"], 16, 4),
    (["--device", "cuda"], 64, 4),
    (["--device", "cuda"], 8, 2),
    (["--device", "cuda"], 2, 1),
    (["--device", "cuda", "--no-core-process"], 16, 1),  # one process: no further ones
    (["--device", "cuda", "--api-server-count", "3"], 16, 3),
])
def test_the_server_sizes_its_api_processes_to_the_host(monkeypatch, argv, cores, expected):
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    args = build_parser().parse_args(["serve", *argv])
    serve_engine_config(args)
    assert args.api_server_count == expected


def test_serve_flags():
    args = build_parser().parse_args(["serve", "--port", "9000", "--max-waiting-requests",
                                      "5", "--api-key", "k"])
    assert (args.host, args.port, args.api_key, args.max_waiting_requests) == (
        "127.0.0.1", 9000, "k", 5)


def test_a_failing_forward_fails_only_the_requests_of_that_step(monkeypatch):
    engine = make_engine(num_blocks=64, max_num_seqs=1)
    model = engine.engine.runner.model
    real, armed, calls = model.forward, threading.Event(), []

    def forward(*args, **kwargs):
        # twice: a step launched ahead that fails is planned again after the step in
        # flight, and fails the step only when that fails too
        if armed.is_set() and len(calls) < 2:
            calls.append(1)
            raise RuntimeError("forward failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)

    async def run():
        running = await engine.add_request("x", "The sky is", SamplingParams(
            max_tokens=200, ignore_eos=True))
        first = await running.__anext__()  # x holds the one running slot
        waiting = asyncio.ensure_future(_text(engine, "y"))
        while engine.stats["num_requests_waiting"] < 1:
            await asyncio.sleep(0.01)
        armed.set()
        with pytest.raises(EngineDeadError, match="forward failed"):
            async for _ in running:
                pass
        return first, await waiting

    try:
        first, text = asyncio.run(run())
        assert not first.finished and text == asyncio.run(_text(engine, "z"))
        assert engine.step_errors == 1 and engine.engine.kv.pool.num_used == 0
    finally:
        engine.shutdown()
