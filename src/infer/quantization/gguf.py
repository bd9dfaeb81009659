"""GGUF weights kept quantized: each layer of a model loaded from a GGUF file gets the
method that runs its stored format on this device.

On CUDA every weight in a type the Triton kernels decode (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K,
Q6_K) stays in the file's blocks (`gguf_gpu.py`), the embedding table and LM head too;
another quantized type is requantized to INT8 per channel.

On the CPU, with `cpu_int8_activations` (infer's block kernels, x rounded to int8 per 32
values as llama.cpp does: `cpu_blocks.py`), the 4-bit layers and a Q8_0 embedding table /
LM head keep their blocks; every other quantized weight, and all of them without it, go to
PyTorch's packed kernels:
- a linear layer whose shards are all 4-bit (Q4_0, Q4_1, Q4_K) keeps them exactly as
  stored, in groups of 32 (`int4.py`);
- a layer with any other quantized type (Q8_0, Q5_K, Q6_K, ...) is requantized from the
  dequantized weights to INT8 with one scale per output channel (`int8.py`): the file's
  8-, 6- and 5-bit blocks have no CPU kernel in PyTorch, and 8 bits per channel keeps
  their precision within their own rounding (tests measure it);
- a quantized token embedding (and the LM head that shares it, or a quantized LM head of
  its own) goes to INT8 per row the same way; float tensors stay float.

Under tensor parallelism the blocks are the file's whole tensors: each layer keeps its
rank's part (`LinearBase.rank_part`): rows of a column-parallel layer, columns of a
row-parallel one, cut on block boundaries (a 4-bit weight on the CPU in groups of 32
after decoding, since a Q4_K block of 256 may straddle two ranks; on CUDA such a layer
is requantized to INT8 from its rank's dequantized weight), the vocabulary's rows of a
table with its zero padding.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from gguf import GGMLQuantizationType as QType
from torch import nn

from infer.kernels import cpu_extension
from infer.models.linear import LinearBase, VocabParallelEmbedding
from infer.models.weights import ShardId
from infer.progress import loading_bar
from infer.quantization.cpu_blocks import Q4BlocksLinearMethod, Q8BlocksTableMethod
from infer.quantization.gguf_blocks import GROUP, INT4_TYPES, GGUFBlocks, int4_groups
from infer.quantization.gguf_gpu import GGUFBlocksLinearMethod, gpu_types
from infer.quantization.int4 import Int4GroupLinearMethod, int4_packable
from infer.quantization.int8 import Int8WeightOnlyLinearMethod, quantize_table
from infer.quantization.tables import convert_table

log = logging.getLogger(__name__)


def keep_gguf_quantized(model: nn.Module, blocks: dict[str, GGUFBlocks],
                        as_blocks: bool | None = None, cpu_int8_activations: bool = False
                        ) -> bool:
    """Convert `model` (loaded from the GGUF file whose quantized weights are `blocks`, by
    checkpoint name) in place; whether anything was kept quantized. `as_blocks`: keep the
    file's blocks for the Triton kernels (default: on CUDA; the CPU's formats else).
    `cpu_int8_activations`: on the CPU, infer's block kernels where they take the type."""
    if as_blocks is None:
        as_blocks = next(model.parameters()).device.type == "cuda"
    by_param = {}
    for ckpt_name, b in blocks.items():
        target = model.param_for(ckpt_name)
        if target is not None:
            by_param[target] = b
    if as_blocks:
        keep_linear, keep_table = _keep_blocks, _keep_table_blocks
    elif cpu_int8_activations and cpu_extension.available():
        keep_linear, keep_table = _keep_cpu_blocks, _keep_cpu_table_blocks
    else:
        keep_linear, keep_table = _keep_linear, _keep_table
    kept: Counter[str] = Counter()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, LinearBase)]
    for name, module in loading_bar(linears, len(linears), "Keeping GGUF weights quantized",
                                    "layer"):
        shards = [by_param.get((f"{name}.weight", s)) for s in module.shard_ids or (None,)]
        kept[keep_linear(module, shards)] += 1
    for name, module in list(model.named_modules()):
        table = by_param.get((f"{name}.weight", None))
        if isinstance(module, VocabParallelEmbedding) and table is not None:
            kept[keep_table(module, table, model)] += 1
    kept.pop("float", None)
    if kept:
        log.info("GGUF weights kept quantized: %s",
                 ", ".join(f"{n} {what}" for what, n in kept.items()))
    return bool(kept)


