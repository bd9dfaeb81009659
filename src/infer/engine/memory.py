"""Sizing the KV-cache pool."""

from __future__ import annotations

import logging

import torch
from torch import nn

from infer.attention import Attention
from infer.config import ModelConfig
from infer.engine.config import EngineConfig

log = logging.getLogger(__name__)

# On a CPU the pool is capped at this share of available memory (the rest stays for the
# OS, the model and activations).
_CPU_SHARE = 0.25


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.kv_size * torch.finfo(dtype).bits // 8


def plan_kv_cache(
    config: EngineConfig, cfg: ModelConfig, max_model_len: int, model: nn.Module,
    device: torch.device, kv_dtype: torch.dtype, draft_config: ModelConfig | None = None,
    tp_size: int = 1,
) -> tuple[int, int]:
    """(block_size, num_blocks), from the same memory budget for both layouts. Contiguous
    = one max_model_len block per sequence, so the budget may hold fewer sequences than
    max_num_seqs (as llama.cpp's slots): the scheduler runs as many as have a block.
    A draft model's cache has as many blocks (the same block tables), in the same budget,
    of the same `kv_dtype`.
    Under tensor parallelism (`tp_size` ranks) this rank holds its KV heads of each block,
    and on a CPU the ranks share the host's memory."""
    contiguous = config.kv_cache == "contiguous"
    block_size = max_model_len if contiguous else config.block_size
    local_kv_heads = next(m.num_kv_heads for m in model.modules() if isinstance(m, Attention))
    per_token = kv_bytes_per_token(cfg, kv_dtype) * local_kv_heads // cfg.num_kv_heads
    if draft_config is not None:
        per_token += kv_bytes_per_token(draft_config, kv_dtype)
    per_block = per_token * block_size
    if config.num_blocks is not None:
        return _logged(block_size, config.num_blocks, per_block)
    needed = -(-max_model_len // block_size)  # blocks of one full-length sequence
    # No use in more than every sequence at full length, plus (paged) as much again for
    # the prefix cache.
    useful = config.max_num_seqs * needed * (1 if contiguous else 2)
    if device.type == "cuda":
        free = _cuda_free_after_warmup(config, model, device, kv_dtype, max_model_len)
    else:
        free = int(_available_host_memory() * _CPU_SHARE / tp_size)
    num_blocks = min(useful, free // per_block)
    if num_blocks < needed:
        raise ValueError(
            f"not enough memory for the KV cache: {num_blocks} blocks of {block_size} tokens "
            f"fit, one {max_model_len}-token sequence needs {needed}; lower max_model_len or "
            "raise gpu_memory_utilization"
        )
    if contiguous and num_blocks < config.max_num_seqs:
        log.info("contiguous KV cache: memory for %d sequences of %d tokens (max_num_seqs=%d)",
                 num_blocks, max_model_len, config.max_num_seqs)
    return _logged(block_size, num_blocks, per_block)


def _logged(block_size: int, num_blocks: int, per_block: int) -> tuple[int, int]:
    """Said before the cache is allocated (on a GPU, zeroing gigabytes is not instant; on a
    CPU the pages are taken as blocks are written: `attention.layer.zeroed_pool`)."""
    log.info("KV cache: %d blocks of %d tokens, %.2f GiB", num_blocks, block_size,
             num_blocks * per_block / 2**30)
    return block_size, num_blocks


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def _cuda_free_after_warmup(config: EngineConfig, model: nn.Module, device: torch.device,
                            kv_dtype: torch.dtype, max_model_len: int) -> int:
    """Memory left for the pool: the budget minus the peak of a full-budget forward (its
    positions kept below `max_model_len`: a step's budget may pass the model's context,
    and RoPE tables end there)."""
    from infer.attention import AttentionMetadata, allocate_kv_cache

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    n = config.max_num_batched_tokens
    allocate_kv_cache(model, 1, n, kv_dtype, device)
    meta = AttentionMetadata.build([n], [n], [[0]], n, device)
    with torch.inference_mode():
        hidden = model(torch.zeros(n, dtype=torch.long, device=device),
                       torch.arange(n, device=device) % max_model_len, meta)
        model.compute_logits(hidden[-config.max_num_seqs:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    for m in model.modules():
        if hasattr(m, "k_cache"):
            m.k_cache = m.v_cache = None
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    return max(0, int(total * config.gpu_memory_utilization) - peak)
