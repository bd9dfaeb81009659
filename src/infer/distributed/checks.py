"""What a tensor-parallel size must satisfy, checked before any worker starts."""

from __future__ import annotations

import torch

from infer.config import ModelConfig
from infer.engine.config import EngineConfig


def check_tensor_parallel(config: EngineConfig, model_config: ModelConfig,
                          device: torch.device) -> None:
    """ValueError naming what does not fit: N must divide the attention heads and the MLP
    features; the KV heads are split (N divides them) or replicated (they divide N); on
    GPUs, N must be visible."""
    n, mc = config.tensor_parallel_size, model_config
    if mc.num_heads % n:
        raise ValueError(f"tensor_parallel_size={n} must divide the model's {mc.num_heads} "
                         "attention heads")
    if mc.num_kv_heads % n and n % mc.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={n} and the model's {mc.num_kv_heads} KV "
                         "heads: one must divide the other (KV heads are split, or "
                         "replicated when there are fewer than ranks)")
    if mc.intermediate_size % n:
        raise ValueError(f"tensor_parallel_size={n} must divide the model's "
                         f"{mc.intermediate_size} MLP features (intermediate_size)")
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs, one per rank; "
                         f"{torch.cuda.device_count()} visible")
