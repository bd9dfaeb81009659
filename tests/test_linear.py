"""Linear layers' weight loaders (fused shards, tensor-parallel slices, shape errors), the
quant-method hook, and the architecture registry as the single source of architectures."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from infer.distributed.group import TensorParallelGroup
from infer.models import (
    ARCHITECTURES,
    MODEL_TYPES,
    REGISTRY,
    config_from_hf,
    gemma3,
    gpt2,
    llama,
    model_class,
)
from infer.models.linear import (
    ColumnParallelLinear,
    LinearMethod,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from infer.models.weights import WeightError, load_weights


def rows(n: int, cols: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(start, start + n * cols).reshape(n, cols)


# ---------------------------------------------------------------- shards


def test_qkv_shards_land_in_their_rows():
    # hidden 2, head_dim 2, 2 query heads, 1 kv head: rows 0-3 q, 4-5 k, 6-7 v.
    layer = QKVParallelLinear(2, head_dim=2, num_heads=2, num_kv_heads=1, bias=True)
    assert layer.output_sizes == [4, 2, 2] and layer.weight.shape == (8, 2)
    q, k, v = rows(4, 2, 100), rows(2, 2, 200), rows(2, 2, 300)
    for shard, tensor in (("v", v), ("q", q), ("k", k)):  # any order
        layer.weight_loader(layer.weight, tensor, shard)
        layer.weight_loader(layer.bias, tensor[:, 0], shard)
    assert layer.weight.tolist() == [
        [100, 101], [102, 103], [104, 105], [106, 107],
        [200, 201], [202, 203],
        [300, 301], [302, 303],
    ]
    assert layer.bias.tolist() == [100, 102, 104, 106, 200, 202, 300, 302]
    assert layer.weight.shard_ids == layer.bias.shard_ids == ("q", "k", "v")


def test_qkv_fused_checkpoint_tensor_is_split_into_shards():
    """GPT-2's c_attn stores q, k and v already fused: loading it whole (shard None) goes
    through the same per-shard placement."""
    layer = QKVParallelLinear(2, head_dim=1, num_heads=2, num_kv_heads=2)
    fused = rows(6, 2)
    layer.weight_loader(layer.weight, fused, None)
    assert torch.equal(layer.weight, fused)


def test_merged_gate_up_shards_land_in_their_rows():
    layer = MergedColumnParallelLinear(3, [2, 2])
    layer.weight_loader(layer.weight, rows(2, 3, 10), 1)  # up
    layer.weight_loader(layer.weight, rows(2, 3, 0), 0)  # gate
    assert layer.weight.tolist() == [[0, 1, 2], [3, 4, 5], [10, 11, 12], [13, 14, 15]]
    assert layer.weight.shard_ids == (0, 1)


def test_unknown_shard_is_refused():
    layer = MergedColumnParallelLinear(3, [2, 2])
    with pytest.raises(WeightError, match="no shard 'q'"):
        layer.weight_loader(layer.weight, rows(2, 3), "q")


# ---------------------------------------------------------------- shape errors


def test_shape_mismatch_names_the_tensor():
    model = nn.Module()
    model.qkv = QKVParallelLinear(4, head_dim=2, num_heads=2, num_kv_heads=1)

    def param_for(name: str):
        return "qkv.weight", name.split(".")[1][0]

    with pytest.raises(WeightError) as info:
        load_weights(model, [("attn.k_proj.weight", torch.zeros(3, 4))], param_for, "ckpt")
    message = str(info.value)
    assert "ckpt: tensor 'attn.k_proj.weight'" in message
    assert "has shape (3, 4), the model expects (2, 4)" in message


def test_direct_loader_shape_mismatch_raises_weight_error():
    layer = RowParallelLinear(4, 3)
    with pytest.raises(WeightError, match=r"\(3, 5\).*\(3, 4\)"):
        layer.weight_loader(layer.weight, torch.zeros(3, 5))


def test_missing_shard_and_unexpected_tensor():
    model = nn.Module()
    model.mlp = MergedColumnParallelLinear(2, [1, 1])
    with pytest.raises(WeightError, match=r"missing weights for 1 parameters: mlp\.weight"):
        load_weights(model, [("gate", torch.ones(1, 2))], lambda n: ("mlp.weight", 0))
    with pytest.raises(WeightError, match=r"unexpected tensor 'x' \(no parameter 'nope'\)"):
        load_weights(model, [("x", torch.ones(1))], lambda n: ("nope", None))


# ---------------------------------------------------------------- tensor parallel slices


def _ranks(make, tp_size: int = 2):
    return [make(tp=TensorParallelGroup(r, tp_size)) for r in range(tp_size)]


def test_column_parallel_ranks_hold_output_slices():
    weight, bias, x = torch.randn(6, 4), torch.randn(6), torch.randn(5, 4)
    ranks = _ranks(lambda **tp: ColumnParallelLinear(4, 6, bias=True, **tp))
    for layer in ranks:
        layer.weight_loader(layer.weight, weight)
        layer.weight_loader(layer.bias, bias)
        assert layer.weight.shape == (3, 4) and layer.tp_size == 2
    assert torch.equal(torch.cat([r.weight for r in ranks]), weight)
    assert torch.equal(torch.cat([r.bias for r in ranks]), bias)
    out = torch.cat([r(x) for r in ranks], dim=-1)
    torch.testing.assert_close(out, F.linear(x, weight, bias))


def test_row_parallel_ranks_hold_input_slices():
    weight, bias, x = torch.randn(3, 8), torch.randn(3), torch.randn(5, 8)
    ranks = _ranks(lambda **tp: RowParallelLinear(8, 3, bias=True, **tp))
    for layer in ranks:
        layer.weight_loader(layer.weight, weight)
        layer.weight_loader(layer.bias, bias)
        assert torch.equal(layer.bias, bias)  # not split: added once, after the reduce
    assert torch.equal(torch.cat([r.weight for r in ranks], dim=1), weight)
    # What the all-reduce will sum: each rank's slice of x times its columns.
    partial = [r.quant_method.apply(r, xs, None) for r, xs in zip(ranks, x.chunk(2, dim=-1))]
    torch.testing.assert_close(sum(partial) + bias, F.linear(x, weight, bias))


def test_qkv_and_merged_ranks_hold_their_heads_of_each_shard():
    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    ranks = _ranks(lambda **tp: QKVParallelLinear(3, 1, num_heads=4, num_kv_heads=2, **tp))
    for layer in ranks:
        for shard, tensor in zip("qkv", (q, k, v)):
            layer.weight_loader(layer.weight, tensor, shard)
        assert layer.output_sizes == [2, 1, 1] and layer.num_heads == 2
    splits = [r.weight.split(r.output_sizes) for r in ranks]
    for i, full in enumerate((q, k, v)):
        assert torch.equal(torch.cat([s[i] for s in splits]), full)

    gate, up = torch.randn(4, 3), torch.randn(4, 3)
    ranks = _ranks(lambda **tp: MergedColumnParallelLinear(3, [4, 4], **tp))
    for layer in ranks:
        layer.weight_loader(layer.weight, up, 1)
        layer.weight_loader(layer.weight, gate, 0)
    assert torch.equal(torch.cat([r.weight[:2] for r in ranks]), gate)
    assert torch.equal(torch.cat([r.weight[2:] for r in ranks]), up)


def test_rank_part_names_the_slice_each_rank_loads():
    """What formats with a layout of their own (GGUF blocks, FP8 tiles) cut by: the same
    rows and columns as the loaders copy."""
    q, k = torch.randn(8, 6), torch.randn(2, 6)
    for rank, layer in enumerate(_ranks(
            lambda **tp: QKVParallelLinear(6, 2, num_heads=4, num_kv_heads=1, **tp))):
        # q split over the two ranks, the single KV head replicated on both
        assert layer.rank_part("q") == (0, rank, 2, 4) and layer.rank_part("q").start == 4 * rank
        assert layer.rank_part("k") == (0, 0, 1, 2)
        layer.weight_loader(layer.weight, q, "q")
        layer.weight_loader(layer.weight, k, "k")
        part = layer.rank_part("q")
        assert torch.equal(layer.weight[:4], q.narrow(part.dim, part.start, part.size))
        assert torch.equal(layer.weight[4:6], k)
        with pytest.raises(WeightError, match="one slice per shard"):
            layer.rank_part(None)
    w = torch.randn(3, 8)
    for rank, layer in enumerate(_ranks(lambda **tp: RowParallelLinear(8, 3, **tp))):
        part = layer.rank_part()
        assert part == (1, rank, 2, 4)
        layer.weight_loader(layer.weight, w)
        assert torch.equal(layer.weight, w.narrow(part.dim, part.start, part.size))


def test_vocab_parallel_embedding_ranks_hold_row_slices():
    table = torch.randn(10, 3)
    ranks = _ranks(lambda **tp: VocabParallelEmbedding(10, 3, **tp))
    for layer in ranks:
        layer.weight_loader(layer.weight, table)
    assert torch.equal(torch.cat([r.weight for r in ranks]), table)


def test_tied_lm_head_shares_the_embedding_parameter():
    embed = VocabParallelEmbedding(10, 3)
    head = ParallelLMHead(10, 3, tied=embed)
    model = nn.Sequential(embed, head)
    assert head.weight is embed.weight
    assert [name for name, _ in model.named_parameters()] == ["0.weight"]
    embed.weight_loader(embed.weight, torch.eye(10, 3))
    assert torch.equal(head(torch.eye(1, 3)), torch.eye(10, 3)[:, 0][None])


# ---------------------------------------------------------------- quant method hook


class RecordingMethod(LinearMethod):
    """Stores its weight as `packed` (no `weight` at all) and answers a known value."""

    def __init__(self) -> None:
        self.calls: list[tuple[nn.Module, torch.Tensor, torch.Tensor | None]] = []

    def create_weights(self, layer, input_size, output_sizes, weight_loader):
        packed = nn.Parameter(torch.zeros(sum(output_sizes), input_size, dtype=torch.int8),
                              requires_grad=False)
        packed.weight_loader, packed.output_dim, packed.input_dim = weight_loader, 0, 1
        layer.register_parameter("packed", packed)

    def apply(self, layer, x, bias):
        self.calls.append((layer, x, bias))
        return torch.full((x.shape[0], sum(layer.output_sizes)), 7.0)


def test_quant_method_creates_the_parameters_and_runs_the_matmul():
    method = RecordingMethod()
    layer = MergedColumnParallelLinear(3, [2, 2], bias=True, quant_method=method)
    assert not hasattr(layer, "weight")
    assert {name for name, _ in layer.named_parameters()} == {"packed", "bias"}
    assert layer.packed.shard_ids == (0, 1)
    layer.weight_loader(layer.packed, torch.ones(2, 3, dtype=torch.int8), 1)
    assert layer.packed[2:].tolist() == [[1, 1, 1]] * 2 and not layer.packed[:2].any()
    x = torch.randn(5, 3)
    out = layer(x)
    assert torch.equal(out, torch.full((5, 4), 7.0))
    assert len(method.calls) == 1
    got_layer, got_x, got_bias = method.calls[0]
    assert got_layer is layer and got_x is x and got_bias is layer.bias


# ---------------------------------------------------------------- the registry


ALL_ENTRIES = (*llama.ENTRIES, gemma3.ENTRY, gpt2.ENTRY)

DECODER = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
               num_attention_heads=2)


def _minimal_config(model_type: str) -> dict:
    if model_type == "gpt2":
        return dict(model_type="gpt2", vocab_size=32, n_embd=16, n_head=2, n_layer=2)
    if model_type == "gemma3":  # the multimodal config: text tower nested
        return dict(model_type="gemma3", text_config=dict(DECODER, model_type="gemma3_text"))
    return dict(DECODER, model_type=model_type)


def test_every_architecture_has_exactly_one_entry():
    names = [e.name for e in ALL_ENTRIES]
    assert len(names) == len(set(names)) == len(REGISTRY)
    assert set(ARCHITECTURES) == set(REGISTRY)


def test_every_model_type_maps_to_one_entry():
    types = [t for e in ALL_ENTRIES for t in e.model_types]
    assert len(types) == len(set(types)) == len(MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_config_hook_names_its_own_entry(model_type):
    entry = MODEL_TYPES[model_type]
    cfg = config_from_hf(_minimal_config(model_type))
    assert cfg.architecture == entry.name
    assert REGISTRY[cfg.architecture] is entry and model_class(cfg) is entry.model


def test_config_module_knows_no_architecture_and_no_torch():
    import infer.config

    assert not {"SUPPORTED_ARCHITECTURES", "_MODEL_TYPES"} & set(vars(infer.config))
    code = "import sys, infer.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text", "gpt2"])
def test_every_projection_and_embedding_loads_itself(model_type):
    cfg = config_from_hf(_minimal_config(model_type))
    model = model_class(cfg)(cfg)
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            for param in module.parameters(recurse=False):
                assert callable(param.weight_loader)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