def _keep_blocks(layer: LinearBase, shards: list[GGUFBlocks | None]) -> str:
    """GPU: the shards' blocks as stored where the kernels decode their types."""
    if all(b is None for b in shards):
        return "float"
    if all(b is not None and b.qtype in gpu_types() for b in shards):
        try:
            mine = [_rank_blocks(layer, s, b) for s, b in zip(_shard_ids(layer), shards)]
        except ValueError:  # a block straddles two ranks
            mine = None
        if mine is not None:
            GGUFBlocksLinearMethod().load(layer, mine)
            return "linear layers as stored"
    Int8WeightOnlyLinearMethod().quantize(layer)
    return "linear layers requantized to 8 bits per channel"


def _keep_cpu_blocks(layer: LinearBase, shards: list[GGUFBlocks | None]) -> str:
    """CPU, infer's block kernels: 4-bit layers as blocks of 32, the rest as `_keep_linear`."""
    if all(b is not None and b.qtype in INT4_TYPES for b in shards) and \
            layer.input_size % GROUP == 0:
        Q4BlocksLinearMethod().load(layer, *_int4_groups(layer, shards))
        return "linear layers in 4 bits as stored (x in int8)"
    return _keep_linear(layer, shards)


def _keep_cpu_table_blocks(table: VocabParallelEmbedding, blocks: GGUFBlocks,
                           model: nn.Module) -> str:
    if blocks.qtype == QType.Q8_0:
        blocks = _rank_rows(table, blocks)
        convert_table(table, model, lambda t: Q8BlocksTableMethod().load(t, blocks))
        return "embedding tables / LM heads in Q8_0 as stored (x in int8)"
    return _keep_table(table, blocks, model)


def _int4_groups(layer: LinearBase, shards: list[GGUFBlocks]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 4-bit `shards`' `(q, a, b)` (`int4_groups`), this rank's part of each, stacked."""
    parts = [_rank_int4_groups(layer, s, b) for s, b in zip(_shard_ids(layer), shards)]
    q, a, b = (torch.cat(p) for p in zip(*parts))
    return q, a, b


def _shard_ids(layer: LinearBase) -> tuple[ShardId, ...]:
    return layer.shard_ids or (None,)


def _rank_blocks(layer: LinearBase, shard_id: ShardId, blocks: GGUFBlocks) -> GGUFBlocks:
    """This rank's part of a shard's blocks (ValueError: it cuts a block)."""
    if layer.tp_size == 1:
        return blocks
    part = layer.rank_part(shard_id)
    return blocks.part(part.dim, part.start, part.size)


def _rank_int4_groups(layer: LinearBase, shard_id: ShardId, blocks: GGUFBlocks
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`int4_groups` of this rank's part of a shard (its columns a whole number of groups:
    `int4_packable`)."""
    try:
        return int4_groups(_rank_blocks(layer, shard_id, blocks))
    except ValueError:  # columns inside a Q4_K block: cut the groups instead
        part = layer.rank_part(shard_id)
        q, a, b = int4_groups(blocks)
        cols = slice(part.start, part.start + part.size)
        groups = slice(part.start // GROUP, (part.start + part.size) // GROUP)
        return q[:, cols].contiguous(), a[:, groups], b[:, groups]


def _keep_table_blocks(table: VocabParallelEmbedding, blocks: GGUFBlocks, model: nn.Module
                       ) -> str:
    if blocks.qtype in gpu_types():
        blocks = _rank_rows(table, blocks)
        convert_table(table, model, lambda t: GGUFBlocksLinearMethod().load(t, [blocks]))
        return "embedding tables / LM heads as stored"
    return _keep_table(table, blocks, model)


def _rank_rows(table: VocabParallelEmbedding, blocks: GGUFBlocks) -> GGUFBlocks:
    """A table's blocks for this rank: its rows of the vocabulary, padded."""
    if table.tp_size == 1:
        return blocks
    return blocks.part(0, table.vocab_start, table.weight.shape[0])


def _keep_table(table: VocabParallelEmbedding, blocks: GGUFBlocks, model: nn.Module) -> str:
    quantize_table(table, model)
    return "embedding tables / LM heads in 8 bits per row"


def _keep_linear(layer: LinearBase, shards: list[GGUFBlocks | None]) -> str:
    """CPU: `layer` given the method for its shards' stored types; what it became."""
    if all(b is None for b in shards):
        return "float"
    if all(b is not None and b.qtype in INT4_TYPES for b in shards) and \
            int4_packable(sum(layer.output_sizes), layer.input_size):
        Int4GroupLinearMethod().load(layer, *_int4_groups(layer, shards))
        return "linear layers in 4 bits as stored"
    Int8WeightOnlyLinearMethod().quantize(layer)
    return "linear layers requantized to 8 bits per channel"
