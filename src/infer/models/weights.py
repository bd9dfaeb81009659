"""Copying checkpoint tensors into a model's parameters, fusing stacked projections."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


class WeightError(ValueError):
    """A checkpoint that does not match the model built from its config."""


# checkpoint sub-name -> (our fused parameter sub-name, shard index)
StackedMap = dict[str, tuple[str, int]]


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedMap,
    shard_sizes: Callable[[str], list[int]],
    rename: Callable[[str], str | None] = lambda name: name,
    optional: Callable[[str], bool] = lambda name: False,
    source: str = "checkpoint",
) -> None:
    """Copy `(name, tensor)` pairs into `model`.

    `rename` maps a checkpoint name to ours (None: skip the tensor). A name containing a key
    of `stacked` goes into a slice of the fused parameter; `shard_sizes(fused_name)` gives
    the row counts of its shards. Every parameter must be written, except those for which
    `optional` is true; a shape that differs from the model's raises `WeightError`.
    """
    params = dict(model.named_parameters())
    written: dict[str, set[int]] = {}
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        shard = None
        for part, (fused, index) in stacked.items():
            if f".{part}." in name:
                name, shard = name.replace(f".{part}.", f".{fused}."), index
                break
        param = params.get(name)
        if param is None:
            raise WeightError(f"{source}: unexpected tensor {ckpt_name!r} (no parameter {name!r})")
        target = param.data
        if shard is not None:
            sizes = shard_sizes(name)
            start = sum(sizes[:shard])
            target = target.narrow(0, start, sizes[shard])
        if tuple(tensor.shape) != tuple(target.shape):
            raise WeightError(
                f"{source}: tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(target.shape)} "
                "(does the model config match the weights?)"
            )
        with torch.no_grad():
            target.copy_(tensor)
        written.setdefault(name, set()).add(-1 if shard is None else shard)
    missing = []
    for name in params:
        if optional(name):
            continue
        expected = None
        for fused in {f for f, _ in stacked.values()}:
            if f".{fused}." in name:
                expected = set(range(len(shard_sizes(name))))
        got = written.get(name, set())
        if (expected is None and not got) or (expected is not None and not expected <= got):
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise WeightError(f"{source}: missing weights for {len(missing)} parameters: {shown}")
