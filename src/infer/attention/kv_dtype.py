"""The KV cache's element type (`EngineConfig.kv_cache_dtype`): the model's dtype, or FP8.

An FP8 cache holds each key and value as one e4m3 byte, by default with a scale of 1
(vLLM's `kv_cache_dtype="fp8"` without calibrated scales): half of bfloat16's memory, so the same
budget holds twice the tokens and a decode step's attention reads half the bytes. Values
are rounded to nearest (3 significant bits) and saturate at e4m3's largest, ±448, instead
of overflowing to NaN; the attention converts them back to the query's dtype as it reads
(on a CPU infer's C++ kernels store and read the bytes, `kernels/cpu_attention.py`).
Keys and values of the models served here stay far inside that range (their RMSNorms and
projections keep them within tens), so the rounding is the whole cost.

A checkpoint calibrated for an FP8 cache ships one scale for each layer's keys and one for
its values (`quantization/kv_scales.py`): the cache then stores `x / scale` (multiplied by
the scale's float32 inverse, by every store alike) and the attention reads `byte * scale`
(the key's scale folded into the softmax scale, the value's applied to the attention's
output). A cache of the model's dtype ignores them, as vLLM's does.
"""

from __future__ import annotations

import struct

import torch

FP8_KV = torch.float8_e4m3fn
FP8_KV_MAX = float(torch.finfo(FP8_KV).max)  # 448
# (key scale, value scale) of a layer's cache: a cached byte stands for `byte * scale`
KVScales = tuple[float, float]
UNSCALED: KVScales = (1.0, 1.0)


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for `EngineConfig.kv_cache_dtype` (its KV_CACHE_DTYPES)."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8_KV
    raise ValueError(f"kv_cache_dtype must be auto, fp8 or fp8_e4m3; got {name!r}")


def as_cache_values(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`x` (keys or values) as a cache of `dtype` stores them: FP8 `x / scale` (times
    `inverse(scale)`) saturating at ±448; any other dtype `x` itself."""
    if dtype == FP8_KV:
        x = x.float() if scale == 1.0 else x.float() * inverse(scale)
        return x.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV)
    return x if x.dtype == dtype else x.to(dtype)


def inverses(scales: KVScales) -> tuple[float, float]:
    """The float32 inverses the stores multiply a key and a value by."""
    return UNSCALED if scales == UNSCALED else (inverse(scales[0]), inverse(scales[1]))


def inverse(scale: float) -> float:
    """`1 / scale` rounded to float32, as every store multiplies by it (a Triton kernel
    takes a Python float as float32; torch multiplies a float32 tensor by it so too)."""
    return struct.unpack("f", struct.pack("f", 1.0 / scale))[0]
