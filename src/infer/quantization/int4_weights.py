"""Weight-only INT4 made on the fly (`quantization="int4"`): each output channel's weights
in groups along the input dim (GROUPS: 128, or 64 / 32 where the input size asks), `w = q *
scale + zero` with q in 0..15 (the group's minimum as its zero, its range over 15 as its
scale, both in the activations' 16-bit dtype), as gpt-fast's and torchao's int4
weight-only quantization does.

On CUDA, steps of one or two rows (decode at batch 1, a draft round) read the packed
weight through `kernels/int4_gemv.py`: a quarter of bfloat16's bytes, 6 % more for the
scales and zeros; steps of up to 64 rows through `kernels/int4_matmul.py` (the weights
made 16-bit in registers for the tensor cores); larger steps multiply a dequantized copy
with cuBLAS (prefill is compute-bound). On the CPU, PyTorch's
`_weight_int4pack_mm_for_cpu` (`int4.py`: the same `q * scale + zero`, its own packing).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from infer.models.linear import LinearMethod, with_loader
from infer.models.weights import ShardId, WeightError, WeightLoader
from infer.quantization.int4 import Int4GroupLinearMethod, int4_packable
from infer.quantization.int8 import compute_dtype

GROUPS = (128, 64, 32)  # a layer takes the largest that divides its input size
MAX_GEMV_ROWS = 2  # kernels/int4_gemv.py's rows
MAX_MMA_ROWS = 64  # kernels/int4_matmul.py's; more (prefill) take a dequantized copy
CHANNEL_BLOCK = 8  # channels a block of the kernels' layout holds (`kernel_layout`)


def quantize_groups(weight: torch.Tensor, group: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 `[N, K]` in 0..15, scale, zero `[N, K / group]` in `dtype`) of `weight [N,
    K]`: each group's minimum is its zero and its range / 15 its scale, both rounded to
    `dtype` before q is chosen, so `q * scale + zero` is the nearest of the 16 values to
    each weight (a constant group: scale 1, q 0)."""
    rows, cols = weight.shape
    w = weight.float().view(rows, cols // group, group)
    low = w.amin(dim=-1)
    scale = (w.amax(dim=-1) - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(dtype)
    zero = low.to(dtype)
    q = torch.round((w - zero.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15)
    return q.to(torch.uint8).view(rows, cols), scale, zero


def pack_words(q: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 `[N, K]` values 0..15 as int32 `[N, K / 8]`: in each group of `group` values
    (group / 8 words), nibble i of word j holds the group's value i * group / 8 + j,
    lowest bits first (`kernels/int4_gemv.py` takes it transposed)."""
    rows, cols = q.shape
    stripes = q.view(rows, cols // group, 8, group // 8).transpose(2, 3)  # [.., j, i]
    pairs = stripes[..., 0::2] | (stripes[..., 1::2] << 4)  # byte b: i = 2b low, 2b + 1 high
    return pairs.contiguous().view(torch.int32).view(rows, cols // 8)  # byte 0 lowest


def channel_block(rows: int) -> int:
    """The channels a block of the kernels' layout holds for a weight of `rows` output
    channels: CHANNEL_BLOCK, or the largest power of two that divides it and, for a gated
    MLP's `[gate | up]` weight, half of it (a block never spans gate and up)."""
    return math.gcd(rows // 2 if rows % 2 == 0 else rows, CHANNEL_BLOCK)


def kernel_layout(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                  block: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_groups`' values as `kernels/int4_gemv.py` reads them: the channels in
    blocks of `block` (`channel_block`'s by default), each block's words K-major and
    contiguous, `[N / block, K / 8, block]` int32 (`pack_words`' words), and its groups'
    scales and zeros `[N / block, K / group, block]`; so a GEMV program's channels are
    one run of memory (on an H100 the 8B's o and down projections 10-16 % faster than
    with all channels in one block, `[K / 8, N]`; the other layers within 5 %)."""
    rows, cols = q.shape
    block = block or channel_block(rows)
    assert rows % block == 0, (rows, block)
    group = cols // scale.shape[1]

    def blocked(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(rows // block, block, t.shape[1]).transpose(1, 2).contiguous()

    return blocked(pack_words(q, group)), blocked(scale), blocked(zero)


def unblocked(t: torch.Tensor) -> torch.Tensor:
    """`kernel_layout`'s `[N / block, C, block]` as `[N, C]`."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])


def unpack_words(words: torch.Tensor, group: int) -> torch.Tensor:
    """`pack_words`' inverse: uint8 `[N, 8 * W]`."""
    rows = words.shape[0]
    pairs = words.contiguous().view(torch.uint8).view(rows, -1, group // 8, 4)
    nibbles = torch.stack([pairs & 0xF, pairs >> 4], dim=-1).view(rows, -1, group // 8, 8)
    return nibbles.transpose(2, 3).reshape(rows, -1)


def group_size(cols: int) -> int | None:
    """The group of a weight of `cols` inputs: the largest of GROUPS that divides it."""
    return next((g for g in GROUPS if cols % g == 0), None)


class _CpuInt4(Int4GroupLinearMethod):
    format = "int4"


class Int4WeightOnlyLinearMethod(LinearMethod):
    """`from_float`: the layer is built to quantize a float checkpoint's tensors as they
    load (`quantization="int4"`: the model never holds its 16-bit weights, only one byte a
    value until `finish` packs them); `quantize` makes a loaded float layer INT4 in place.
    Packed for CUDA's kernels here; on the CPU through torch's packed kernel
    (`int4.Int4GroupLinearMethod`)."""

    format = "int4"

    def __init__(self, from_float: bool = False) -> None:
        self.from_float = from_float

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       weight_loader: WeightLoader) -> None:
        """`weight [out, in]` uint8 (q, one value a byte) and `weight_scale`, `weight_zero
        [out, in / group]`, filled from each float tensor as it arrives (a fused layer's
        shard, this rank's part cut by the layer's loader); `finish` packs them."""
        group = group_size(input_size)
        if group is None:
            raise ValueError(f"a layer of {input_size} inputs has no INT4 group size: not a "
                             f"multiple of {GROUPS[-1]}")
        layer.compute_dtype = compute_dtype(torch.get_default_dtype())
        rows = sum(output_sizes)
        q = nn.Parameter(torch.empty(rows, input_size, dtype=torch.uint8), requires_grad=False)
        scale, zero = (nn.Parameter(torch.empty(rows, input_size // group,
                                                dtype=layer.compute_dtype),
                                    requires_grad=False) for _ in range(2))

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            if not loaded.is_floating_point():
                raise WeightError(f"stored as {loaded.dtype}; quantizing at load takes a "
                                  "float tensor")
            values, scales, zeros = quantize_groups(loaded.to(param.device), group,
                                                    layer.compute_dtype)
            weight_loader(param, values, shard_id)
            weight_loader(layer.weight_scale, scales, shard_id)
            weight_loader(layer.weight_zero, zeros, shard_id)

        layer.register_parameter("weight", with_loader(q, load, 0, 1))
        layer.register_parameter("weight_scale", with_loader(scale, weight_loader, 0, 1))
        layer.register_parameter("weight_zero", with_loader(zero, weight_loader, 0, 1))
        layer.weight_scale.written_with = layer.weight_zero.written_with = "weight"
        layer.int4_unpacked = True

    def finish(self, layer: nn.Module) -> None:
        """A layer loaded by `create_weights`' loaders packed as `quantize` packs one."""
        del layer.int4_unpacked
        q, scale, zero = layer.weight.data, layer.weight_scale.data, layer.weight_zero.data
        del layer.weight_scale, layer.weight_zero
        self._pack(layer, q, scale, zero)

    def quantize(self, layer: nn.Module) -> None:
        rows, cols = layer.weight.shape
        group = group_size(cols)
        if group is None:
            raise ValueError(f"a [{rows}, {cols}] weight has no INT4 group size: its input "
                             f"size is not a multiple of {GROUPS[-1]}")
        self._pack(layer, *quantize_groups(layer.weight.data, group,
                                           compute_dtype(layer.weight.dtype)))

    def _pack(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor,
              zero: torch.Tensor) -> None:
        """`layer`'s weight (on q's device) replaced by q packed for that device's kernel."""
        if q.device.type != "cpu":
            self.load(layer, q, scale, zero)
            return
        rows, cols = q.shape
        if not int4_packable(rows, cols, cols // scale.shape[1]):
            raise ValueError(f"a [{rows}, {cols}] weight does not take torch's CPU INT4 "
                             "packing (rows a multiple of 16)")
        _CpuInt4().load(layer, q, scale.float(), zero.float())

    def load(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor,
             zero: torch.Tensor) -> None:
        """`layer`'s weight replaced by `q` (`quantize_groups`' values) packed for the
        kernel, with its groups' `scale` and `zero` (in the activations' dtype)."""
        del layer.weight
        layer.compute_dtype = scale.dtype
        for name, tensor in zip(("weight", "weight_scale", "weight_zero"),
                                kernel_layout(q, scale, zero), strict=True):
            layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        layer.quant_method = self

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        groups = layer.weight_scale.shape[1]
        q = unpack_words(unblocked(layer.weight), layer.weight.shape[1] * 8 // groups).float()
        rows, cols = q.shape
        q = q.view(rows, groups, cols // groups)
        scale, zero = unblocked(layer.weight_scale).float(), unblocked(layer.weight_zero).float()
        return (q * scale[..., None] + zero[..., None]).view(rows, cols)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(layer.compute_dtype)
        if len(x2) <= MAX_GEMV_ROWS:
            from infer.kernels.int4_gemv import int4_gemv

            y = int4_gemv(x2.contiguous(), layer.weight, layer.weight_scale,
                          layer.weight_zero)
        elif len(x2) <= MAX_MMA_ROWS:
            from infer.kernels.int4_matmul import int4_matmul

            y = int4_matmul(x2.contiguous(), layer.weight, layer.weight_scale,
                            layer.weight_zero)
        else:  # compute-bound: cuBLAS on a copy
            y = F.linear(x2, self.dequantize(layer).to(x2.dtype))
        y = y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)
        return y if bias is None else y + bias

    def apply_gate_up(self, layer: nn.Module, x: torch.Tensor, act: str,
                      bias: torch.Tensor | None) -> torch.Tensor | None:
        x2 = x.reshape(-1, x.shape[-1])
        if len(x2) > MAX_GEMV_ROWS or bias is not None:
            return None
        from infer.kernels.int4_gemv import int4_gemv_gate_up

        y = int4_gemv_gate_up(x2.to(layer.compute_dtype).contiguous(), layer.weight,
                              layer.weight_scale, layer.weight_zero, act)
        return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
