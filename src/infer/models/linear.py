"""Linear layers and embeddings whose parameters load themselves.

Every projection of every architecture is one of these layers. Its `quant_method` creates
its parameters and runs its matmul, so a new weight format (FP8, INT8, GGUF kept
quantised) is a new method, not a new layer: the layer itself only knows the parameters
the method registered, and each parameter's `output_dim` / `input_dim` (which of its dims
are the layer's output and input features; absent: not split).

Tensor parallelism: a layer holds part `tp_rank` of `tp_size` equal parts of its weight,
cut along the output dim (column-parallel) or the input dim (row-parallel), and each
parameter's `weight_loader(param, tensor, shard_id)` copies that part of a full checkpoint
tensor; `rank_part(shard_id)` names that part for the weight formats that cut a layout of
their own (GGUF blocks, FP8 tiles). A row-parallel layer sums its partial outputs over the
ranks (one all-reduce); the vocabulary is split by rows, each rank's part padded to the
same length. The group is the one in effect when the layer is built
(`distributed.tensor_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from infer.distributed.group import TensorParallelGroup, current_group
from infer.models.weights import ShardId, WeightError, WeightLoader, check_shape


class LinearMethod:
    """How a linear layer stores its weight and multiplies by it; `format` names it (what
    `/v1/models` reports)."""

    format = "none"

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int],
        weight_loader: WeightLoader,
    ) -> None:
        """Register on `layer` the parameters of an `input_size -> sum(output_sizes)` matmul
        (this rank's sizes; `output_sizes` lists the fused shards, e.g. q, k, v), each with
        `weight_loader` and its `output_dim` / `input_dim`."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def apply_gated(self, layer: nn.Module, gate_up: torch.Tensor, act: str,
                    bias: torch.Tensor | None) -> torch.Tensor | None:
        """`apply` to `act(gate) * up` of the rows `[gate | up]` of `gate_up` where this
        method does both in fewer launches (`act`: kernels/activation.py's name); None
        where it does not."""
        return None

    def apply_gate_up(self, layer: nn.Module, x: torch.Tensor, act: str,
                      bias: torch.Tensor | None) -> torch.Tensor | None:
        """`act(gate) * up` of `apply(layer, x, bias)` for a gated MLP's fused `[gate | up]`
        weight, where this method's kernel for these rows stores it in the same launch
        (`kernels/gemv.py`'s `gemv_gate_up`); None where it does not."""
        return None

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of an embedding table this method stores."""
        raise NotImplementedError(f"{type(self).__name__} does not store embedding tables")

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The weight `[out, in]` as the float values it stands for (float32)."""
        raise NotImplementedError(f"{type(self).__name__} cannot dequantize")


class UnquantizedLinearMethod(LinearMethod):
    """A plain `weight [out, in]` in the model's dtype; `F.linear`, or for up to
    `gemv_rows` rows infer's GEMV kernel (`set_triton_gemv`; 0: never); a gated MLP's
    activation in the gate_up projection's launch for up to `gate_up_rows` of those."""

    def __init__(self) -> None:
        self.gemv_rows = 0
        self.gate_up_rows = 1

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int],
        weight_loader: WeightLoader,
    ) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size), requires_grad=False)
        layer.register_parameter("weight", with_loader(weight, weight_loader, 0, 1))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return matmul(x, layer.weight, bias, self.gemv_rows)

    def apply_gate_up(self, layer: nn.Module, x: torch.Tensor, act: str,
                      bias: torch.Tensor | None) -> torch.Tensor | None:
        """One row where it goes to infer's GEMV, up to `gate_up_rows` where they go to
        rows_mma."""
        if not _gemv_takes(x, layer.weight, bias, min(self.gemv_rows, self.gate_up_rows)):
            return None
        rows = x.reshape(-1, x.shape[-1])
        if len(rows) == 1:
            from infer.kernels.gemv import gemv_gate_up

            y = gemv_gate_up(rows.contiguous(), layer.weight, act)
        else:
            y = _engine_rows_mma(rows, layer.weight, gate_up=act)
        return y.view(*x.shape[:-1], y.shape[-1])

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float()


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           gemv_rows: int) -> torch.Tensor:
    """`x W^T + b`; up to `gemv_rows` rows without a bias through infer's kernels (`_gemv`)."""
    if _gemv_takes(x, weight, bias, gemv_rows):
        return _gemv(x, weight)
    return F.linear(x, weight, bias)


