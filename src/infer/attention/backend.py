"""The attention-backend object: what the runner and the Attention layers ask of a backend.

Two implementations share this protocol: `TorchAttentionBackend` (the reference, CPU and
GPU) and `TritonAttentionBackend` (our kernels; CUDA graphs). A runner holds one backend
object, builds each step's `AttentionMetadata` with it, binds it into the model's
Attention layers, and asks it for the static buffers of captured graphs.
"""

from __future__ import annotations

from typing import Protocol

import torch

from infer.attention.graph_metadata import GraphMetadata
from infer.attention.kv_dtype import UNSCALED, KVScales
from infer.attention.metadata import AttentionMetadata
from infer.attention.qk_prologue import QKPrologue
from infer.attention.varlen_graph_metadata import VarlenGraphMetadata

BACKENDS = ("torch", "triton")


class AttentionBackend(Protocol):
    name: str

    def build_metadata(
        self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
        block_size: int, device: torch.device | str,
    ) -> AttentionMetadata:
        """The step's metadata, built once per step and passed to every layer."""
        ...

    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        slot_mapping: torch.Tensor, scales: KVScales = UNSCALED,
    ) -> None:
        """Store new keys/values `[num_tokens, kv_heads, head_dim]` at their slots (-1: skip),
        an FP8 cache's divided by `scales` (attention/kv_dtype.py)."""
        ...

    def write_kv_with_prologue(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
        prologue: QKPrologue, scales: KVScales = UNSCALED,
    ) -> torch.Tensor:
        """Apply `prologue` at `positions` to q `[num_tokens, heads, head_dim]` and k, store
        k and v as `write_kv` does; returns the new q (possibly q itself, changed in place)."""
        ...

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of new queries `[num_tokens, heads, head_dim]` over the cache,
        which already holds their keys/values."""
        ...

    def init_graph_metadata(
        self, max_batch: int, query_len: int, max_seq_len: int, block_size: int,
        num_kv_heads: int, device: torch.device, split_keys: bool = False,
        catch_up: bool = False,
    ) -> GraphMetadata:
        """Static buffers for graphs of up to `max_batch` sequences of `query_len` new tokens
        each (raises if this backend's launches cannot be captured); `split_keys`: steps of
        several tokens a sequence split the keys as decode steps do; `catch_up`: see
        `GraphMetadata`."""
        ...

    def init_varlen_graph_metadata(
        self, max_tokens: int, max_seqs: int, max_seq_len: int, block_size: int,
        num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
    ) -> VarlenGraphMetadata:
        """Static buffers for graphs of steps of any shape, up to `max_tokens` tokens over
        up to `max_seqs` sequences (raises if this backend's launches cannot be captured)."""
        ...


def make_attention_backend(name: str) -> AttentionBackend:
    """A fresh backend object for `name` (torch | triton)."""
    if name == "triton":
        from infer.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "torch":
        from infer.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
