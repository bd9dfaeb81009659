"""How many sequences a step batches and how many tokens it takes, when the user does not
say: sized to the device, as vLLM sizes them per GPU class.

A GPU decodes a batch of 256 for little more than a batch of 64 (the weights are read once
a step either way), and a step of 16,384 prompt tokens keeps its matmuls at full rate. On
the H100, nano-vllm's protocol on Qwen3-0.6B ran at 11,512 tok/s with 64 sequences and
2,048 tokens, 16,956 with 256 and 16,384 (docs/performance.md). A smaller GPU
gets half the budget (its KV cache holds fewer long sequences anyway: the scheduler runs
as many as have blocks). A CPU keeps the small defaults: its steps cost in proportion to
their tokens.

The server sizes its own batch (`infer serve`: 256 sequences on a GPU, 2,048 tokens a step,
which keeps the inter-token latency of the running streams low while prompts arrive).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from infer.engine.config import EngineConfig  # which imports these defaults

log = logging.getLogger(__name__)

CPU_DEFAULTS = (64, 2048)  # (max_num_seqs, max_num_batched_tokens)
LARGE_GPU_DEFAULTS = (256, 16384)
GPU_DEFAULTS = (256, 8192)
LARGE_GPU_BYTES = 70 * 2**30  # an H100 / H200 / A100-80GB class card


def batch_defaults(device: torch.device) -> tuple[int, int, str]:
    """(max_num_seqs, max_num_batched_tokens, the reason) for `device`."""
    if device.type != "cuda":
        return (*CPU_DEFAULTS, "on a CPU")
    import torch

    props = torch.cuda.get_device_properties(device)
    gib = props.total_memory / 2**30
    if props.total_memory >= LARGE_GPU_BYTES:
        return (*LARGE_GPU_DEFAULTS, f"on a GPU with {gib:.0f} GiB")
    return (*GPU_DEFAULTS, f"on a GPU with {gib:.0f} GiB (under 70)")


def fit_batch_to_device(config: EngineConfig, device: torch.device,
                        max_model_len: int) -> EngineConfig:
    """`config` with max_num_seqs and max_num_batched_tokens chosen for `device` where they
    are None (logged with the reason); a budget never below max_model_len when prefills
    are not chunked."""
    if config.max_num_seqs is not None and config.max_num_batched_tokens is not None:
        return config
    seqs, tokens, why = batch_defaults(device)
    if not config.chunked_prefill:
        tokens = max(tokens, max_model_len)
    chosen = {name: value for name, value in (("max_num_seqs", seqs),
                                               ("max_num_batched_tokens", tokens))
              if getattr(config, name) is None}
    log.info("%s, the defaults %s (set them to change)",
             ", ".join(f"{name}={value}" for name, value in chosen.items()), why)
    return dataclasses.replace(config, **chosen)
