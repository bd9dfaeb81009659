"""HF model directories: config.json, (sharded) safetensors, generation_config.json."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from infer.config import ConfigError, ModelConfig
from infer.loader.errors import ModelLoadError
from infer.models import config_from_hf

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def load_config(model_dir: Path) -> ModelConfig:
    """ModelConfig from config.json, with EOS ids from generation_config.json when present."""
    path = model_dir / "config.json"
    raw = read_json(path)
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        gen = read_json(gen_path)
        if gen.get("eos_token_id") is not None:
            raw = {**raw, "eos_token_id": gen["eos_token_id"]}
    try:
        return config_from_hf(raw)
    except ConfigError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None


def quantization_config(model_dir: Path) -> dict[str, Any] | None:
    """config.json's `quantization_config` (None: the checkpoint is not quantized)."""
    return read_json(model_dir / "config.json").get("quantization_config")


def tensor_headers(files: list[Path]) -> dict[str, tuple[str, list[int]]]:
    """Every tensor's (safetensors dtype, shape), read from the files' headers alone."""
    headers = {}
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    part = f.get_slice(name)
                    headers[name] = (part.get_dtype(), list(part.get_shape()))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: unreadable safetensors file ({exc})") from None
    return headers


def num_tensors(files: list[Path]) -> int:
    """How many tensors the files hold (from their headers)."""
    count = 0
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                count += len(f.keys())
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: unreadable safetensors file ({exc})") from None
    return count


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files; refuses pickle-only checkpoints."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no 'weight_map' object")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index}: lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = [f.name for f in model_dir.iterdir() if f.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise ModelLoadError(
            f"{model_dir}: only pickle checkpoints found ({', '.join(pickles)}); infer never "
            "unpickles weights (it can run arbitrary code). Convert them to safetensors, e.g. "
            "with transformers: model.save_pretrained(dir, safe_serialization=True)"
        )
    raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` from memory-mapped files, one tensor at a time."""
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: unreadable safetensors file ({exc})") from None
