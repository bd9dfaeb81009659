"""Paged attention on the Triton kernels: the same two functions as `torch_backend`.

Unlike the reference, nothing here synchronises with the device or depends on sequence
lengths for its launch shapes when `meta.decode_splits` is set, so a decode step can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from infer.attention.metadata import AttentionMetadata
from infer.kernels import paged_attention as kernels
from infer.kernels.kv_store import store_kv


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    store_kv(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None, logit_softcap: float | None = None,
) -> torch.Tensor:
    return kernels.paged_attention(q, k_cache, v_cache, meta, scale, sliding_window,
                                   logit_softcap, num_splits=meta.decode_splits)