def _gemv_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                gemv_rows: int) -> bool:
    """Whether `x` (at most `gemv_rows` rows, the weight's dtype, no bias) goes to infer's
    kernels: one row in any float dtype, more in 16 bits."""
    rows = x.numel() // max(1, x.shape[-1])
    return (bias is None and x.numel() > 0 and rows <= gemv_rows and x.dtype == weight.dtype
            and (rows == 1 or (x.dtype in (torch.float16, torch.bfloat16)
                               and weight.is_contiguous())))


def _gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The rows of `x` (any leading shape) times `weight`, the result shaped alike: one row
    through kernels/gemv.py (CUDA cores), more through kernels/rows_mma.py (tensor cores:
    on the CUDA cores several rows cost more instructions a weight byte than the SMs issue
    at the copy rate, `benchmarks/sass_mix.py`)."""
    rows = x.reshape(-1, x.shape[-1])
    if len(rows) == 1:
        from infer.kernels import gemv

        y = gemv.gemv(rows.contiguous(), weight)
    else:
        y = _engine_rows_mma(rows, weight)
    return y.view(*x.shape[:-1], weight.shape[0])


def _engine_rows_mma(rows: torch.Tensor, weight: torch.Tensor, **options: object
                     ) -> torch.Tensor:
    """`rows_mma` of `rows [M, K]` (copied where their columns are not unit-stride) by
    `weight`, at the engine's launch for the weight (`rows_mma.engine_launch`)."""
    from infer.kernels import rows_mma

    return rows_mma.rows_mma(rows if rows.stride(-1) == 1 else rows.contiguous(), weight,
                             **rows_mma.engine_launch(*weight.shape, rows.device), **options)


def set_triton_gemv(model: nn.Module, on: bool, max_rows: int = 1,
                    gate_up_rows: int = 1) -> None:
    """Matmuls of up to `max_rows` rows by `model`'s plain 16-bit weights (projections, LM
    head) through infer's Triton kernels (`on`) or cuBLAS; a gated MLP's activation stored
    by its gate_up projection's launch for up to `gate_up_rows` of them (where the MLP
    asks: `layers.set_gate_up_activation`)."""
    rows = max_rows if on else 0
    for m in model.modules():
        if isinstance(m, LinearBase) and isinstance(m.quant_method, UnquantizedLinearMethod):
            m.quant_method.gemv_rows = rows
            m.quant_method.gate_up_rows = gate_up_rows
        elif isinstance(m, ParallelLMHead):
            m.gemv_rows = rows


