"""Test helper: a live server (uvicorn in a thread, 127.0.0.1, a free port) over an
AsyncEngine on the shared SmolLM2 weights, or on the tiny random Llama of tiny_model.py."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import httpx
import uvicorn
from engine_fixtures import make_llm
from tiny_model import tiny_model_dir

from infer.engine.llm_engine import LLMEngine
from infer.server import AsyncEngine, build_app

MODEL = "smollm2"


@dataclass
class LiveServer:
    url: str
    engine: AsyncEngine
    app: object

    def blocks_used(self) -> int:
        return self.engine.engine.kv.pool.num_used

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until the engine holds no request (aborts land at the next loop turn)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.engine.engine.has_unfinished_requests() and self.blocks_used() == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle: {self.engine.engine.stats()}")


@cache
def shared_engine() -> AsyncEngine:
    """One engine thread for all server test modules (each starts its own server)."""
    return make_engine()


def make_engine(max_waiting_requests: int | None = None, **config) -> AsyncEngine:
    config = {"num_blocks": 256, "max_model_len": 512, "max_num_seqs": 64, **config}
    return AsyncEngine.in_thread(make_llm(**config).engine, max_waiting_requests)


def make_tiny_engine(path: Path, **config) -> AsyncEngine:
    config = {"num_blocks": 64, "max_model_len": 128, "block_size": 8, **config}
    return AsyncEngine.in_thread(LLMEngine(model=str(path), device="cpu", **config))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(engine: AsyncEngine, name: str = MODEL, uvicorn_kwargs: dict | None = None,
                **app_kwargs) -> Iterator[LiveServer]:
    """`uvicorn_kwargs` go to uvicorn.Config (e.g. `http=`, `timeout_keep_alive=`)."""
    app = build_app(engine, name, **app_kwargs)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **{
        "log_level": "warning", "timeout_keep_alive": 30, **(uvicorn_kwargs or {})}))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        assert httpx.get(url + "/health").status_code == 200
        yield LiveServer(url, engine, app)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def tiny_server(name: str) -> Iterator[LiveServer]:
    """A live server over its own engine on the tiny random Llama, shut down after."""
    engine = make_tiny_engine(tiny_model_dir())
    try:
        with live_server(engine, name) as server:
            yield server
    finally:
        engine.shutdown()
