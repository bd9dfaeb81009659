"""Test helper: a live server (uvicorn in a thread, 127.0.0.1, a free port) over an
AsyncEngine on the shared SmolLM2 weights, or on a tiny random Llama written here."""

from __future__ import annotations

import json
import socket
import tempfile
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

from infer.engine.llm_engine import LLMEngine
from infer.server import AsyncEngine, build_app

MODEL = "smollm2"
TINY_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
_TINY_CORPUS = ("The quick brown fox jumps over the lazy dog. What is 2+2? It is 4. "
                "Once upon a time there was a small model that served requests over HTTP.")


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


def write_tiny_llama(path: Path) -> Path:
    """A random 2-layer Llama (float32 safetensors) with a small byte-level BPE tokenizer
    and a chat template: an HF directory `--model` accepts, loading in well under a second."""
    from checkpoints import save_random_checkpoint
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>",
                                        "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([_TINY_CORPUS] * 4, trainer)
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TINY_TEMPLATE}))
    config = LlamaConfig(vocab_size=backend.get_vocab_size(), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    save_random_checkpoint(config, path)
    return path


@cache
def tiny_model_dir() -> Path:
    return write_tiny_llama(Path(tempfile.mkdtemp(prefix="infer-tiny-llama-")))


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