def set_8bit_kernels(model: nn.Module, tensor_core_rows: int, fp8_activations: bool,
                     fp8_mma_rows: int = 0, int8_mma_rows: int = 0,
                     gemv_rows: int = 0, gate_up_rows_apart: bool = False,
                     cpu_int8_kernel: bool = False, int8_x16_gemv: bool = False,
                     w8_wgmma: bool = False, fp8_wgmma_rows: int = 0,
                     fp8_norm_rows: bool = False, fp8_act_rows: bool = False) -> None:
    """How `model`'s 8-bit layers (projections, LM head) multiply decode-sized steps:
    weight-only INT8 / FP8 on tensor cores up to `tensor_core_rows` rows where they gain
    (`w8a16_matmul.py`'s rule; 0: never) or CUDA cores, up to `gemv_rows` rows scaled per
    channel in infer's GEMV (0: none; two on narrow layers only, `w8a16_matmul.gemv_takes`),
    before the tensor cores; FP8 ones with x quantized too, FP8 by FP8 (`fp8_activations`),
    and FP8 by FP8 steps of up to `fp8_mma_rows` rows in
    `kernels/rows_mma.py` rather than `torch._scaled_mm`; INT8 ones of 2 to
    `int8_mma_rows` rows on the int8 tensor cores (`kernels/int8_x16.py`; 0: never), those
    two through `kernels/w8_wgmma.py` instead with `w8_wgmma` (a Hopper GPU), FP8 ones of
    up to `fp8_wgmma_rows` rows by x as it is through `kernels/fp8_wgmma.py`, past
    `gemv_rows`, and one row made by an RMSNorm by dp4a with `int8_x16_gemv`
    (`kernels/int8_x16_gemv.py`), x split by the norms that make it (`set_x16_norms`); a
    gate_up projection's two rows whose first may be skipped as two one-row GEMV launches
    with `gate_up_rows_apart` (`w8a16_matmul.gate_up_gemv`); INT8 ones on a CPU through
    infer's kernel with `cpu_int8_kernel` (`kernels/cpu_int8_linear.cpp`); FP8 ones' x
    quantized by the norms that make it at the FP8 x FP8 steps with `fp8_norm_rows`
    (`set_fp8_norms`), by the gated activations that make it with `fp8_act_rows`
    (`set_fp8_activations`)."""
    for m in model.modules():
        if isinstance(m, (LinearBase, ParallelLMHead)):
            m.w8a16_tensor_core_rows = tensor_core_rows
            m.fp8_decode_activations = fp8_activations
            m.fp8_mma_rows = fp8_mma_rows
            m.int8_mma_rows = int8_mma_rows
            m.int8_x16_gemv = int8_x16_gemv
            m.w8_wgmma = w8_wgmma
            m.fp8_wgmma_rows = fp8_wgmma_rows
            m.w8a16_gemv_rows = gemv_rows
            m.gate_up_rows_apart = gate_up_rows_apart
            m.cpu_int8_kernel = cpu_int8_kernel
    set_x16_norms(model, int8_x16_gemv, int8_mma_rows)
    fp8_x_rows = _fp8_x_rows(tensor_core_rows, fp8_activations, fp8_mma_rows, fp8_wgmma_rows)
    set_fp8_norms(model, fp8_x_rows if fp8_norm_rows else range(0))
    set_fp8_activations(model, fp8_x_rows if fp8_act_rows else range(0))


def _fp8_x_rows(tensor_core_rows: int, fp8_activations: bool, fp8_mma_rows: int,
                fp8_wgmma_rows: int) -> range:
    """The decode steps whose rows an FP8 layer quantizes for infer's FP8 x FP8 kernel:
    past the weight-only ones (all, with `fp8_activations`) and `fp8_wgmma_rows`, up to
    `fp8_mma_rows` (`Fp8LinearMethod.apply`)."""
    from infer.quantization.fp8 import WEIGHT_ONLY_ROWS

    first = 1 if fp8_activations else max(WEIGHT_ONLY_ROWS, tensor_core_rows) + 1
    return range(max(first, fp8_wgmma_rows + 1), fp8_mma_rows + 1)


def set_fp8_norms(model: nn.Module, rows: range) -> None:
    """Which steps' RMSNorms hand out their output's rows in FP8 with their scales
    (`RMSNorm.fp8_rows`: `rows`), so that the FP8 layers they feed need no launch of
    their own to quantize x: where the norm's output goes into an FP8 projection
    (`RMSNorm.feeds_projection`, `_set_norm_rows`)."""
    from infer.quantization.fp8 import Fp8LinearMethod

    _set_norm_rows(model, Fp8LinearMethod, "fp8_rows", rows)


def set_fp8_activations(model: nn.Module, rows: range) -> None:
    """Which steps' gated activations hand out their output's rows in FP8 with their scales
    (`GatedMLP.fp8_rows`: `rows`), so that an FP8 down projection needs no launch of its
    own to quantize x: the MLPs whose down projection is FP8, with rows (this rank's) no
    wider than one program holds (`fp8_quant.ROW_IN_REGISTERS`)."""
    from infer.models.layers import GatedMLP
    from infer.quantization.fp8 import Fp8LinearMethod

    widest = 0
    if rows:  # asked for only where Triton is (a GPU with FP8 tensor cores)
        from infer.kernels.fp8_quant import ROW_IN_REGISTERS as widest
    for m in model.modules():
        if isinstance(m, GatedMLP):
            takes = (isinstance(m.down_proj.quant_method, Fp8LinearMethod)
                     and m.down_proj.input_size <= widest)
            m.fp8_rows = rows if takes else range(0)


