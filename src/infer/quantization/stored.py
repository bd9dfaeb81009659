"""Parameters of quantized weights: as a checkpoint stores them (the 8-bit weight, loaded
only from a tensor of its own dtype, and its scales, loaded from each layout's shapes), or
quantized from a float checkpoint's tensors one at a time as they load (so the model
never holds its full-precision weights)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from infer.models.linear import RowParallelLinear, with_loader
from infer.models.weights import ShardId, WeightError, WeightLoader


def stored_weight(layer: nn.Module, dtype: torch.dtype, input_size: int,
                  output_sizes: list[int], weight_loader: WeightLoader) -> None:
    """Register `weight [out, in]` in `dtype`; a checkpoint tensor of another dtype is refused
    (copying a float tensor into it would drop its scale)."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if loaded.dtype != dtype:
            raise WeightError(
                f"stored as {_name(loaded.dtype)}, where the checkpoint's quantization_config "
                f"makes this layer {_name(dtype)} (a checkpoint that leaves some of its linear "
                "layers unquantized is not supported)")
        weight_loader(param, loaded, shard_id)

    weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype),
                          requires_grad=False)
    layer.register_parameter("weight", with_loader(weight, load, 0, 1))


def channel_scale(layer: nn.Module, name: str, output_sizes: list[int], dtype: torch.dtype,
                  weight_loader: WeightLoader) -> None:
    """Register `name [out]`, one scale per output channel, loaded from a per-channel scale
    (`[out, 1]` or `[out]`) or a per-tensor one (`[]` or `[1]`: every row of that tensor,
    a fused layer's shard, gets it)."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if not loaded.is_floating_point():
            raise WeightError(f"a scale must be a float tensor, not {_name(loaded.dtype)}")
        if loaded.dim() == 2 and loaded.shape[1] == 1:
            loaded = loaded[:, 0]
        elif loaded.dim() <= 1 and loaded.numel() == 1:
            loaded = loaded.reshape(1).expand(_checkpoint_rows(layer, shard_id))
        weight_loader(param, loaded, shard_id)

    scale = nn.Parameter(torch.empty(sum(output_sizes), dtype=dtype), requires_grad=False)
    layer.register_parameter(name, with_loader(scale, load, 0, None))


def _checkpoint_rows(layer: nn.Module, shard_id: ShardId) -> int:
    """The rows of the checkpoint tensor that `shard_id` of `layer` (None: all of it) loads
    from, of which its loader keeps this rank's part (`LinearBase.rank_part`)."""
    if isinstance(layer, RowParallelLinear):
        return sum(layer.output_sizes)
    ids = layer.shard_ids if shard_id is None and layer.shard_ids else (shard_id,)
    return sum(part.size * part.parts for part in map(layer.rank_part, ids))


def quantized_as_loaded(layer: nn.Module, dtype: torch.dtype,
                        quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                        input_size: int, output_sizes: list[int], scale_dtype: torch.dtype,
                        weight_loader: WeightLoader) -> None:
    """Register `weight [out, in]` in `dtype` and `weight_scale [out]`, filled from a float
    checkpoint tensor by `quantize` (rows -> (quantized rows, a scale per row)): each
    tensor (a fused layer's shard) is quantized on the layer's device as it arrives. The
    scale is written by the weight's loader (`written_with`)."""
    weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype),
                          requires_grad=False)
    scale = nn.Parameter(torch.empty(sum(output_sizes), dtype=scale_dtype),
                         requires_grad=False)

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if not loaded.is_floating_point() or loaded.dtype == dtype:
            raise WeightError(f"stored as {_name(loaded.dtype)}; quantizing at load takes a "
                              "float tensor")
        q, row_scale = quantize(loaded.to(param.device))
        weight_loader(param, q, shard_id)
        weight_loader(layer.weight_scale, row_scale, shard_id)

    layer.register_parameter("weight", with_loader(weight, load, 0, 1))
    layer.register_parameter("weight_scale", with_loader(scale, weight_loader, 0, None))
    layer.weight_scale.written_with = "weight"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
