"""Block-wise FP8 checkpoints: `weight [out, in]` float8_e4m3fn and one float scale per
`rows x cols` tile of it (HF's fine-grained FP8 as Qwen3-*-FP8 and DeepSeek ship it,
`weight_scale_inv [ceil(out / 128), ceil(in / 128)]`; compressed-tensors' block strategy
names the same tensor `weight_scale`): the float weight is the FP8 value times its tile's
scale.

Decode-sized steps on CUDA read the weight as stored through the W8A16 kernel, which
scales each tile as it goes; larger steps, and the CPU, multiply by the dequantized weight
(made per step: the weights stay in FP8 in memory).

Under tensor parallelism each rank keeps its part's tiles, so its part must be whole tiles
(rows of a column-parallel shard, input columns of a row-parallel layer); a split that
would cut a tile is refused when the layer is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infer.models.linear import LinearMethod, with_loader
from infer.models.weights import ShardId, WeightError, WeightLoader, check_shape
from infer.quantization.fp8 import FP8, reads_weight_only
from infer.quantization.stored import stored_weight


def _check_rank_part(layer: nn.Module, shard_id: ShardId, block: tuple[int, int]) -> None:
    """Under tensor parallelism each rank's part of a shard must be whole tiles: a tile cut
    between two ranks would need its scale on both, at an offset inside it."""
    if layer.tp_size == 1:
        return
    part = layer.rank_part(shard_id)
    tile = block[part.dim]
    if part.parts > 1 and part.size % tile:
        what = f"{part.size} {'rows' if part.dim == 0 else 'input columns'}"
        shard = "" if shard_id is None else f" of shard {shard_id!r}"
        raise WeightError(
            f"fp8-block weights ({block[0]}x{block[1]} tiles) cannot be split for "
            f"tensor_parallel_size={layer.tp_size}: each rank would hold {what}{shard} of a "
            f"{type(layer).__name__}, not a whole number of {tile}-wide tiles (a tile's "
            "one scale would straddle two ranks); use a tensor_parallel_size that divides "
            "the layer into whole tiles")


class Fp8BlockLinearMethod(LinearMethod):
    format = "fp8-block"

    def __init__(self, block: tuple[int, int], scale_name: str) -> None:
        self.block, self.scale_name = block, scale_name

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       weight_loader: WeightLoader) -> None:
        rows, cols = self.block
        for shard_id in layer.shard_ids or (None,):
            _check_rank_part(layer, shard_id, self.block)
        stored_weight(layer, FP8, input_size, output_sizes, weight_loader)
        scale = nn.Parameter(torch.empty(-(-sum(output_sizes) // rows), -(-input_size // cols),
                                         dtype=torch.float32), requires_grad=False)

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            """A shard's tiles: fused shards must start on a tile boundary."""
            start, size = 0, sum(layer.output_sizes)
            if shard_id is not None:
                index = layer.shard_ids.index(shard_id)
                start, size = sum(layer.output_sizes[:index]), layer.output_sizes[index]
            if start % rows:
                raise WeightError(f"shard {shard_id!r} starts at row {start}, inside a "
                                  f"{rows}-row tile of the fused weight")
            target = param.data.narrow(0, start // rows, -(-size // rows))
            if layer.tp_size > 1:  # this rank's tiles (whole: `_check_rank_part`)
                part = layer.rank_part(shard_id)
                tile = self.block[part.dim]
                want = list(target.shape)
                want[part.dim] = -(-part.size * part.parts // tile)
                check_shape(loaded, want)
                loaded = loaded.narrow(part.dim, part.start // tile, -(-part.size // tile))
            check_shape(loaded, target.shape)
            target.copy_(loaded)

        layer.register_parameter(self.scale_name, with_loader(scale, load, None, None))

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        rows, cols = self.block
        out, inp = layer.weight.shape
        scale = getattr(layer, self.scale_name)
        tiles = scale.repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :inp]
        return layer.weight.float() * tiles

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        tensor_core_rows = getattr(layer, "w8a16_tensor_core_rows", 0)
        if reads_weight_only(x2, tensor_core_rows):
            from infer.kernels.w8a16_matmul import w8a16_matmul

            y = w8a16_matmul(x2.contiguous(), layer.weight, getattr(layer, self.scale_name),
                             self.block, tensor_core_rows=tensor_core_rows)
        else:
            y = F.linear(x2, self.dequantize(layer).to(x.dtype))
        y = y.reshape(*shape[:-1], y.shape[-1])
        return y if bias is None else y + bias