def set_x16_norms(model: nn.Module, one_row: bool, mma_rows: int) -> None:
    """Which steps' RMSNorms hand out their output with its rows split into int8 halves
    (`RMSNorm.x16_rows`), so that the INT8 kernels taking x so (`int8_x16_gemv` at one
    row, `one_row`; the int8 tensor cores at 2 to `mma_rows`) need no split launch of
    their own: where the norm's output goes into an INT8 projection
    (`RMSNorm.feeds_projection`, `_set_norm_rows`)."""
    from infer.quantization.int8 import Int8WeightOnlyLinearMethod

    _set_norm_rows(model, Int8WeightOnlyLinearMethod, "x16_rows",
                   range(1 if one_row else 2, max(mma_rows, one_row) + 1))


def _set_norm_rows(model: nn.Module, method: type, attribute: str, rows: range) -> None:
    """`rows` as the `attribute` of `model`'s RMSNorms whose output goes into a projection
    of the linear method `method`, none elsewhere: the final norm by the LM head's method
    (an FP8 model's is INT8), every other one by the decoder layers' projections."""
    from infer.models.layers import RMSNorm

    def takes(m: nn.Module | None) -> bool:
        return isinstance(getattr(m, "quant_method", None), method)

    head = next((m for m in model.modules() if isinstance(m, ParallelLMHead)), None)
    final = getattr(getattr(model, "model", model), "norm", None)
    in_layers = any(takes(m) for m in model.modules() if isinstance(m, LinearBase))
    for m in model.modules():
        if isinstance(m, RMSNorm):
            found = takes(head) if m is final else in_layers
            setattr(m, attribute, rows if found and m.feeds_projection else range(0))


# What a linear layer built without a `quant_method` gets (`linear_method_default`).
_DEFAULT_METHOD: ContextVar[Callable[[], LinearMethod]] = ContextVar(
    "default_linear_method", default=UnquantizedLinearMethod)


@contextmanager
def linear_method_default(make: Callable[[], LinearMethod]) -> Iterator[None]:
    """Within: every linear layer built without a `quant_method` gets `make()`. A checkpoint
    stored quantized chooses its method before the model is built, so the weights are
    allocated as stored (never a full-precision copy first)."""
    token = _DEFAULT_METHOD.set(make)
    try:
        yield
    finally:
        _DEFAULT_METHOD.reset(token)


class RankPart(NamedTuple):
    """The slice of a checkpoint's full weight `[out, in]` (one fused shard's) that a rank
    holds: part `index` of `parts` equal parts of `size` along `dim` (0: rows, of a
    column-parallel layer; 1: columns, of a row-parallel one). For weight formats that
    keep their own layout (GGUF blocks, FP8 tiles), cut to the same slice."""

    dim: int
    index: int
    parts: int
    size: int

    @property
    def start(self) -> int:
        return self.index * self.size


