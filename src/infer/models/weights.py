"""Copying checkpoint tensors into a model's parameters through each parameter's loader.

A parameter may carry `weight_loader(param, tensor, shard_id)` (the linear layers and
embeddings of `linear.py` set theirs: fused shards, a tensor-parallel rank's slice); any
other parameter (norms) is copied whole by `default_weight_loader`. A parameter that is
written shard by shard lists its shard ids in `param.shard_ids`; one that another
parameter's loader writes names it in `param.written_with`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

# Which part of a fused parameter a checkpoint tensor fills: "q" | "k" | "v" for q/k/v,
# 0 | 1 for gate/up, None for the whole parameter.
ShardId = str | int | None
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]
# checkpoint tensor name -> (our parameter name, shard id), or None to skip the tensor
ParamFor = Callable[[str], tuple[str, ShardId] | None]


class WeightError(ValueError):
    """A checkpoint that does not match the model built from its config."""


class ShapeMismatch(WeightError):
    """A loader was given a tensor of the wrong shape; `load_weights` names the tensor."""

    def __init__(self, got: tuple[int, ...], want: tuple[int, ...]) -> None:
        super().__init__(f"tensor has shape {got}, the model expects {want}")
        self.got, self.want = got, want


def check_shape(tensor: torch.Tensor, want: tuple[int, ...] | torch.Size) -> None:
    if tuple(tensor.shape) != tuple(want):
        raise ShapeMismatch(tuple(tensor.shape), tuple(want))


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId = None):
    if shard_id is not None:
        raise WeightError(f"parameter {tuple(param.shape)} has no shard {shard_id!r}")
    check_shape(tensor, param.shape)
    param.data.copy_(tensor)


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    param_for: ParamFor,
    source: str = "checkpoint",
) -> None:
    """Copy `(name, tensor)` pairs into `model`: `param_for` names the parameter (and shard)
    each tensor fills, the parameter's loader places it. Every parameter must be written
    (a sharded one: every shard, or the whole at once); a shape that differs from the
    model's raises `WeightError`."""
    params = dict(model.named_parameters())
    written: dict[str, set[ShardId]] = {}
    for ckpt_name, tensor in weights:
        target = param_for(ckpt_name)
        if target is None:
            continue
        name, shard = target
        param = params.get(name)
        if param is None:
            raise WeightError(f"{source}: unexpected tensor {ckpt_name!r} (no parameter {name!r})")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            with torch.no_grad():
                loader(param, tensor, shard)
        except ShapeMismatch as exc:
            raise WeightError(
                f"{source}: tensor {ckpt_name!r} has shape {exc.got}, the model expects "
                f"{exc.want} (does the model config match the weights?)"
            ) from None
        except WeightError as exc:
            raise WeightError(f"{source}: tensor {ckpt_name!r}: {exc}") from None
        written.setdefault(name, set()).add(shard)
    missing = [
        name for name, param in params.items()
        if not _complete(written.get(_written_as(name, param), set()),
                         getattr(param, "shard_ids", ()))
    ]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise WeightError(f"{source}: missing weights for {len(missing)} parameters: {shown}")


def _written_as(name: str, param: nn.Parameter) -> str:
    """The parameter whose loader writes `param`: a sibling named by `param.written_with`
    (a weight quantized as it loads writes its scale), else itself."""
    sibling = getattr(param, "written_with", None)
    return name if sibling is None else f"{name.rpartition('.')[0]}.{sibling}"


def _complete(written: set[ShardId], shard_ids: tuple) -> bool:
    return None in written or (bool(shard_ids) and set(shard_ids) <= written)
