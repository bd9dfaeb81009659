"""A checkpoint's calibrated FP8 KV-cache scales (compressed-tensors' `kv_cache_scheme`, as
llm-compressor writes it): each attention layer's `self_attn.k_scale` and
`self_attn.v_scale`, one float each, such that its keys and values stored in e4m3 are
`k / k_scale` and `v / v_scale`. `checkpoint.py` checks their presence and shapes from the
headers; `KVScaleReader` takes them out of the tensor stream while the model loads and hands
each to its layer's `Attention.kv_scales`, which an FP8 cache uses
(`attention/kv_dtype.py`) and a cache of the model's dtype ignores, as vLLM's does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from infer.attention import Attention
from infer.loader.errors import ModelLoadError

KV_SCALE_LEAVES = ("k_scale", "v_scale")
# a scale whose inverse is a float32 normal, with room to spare
SMALLEST, LARGEST = 1e-30, 1e30


class KVScaleReader:
    """Collects the scale tensors of a weight stream (`filter`), then sets them on the
    model's attention layers (`apply`)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.scales: dict[str, dict[str, float]] = {}  # checkpoint module -> leaf -> value

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """`weights` without the KV-cache scales, which are kept here."""
        for name, tensor in weights:
            module, _, leaf = name.rpartition(".")
            if leaf in KV_SCALE_LEAVES:
                self.scales.setdefault(module, {})[leaf] = self._value(name, tensor)
            else:
                yield name, tensor

    def _value(self, name: str, tensor: torch.Tensor) -> float:
        value = float(tensor.float().reshape(-1)[0])
        if not (math.isfinite(value) and SMALLEST <= value <= LARGEST):
            raise ModelLoadError(f"{self.where}: KV-cache scale {name!r} is {value}; it must "
                                 f"be a finite float between {SMALLEST:g} and {LARGEST:g}")
        return value

    def apply(self, model: nn.Module) -> None:
        """Set every collected pair on its layer's `Attention` (both scales of every layer
        with a k projection are there: `checkpoint.py` checked the headers)."""
        for module, pair in self.scales.items():
            attention = _attention_of(model, module)
            if attention is None:
                raise ModelLoadError(f"{self.where}: KV-cache scales of {module!r} belong to "
                                     "no attention layer here")
            attention.kv_scales = (pair["k_scale"], pair["v_scale"])


def _attention_of(model: nn.Module, module: str) -> Attention | None:
    """The `Attention` of the layer whose k projection the checkpoint names
    `{module}.k_proj.weight` (our q/k/v projection's sibling)."""
    target = model.param_for(f"{module}.k_proj.weight")
    if target is None:
        return None
    parent = target[0].rsplit(".", 2)[0]  # "<layer>.self_attn.qkv_proj.weight" -> the block
    try:
        attention = model.get_submodule(parent).get_submodule("attn")
    except AttributeError:
        return None
    return attention if isinstance(attention, Attention) else None