class LinearBase(nn.Module):
    """`y = x W^T + b`. `input_size` and `output_sizes` are this rank's; `shard_ids` names the
    fused shards of the output (their checkpoint tensors are loaded one by one)."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool,
        shard_ids: tuple[ShardId, ...] = (), quant_method: LinearMethod | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.input_size, self.output_sizes, self.shard_ids = input_size, output_sizes, shard_ids
        self.tp = tp or current_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.quant_method = quant_method or _DEFAULT_METHOD.get()()
        self.quant_method.create_weights(self, input_size, output_sizes, self.weight_loader)
        if bias:  # never quantised: the layer owns it
            b = nn.Parameter(torch.empty(sum(output_sizes)), requires_grad=False)
            self.bias = with_loader(b, self.weight_loader, 0, None)
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            param.shard_ids = shard_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        raise NotImplementedError

    def rank_part(self, shard_id: ShardId = None) -> RankPart:
        """This rank's slice of the checkpoint's weight for `shard_id`."""
        raise NotImplementedError


class ColumnParallelLinear(LinearBase):
    """The output features are split across ranks; each rank computes its slice of `y`."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False,
        quant_method: LinearMethod | None = None, tp: TensorParallelGroup | None = None,
    ) -> None:
        tp = tp or current_group()
        super().__init__(input_size, [_divide(output_size, tp.size)], bias, (), quant_method,
                         tp)

    def shard_part(self, shard_id: ShardId) -> tuple[int, int]:
        """(part, parts): which of how many equal parts of the checkpoint's tensor for
        `shard_id` this rank holds."""
        return self.tp_rank, self.tp_size

    def rank_part(self, shard_id: ShardId = None) -> RankPart:
        if shard_id is None:
            if len(self.shard_ids) > 1 and self.tp_size > 1:
                raise WeightError("a rank's rows of a fused weight are one slice per shard")
            return RankPart(0, *self.shard_part(None), sum(self.output_sizes))
        return RankPart(0, *self.shard_part(shard_id),
                        self.output_sizes[self.shard_ids.index(shard_id)])

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        dim = getattr(param, "output_dim", None)
        if shard_id is None and len(self.shard_ids) > 1 and dim is not None:
            # A checkpoint that stores the shards already fused (GPT-2's c_attn): each
            # shard's rows are cut per rank separately.
            full = [n * self.shard_part(sid)[1] for n, sid in zip(self.output_sizes,
                                                                  self.shard_ids)]
            want = list(param.shape)
            want[dim] = sum(full)
            check_shape(loaded, want)
            for sid, part in zip(self.shard_ids, loaded.split(full, dim)):
                self.weight_loader(param, part, sid)
            return
        target = param.data
        if shard_id is not None:
            if shard_id not in self.shard_ids or dim is None:
                raise WeightError(f"{type(self).__name__} has no shard {shard_id!r}")
            index = self.shard_ids.index(shard_id)
            start = sum(self.output_sizes[:index])
            target = target.narrow(dim, start, self.output_sizes[index])
        _load_part(target, loaded, dim, *self.shard_part(shard_id))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up:
    shard ids 0, 1, ...); each rank holds its slice of every shard, shards in order."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False,
        quant_method: LinearMethod | None = None, tp: TensorParallelGroup | None = None,
    ) -> None:
        tp = tp or current_group()
        LinearBase.__init__(
            self, input_size, [_divide(n, tp.size) for n in output_sizes], bias,
            tuple(range(len(output_sizes))), quant_method, tp,
        )

    def forward_gate_up(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """`act(gate) * up` of `forward(x)` (shards gate, up) where the weight's method
        stores it from the matmul's own launch (`apply_gate_up`); None where it does not."""
        return self.quant_method.apply_gate_up(self, x, act, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection (shard ids "q", "k", "v"); each rank holds its heads of each.
    With fewer KV heads than ranks, each KV head is replicated on the ranks whose query
    heads read it (`tp_size` a multiple of `num_kv_heads`)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
        bias: bool = False, quant_method: LinearMethod | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        tp = tp or current_group()
        heads = _divide(num_heads, tp.size)
        if num_kv_heads < tp.size:
            if tp.size % num_kv_heads:
                raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over "
                                 f"{tp.size} tensor-parallel ranks")
            kv_heads = 1
        else:
            kv_heads = _divide(num_kv_heads, tp.size)
        self.total_kv_heads = num_kv_heads
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        LinearBase.__init__(self, hidden_size, sizes, bias, ("q", "k", "v"), quant_method, tp)
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, heads, kv_heads

    def shard_part(self, shard_id: ShardId) -> tuple[int, int]:
        if shard_id in ("k", "v") and self.total_kv_heads < self.tp_size:
            # Rank r's query heads all read KV head r // (ranks per KV head).
            return self.tp_rank // (self.tp_size // self.total_kv_heads), self.total_kv_heads
        return self.tp_rank, self.tp_size


class RowParallelLinear(LinearBase):
    """The input features are split across ranks: each rank multiplies its slice of `x` by
    its columns of `W`, giving a partial `y` that is summed over the ranks."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False,
        quant_method: LinearMethod | None = None, tp: TensorParallelGroup | None = None,
    ) -> None:
        tp = tp or current_group()
        super().__init__(_divide(input_size, tp.size), [output_size], bias, (), quant_method,
                         tp)
        # False: forward returns this rank's partial sum, which the module after it
        # all-reduces (`layers.reduce_in_norm`).
        self.reduce_output = True

    def rank_part(self, shard_id: ShardId = None) -> RankPart:
        return RankPart(1, self.tp_rank, self.tp_size, self.input_size)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if shard_id is not None:
            raise WeightError(f"RowParallelLinear has no shard {shard_id!r}")
        # The bias has no input dim: every rank holds all of it.
        _load_part(param.data, loaded, getattr(param, "input_dim", None), self.tp_rank,
                   self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        if not self.reduce_output:
            return self.quant_method.apply(self, x, None)
        y = self.tp.all_reduce(self.quant_method.apply(self, x, None))
        return y if self.bias is None else y + self.bias

    def forward_gated(self, gate_up: torch.Tensor, act: str) -> torch.Tensor | None:
        """`forward(act(gate) * up)` for the rows of `gate_up [rows, 2 * input]` where the
        weight's method joins the activation to the matmul's launches (`apply_gated`; `act`
        one of kernels/activation.py's); None where it does not."""
        y = self.quant_method.apply_gated(self, gate_up, act,
                                          self.bias if self.tp_size == 1 else None)
        if y is None:
            return None
        if self.tp_size == 1 or not self.reduce_output:
            return y
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding table `[vocab, dim]`; rank `tp_rank` holds rows
    `[vocab_start, vocab_start + rows)`, the last rank's part padded with zero rows."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.tp = tp or current_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.num_embeddings = num_embeddings
        rows = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * rows
        weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
        self.weight = with_loader(weight, self.weight_loader, 0, 1)
        # Set by infer.quantization when the table is kept quantized: it looks rows up
        # (`embed`) and, for the LM head, multiplies (`apply`).
        self.quant_method: LinearMethod | None = None

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if shard_id is not None:
            raise WeightError(f"{type(self).__name__} has no shard {shard_id!r}")
        if self.tp_size == 1:
            _load_part(param.data, loaded, 0, 0, 1)
            return
        check_shape(loaded, (self.num_embeddings, *param.shape[1:]))
        mine = loaded[self.vocab_start:self.vocab_start + param.shape[0]]
        param.data[:mine.shape[0]].copy_(mine)
        param.data[mine.shape[0]:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._embed(input_ids)
        # Each rank looks up the ids in its rows (zeros for the others'); the sum over
        # the ranks is every id's row.
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = self._embed(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embed(self, ids)
        return F.embedding(ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits `hidden @ W^T` over the vocabulary (each rank's slice, gathered). `tied`: use
    that embedding's parameter (one tensor, loaded once, under the embedding's name)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int,
        tied: VocabParallelEmbedding | None = None, tp: TensorParallelGroup | None = None,
    ) -> None:
        if tied is None:
            super().__init__(num_embeddings, embedding_dim, tp)
            self.gemv_rows = 0
            return
        nn.Module.__init__(self)
        self.tp, self.tp_rank, self.tp_size = tied.tp, tied.tp_rank, tied.tp_size
        self.num_embeddings, self.vocab_start = tied.num_embeddings, tied.vocab_start
        self.weight = tied.weight
        self.quant_method = None
        self.gemv_rows = 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            logits = self.quant_method.apply(self, hidden, None)
        else:
            logits = matmul(hidden, self.weight, None, self.gemv_rows)
        if self.tp_size == 1:
            return logits
        return self.tp.all_gather(logits)[..., :self.num_embeddings]


def with_loader(
    param: nn.Parameter, loader: WeightLoader, output_dim: int | None, input_dim: int | None
) -> nn.Parameter:
    """`param` given its loader and which of its dims are the output and input features."""
    param.weight_loader = loader
    param.output_dim, param.input_dim = output_dim, input_dim
    return param


def _load_part(
    target: torch.Tensor, loaded: torch.Tensor, dim: int | None, rank: int, parts: int
) -> None:
    """Copy part `rank` of `parts` equal parts of `loaded` along `dim` (None: all of it)
    into `target`, after checking `loaded` is `parts` times `target` along `dim`."""
    want = list(target.shape)
    if dim is not None:
        want[dim] *= parts
    check_shape(loaded, want)
    if dim is not None and parts > 1:
        loaded = loaded.narrow(dim, rank * target.shape[dim], target.shape[dim])
    target.copy_(loaded)


def _divide(size: int, parts: int) -> int:
    if size % parts:
        raise ValueError(f"{size} does not split into {parts} tensor-parallel parts")
    return size // parts
