"""Engine start-up: pick device and dtype, load the model and its tokenizer."""

from __future__ import annotations

import gc
import logging

import torch
from torch import nn

from infer.config import ModelConfig
from infer.loader.resolve import resolve_model
from infer.loader.tokenizer import Tokenizer
from infer.quantization.gguf_blocks import GGUFBlocks

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device_and_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA device is available; use device='cpu'")
    dev = torch.device(device)
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, _DTYPES[dtype]


def load_model_and_tokenizer(
    model: str | None, dtype: torch.dtype, device: torch.device, quantization: str = "none"
) -> tuple[nn.Module, ModelConfig, Tokenizer, str]:
    """`quantization`: a format made at load (int8, fp8) quantizes each tensor as it loads."""
    from infer.loader import load_gguf, load_hf_dir
    from infer.quantization import method_made_at_load

    source = resolve_model(model)
    log.info("loading %s from %s on %s", source.name, source.path, device)
    method = method_made_at_load(quantization)
    if source.format == "gguf":
        net, cfg = load_gguf(source.path, dtype, device, method)
        tokenizer = Tokenizer.from_gguf(source.path)
    else:
        net, cfg = load_hf_dir(source.path, dtype, device, method)
        tokenizer = Tokenizer.from_hf_dir(source.path)
    return net, cfg, tokenizer, source.name


def model_config_of(model: str | None) -> ModelConfig:
    """The model's config alone, read without its weights."""
    from infer.loader import gguf_file, hf_dir
    from infer.loader.gguf_metadata import gguf_config

    source = resolve_model(model)
    if source.format == "gguf":
        return gguf_config(gguf_file.open_gguf(source.path))
    return hf_dir.load_config(source.path)


def gguf_blocks_of(model: str | None, cfg: ModelConfig, quantization: str
                   ) -> dict[str, GGUFBlocks] | None:
    """The quantized weights as stored, when `model` is a GGUF file whose weights
    `quantization` keeps quantized (views of the memory-mapped file); else None."""
    from infer.loader import gguf_file

    source = resolve_model(model)
    if quantization not in ("auto", "gguf") or source.format != "gguf":
        return None
    return gguf_file.quantized_blocks(gguf_file.open_gguf(source.path), cfg)


def load_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer alone (the request side of a server whose core loads the model)."""
    source = resolve_model(model)
    if source.format == "gguf":
        return Tokenizer.from_gguf(source.path)
    return Tokenizer.from_hf_dir(source.path)


def pick_backend(name: str, choice: str, device: torch.device) -> str:
    """Resolve an `auto|torch|triton` backend choice for `device` (`name` is the field)."""
    import os

    from infer.kernels import triton_available

    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if choice == "triton":
        if not triton_available():
            raise ValueError(f"{name}='triton' but triton is not installed (pip install triton)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"{name}='triton' on {device.type} runs only in the Triton interpreter: set "
                "TRITON_INTERPRET=1 before start-up (slow; meant for tests), or use 'torch'"
            )
    return choice


def freeze_startup_objects() -> None:
    """Exempt everything loaded so far from garbage collection, in a process that serves
    one engine for its life (the server's, the core's). It holds many long-lived objects
    (modules, tokenizer, model, schemas) that each collection of the oldest generation
    would walk again: 0.1-0.2 s for the ~400k of a tiny model's benchmark on the CPU
    machine, 0.3-0.5 s (one decode step's stall) on the device's host. The per-token work
    allocates enough to trigger those often (measured on a CPU: ~11 -> ~7 us of the
    server's output work per token).

    Not for the offline `LLM`: a frozen cycle is never collected, and a process may build
    and drop many engines. Invariant all the same: an engine let go is freed by reference
    counting alone (no cycle holds its model or KV cache)."""
    gc.collect()
    gc.freeze()
