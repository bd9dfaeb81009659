"""A CPU decode step's attention in one call a layer (`cpu_attention.cpp`): every sequence's
new query against its keys and values read through its block table, float32, in place of
the torch reference's gather, conversions and `scaled_dot_product_attention` (about a dozen
torch operations a layer, each microseconds of dispatch on a CPU). Before it, in every step,
the layer's RoPE and KV store in one call too (`cpu_rope_store.cpp`, about twenty torch
operations).

Built into infer's CPU extension (`cpu_extension.available`: x86 with AVX2, a
compiler); where that is missing, or for what it does not cover (a cache that is neither
float32 nor FP8, a query that is not float32), the torch path runs. An FP8 cache
(`attention/kv_dtype.py`) goes to the kernels as its bytes.
`EngineConfig.cpu_attention_kernel` turns it off."""

from __future__ import annotations

import torch

from infer.kernels import cpu_extension

_enabled = True  # EngineConfig.cpu_attention_kernel, set by the runner's set-up
FP8_KV = torch.float8_e4m3fn  # an FP8 cache's dtype (attention/kv_dtype.py)


def set_enabled(on: bool, device: torch.device | None = None) -> None:
    """Whether decode steps on the CPU take the kernel where it can (`takes`); on for a CPU
    `device`, the kernels are built now (once per machine, ~10 s, logged), at start-up
    rather than in a first request's step."""
    global _enabled
    _enabled = on
    if on and device is not None and device.type == "cpu":
        cpu_extension.available()


def takes(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_decode` serves this all-decode step: on, a float32 query and a float32
    or FP8 cache on the CPU, the extension built (what `rope_store` needs too)."""
    return (_enabled and q.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype in (torch.float32, FP8_KV) and k_cache.is_contiguous()
            and cpu_extension.available())


def _as_kernel_cache(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels take it: float32, or an FP8 one's bytes (uint8)."""
    return cache.view(torch.uint8) if cache.dtype == FP8_KV else cache


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None
                 ) -> torch.Tensor:
    """`q [seqs, heads, dim]`, one query a sequence at position `seq_lens[i] - 1`, against
    the cache's first `seq_lens[i]` tokens of each sequence (int32 `block_tables`,
    `seq_lens`), the last `sliding_window` of them if set, each score softcapped if
    `logit_softcap`: `[seqs, heads, dim]`, all float32."""
    return torch.ops.infer_cpu.paged_decode(q, _as_kernel_cache(k_cache),
                                            _as_kernel_cache(v_cache), block_tables, seq_lens,
                                            scale, sliding_window or 0, logit_softcap or 0.0)


def takes_rope_store(q: torch.Tensor, k: torch.Tensor, k_cache: torch.Tensor,
                     rotary: torch.nn.Module) -> bool:
    """Whether `rope_store` serves this layer's RoPE (tables over the whole head) and store:
    as `takes`, and q and k float32 heads of contiguous values side by side."""
    return (k.dtype == torch.float32 and not rotary.use_triton
            and 2 * rotary.cos.shape[1] == q.shape[-1]
            and q.stride(1) == k.stride(1) == q.shape[-1] and q.stride(2) == k.stride(2) == 1
            and takes(q, k_cache))


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: torch.nn.Module,
               positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> torch.Tensor:
    """q `[tokens, heads, dim]` and k rotated by `rotary`'s tables at `positions`; k and v
    `[tokens, kv_heads, dim]` stored at `slot_mapping` (-1: not stored); returns q rotated."""
    return torch.ops.infer_cpu.rope_store(q, k, v, rotary.cos, rotary.sin, positions,
                                          slot_mapping, _as_kernel_cache(k_cache),
                                          _as_kernel_cache(v_cache))
