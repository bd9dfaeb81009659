"""Build a model from a checkpoint: resolve the source, read the config, copy the weights."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from infer.config import ModelConfig
from infer.loader import gguf_file, hf_dir
from infer.loader.errors import ModelLoadError
from infer.loader.gguf_metadata import gguf_config
from infer.models import model_class
from infer.models.linear import LinearMethod, UnquantizedLinearMethod, linear_method_default
from infer.models.weights import WeightError
from infer.progress import loading_bar
from infer.quantization.checkpoint import read_scheme
from infer.quantization.kv_scales import KVScaleReader


def build_model(
    cfg: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    source: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    linear_method: Callable[[], LinearMethod] = UnquantizedLinearMethod,
) -> nn.Module:
    """Instantiate the architecture directly on `device` in `dtype`, its linear layers with
    `linear_method` (how the checkpoint stores them), then copy the weights in."""
    cls = model_class(cfg)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), linear_method_default(linear_method):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    try:
        model.load_weights(weights, source=source)
    except WeightError as exc:
        raise ModelLoadError(str(exc)) from None
    return model.eval().requires_grad_(False)


def load_hf_dir(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    linear_method: Callable[[], LinearMethod] = UnquantizedLinearMethod,
) -> tuple[nn.Module, ModelConfig]:
    """`linear_method`: how to build the linear layers of a checkpoint stored in float (one
    stored quantized brings its own)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: not a directory")
    cfg = hf_dir.load_config(model_dir)
    files = hf_dir.safetensors_files(model_dir)
    scheme = read_scheme(hf_dir.quantization_config(model_dir), str(model_dir / "config.json"))
    if scheme is not None:
        scheme.check_tensors(hf_dir.tensor_headers(files), str(model_dir))
        linear_method = scheme.make_method
    weights = loading_bar(hf_dir.iter_safetensors(files), hf_dir.num_tensors(files),
                          "Loading safetensors checkpoint")
    kv_scales = KVScaleReader(str(model_dir)) if scheme is not None and scheme.kv_scales \
        else None
    if kv_scales is not None:
        weights = kv_scales.filter(weights)
    model = build_model(cfg, weights, str(model_dir), dtype, device, linear_method)
    if kv_scales is not None:
        kv_scales.apply(model)
    return model, cfg


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    linear_method: Callable[[], LinearMethod] = UnquantizedLinearMethod,
) -> tuple[nn.Module, ModelConfig]:
    """A llama.cpp GGUF file, every tensor dequantised and loaded into linear layers built
    with `linear_method` (`infer.quantization` keeps the file's blocks afterwards)."""
    reader = gguf_file.open_gguf(path)
    cfg = gguf_config(reader)
    gguf_file.check_tensor_types(reader)
    weights = loading_bar(gguf_file.iter_gguf_weights(reader, cfg, device),
                          gguf_file.num_weights(reader), "Loading GGUF tensors")
    model = build_model(cfg, weights, gguf_file.source_of(reader), dtype, device,
                        linear_method)
    return model, cfg
