"""The attention layer that models call: stores new K/V in the paged cache, then attends."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from infer.attention.backend import AttentionBackend, make_attention_backend
from infer.attention.kv_dtype import FP8_KV, UNSCALED, KVScales
from infer.attention.metadata import AttentionMetadata
from infer.attention.qk_prologue import QKPrologue
from infer.attention.torch_backend import TorchAttentionBackend


class Attention(nn.Module):
    """Backend-neutral attention over a paged KV cache.

    Models hand it projected q/k/v of shape `[num_tokens, heads * head_dim]`, position-encoded
    unless the layer has a `prologue` (then `positions` too: the backend applies it to q and
    k, fused with the KV store where it can); the backend object bound by the runner
    (`set_attention_backend`) writes the cache and attends, so model code never names a
    backend.

    `kv_scales` (a checkpoint's calibrated scales, `quantization/kv_scales.py`) apply to an
    FP8 cache only: it stores `k / k_scale` and `v / v_scale`; the key's scale joins the
    softmax scale and the value's multiplies the attention's output.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        prologue: QKPrologue | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.prologue = prologue
        self.kv_scales: KVScales = UNSCALED
        # Bound by `allocate_kv_cache`: views [num_blocks, block_size, kv_heads, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend = TorchAttentionBackend()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("no KV cache bound: call infer.attention.allocate_kv_cache first")
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        scales = self.kv_scales if self.k_cache.dtype == FP8_KV else UNSCALED
        if self.prologue is None:
            self.backend.write_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping, scales)
        else:
            assert positions is not None, "a layer with a prologue needs the positions"
            q = self.backend.write_kv_with_prologue(self.k_cache, self.v_cache, q, k, v,
                                                    meta.slot_mapping, positions,
                                                    self.prologue, scales)
        out = self.backend.forward(
            q, self.k_cache, self.v_cache, meta, self.scale * scales[0], self.sliding_window,
            self.logit_softcap,
        )
        if scales[1] != 1.0:
            out.mul_(scales[1])
        return out.view(num_tokens, self.num_heads * self.head_dim)


def set_attention_backend(model: nn.Module, backend: AttentionBackend | str) -> None:
    """Point every attention layer of `model` at `backend` (an object, or torch | triton)."""
    if isinstance(backend, str):
        backend = make_attention_backend(backend)
    for m in model.modules():
        if isinstance(m, Attention):
            m.backend = backend


def allocate_kv_cache(
    model: nn.Module,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Allocate one pool `[layers, 2, num_blocks, block_size, kv_heads, head_dim]` of
    `dtype` and bind each attention layer to its slice. Returns the pool (the caller owns
    its lifetime)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError("model has no Attention layers")
    shapes = {(m.num_kv_heads, m.head_dim) for m in layers}
    if len(shapes) != 1:
        raise ValueError(f"layers disagree on (kv_heads, head_dim): {sorted(shapes)}")
    num_kv_heads, head_dim = shapes.pop()
    pool = zeroed_pool((len(layers), 2, num_blocks, block_size, num_kv_heads, head_dim),
                       dtype, torch.device(device or next(model.parameters()).device))
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = pool[i, 0], pool[i, 1]
    return pool


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                ) -> torch.Tensor:
    """Zeros of `shape`. On a CPU, pages the kernel zeroes when first touched (numpy's
    calloc of a large block is a fresh mapping) rather than gigabytes written at start-up:
    a pool sized to a quarter of RAM took seconds to fill and was all resident before a
    single block was used. 64-byte aligned, as torch aligns its own."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(nbytes + 64, dtype=np.uint8))
    start = -raw.data_ptr() % 64
    return raw[start:start + nbytes].view(dtype).view(shape)
