"""Checkpoints stored quantized, written here in each published layout (they cannot be
downloaded): HF's fine-grained FP8 (Qwen3-*-FP8: `weight` F8_E4M3 and
`weight_scale_inv [ceil(out / 128), ceil(in / 128)]`, BF16 or F32), compressed-tensors FP8
(per channel `weight_scale [out, 1]` BF16, per tensor `[1]` F32, per 128x128 block) and
compressed-tensors W8A8 INT8 (`weight` I8, `weight_scale [out, 1]` BF16), each with the
`quantization_config` its producer writes. The test quantizes a transformers model itself
(numpy-free float64 arithmetic), and checks: every layer holds exactly the values the
checkpoint stands for; the logits against transformers on those values; bad checkpoints
refused by name before the model is built."""

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoints import reference_logits, save_random_checkpoint, save_word_tokenizer
from paged_runner import run_paged
from safetensors.torch import save_file

from infer.loader import ModelLoadError, load_hf_dir
from infer.loader import model_loader as model_loader_module
from infer.models.linear import LinearBase
from infer.quantization import quantize_model

transformers = pytest.importorskip("transformers")

FP8 = torch.float8_e4m3fn
HF_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}


def _compressed_tensors(kind: str, strategy: str, **weights) -> dict:
    """A `quantization_config` as llm-compressor writes it: one group over Linear layers,
    8-bit symmetric static weights, dynamic 8-bit activations per token (per group of 128
    for blocks), the LM head left out."""
    acts = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": True,
            "strategy": "group" if strategy == "block" else "token"}
    if strategy == "block":
        acts["group_size"] = 128
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized" if kind == "float" else "int-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": False,
                        "strategy": strategy, "observer": "minmax", **weights},
            "input_activations": acts, "output_activations": None}},
    }


# name -> (config, scale tensor name, how scales are computed, scale dtype, our format)
LAYOUTS = {
    "hf-fp8-block-bf16": (HF_BLOCK, "weight_scale_inv", "block", torch.bfloat16, "fp8-block"),
    "hf-fp8-block-f32": (HF_BLOCK, "weight_scale_inv", "block", torch.float32, "fp8-block"),
    "ct-fp8-channel": (_compressed_tensors("float", "channel"), "weight_scale", "channel",
                       torch.bfloat16, "fp8"),
    "ct-fp8-tensor": (_compressed_tensors("float", "tensor"), "weight_scale", "tensor",
                      torch.float32, "fp8"),
    "ct-fp8-block": (_compressed_tensors("float", "block", block_structure=[128, 128]),
                     "weight_scale", "block", torch.bfloat16, "fp8-block"),
    "ct-w8a8-int8": (_compressed_tensors("int", "channel"), "weight_scale", "int8",
                     torch.bfloat16, "w8a8-int8"),
}
# Logits against transformers on the values the checkpoint stands for, relative to their
# largest magnitude, on the CPU (measured: 6.9e-2, 1.6e-2, 5.7e-7): FP8 per channel or
# tensor runs W8A8 (activations in FP8 per token: 3 mantissa bits), INT8 W8A8
# (activations in INT8 per token), block-wise FP8 multiplies by the dequantized weight.
# Against the float model the checkpoint was made from: 7-9.5 %, of which 7 % is the
# weights' own rounding to FP8 on these tiny random models.
LOGIT_ERROR = {"fp8": 0.1, "w8a8-int8": 0.03, "fp8-block": 1e-5}
FROM_FLOAT_ERROR = 0.15
VOCAB = 320
# `INFER_TEST_DEVICE=cuda`: the models load and run on the GPU (decode-sized steps through
# the W8A16 kernel, larger ones through the FP8 / INT8 GEMMs)
DEVICE = os.environ.get("INFER_TEST_DEVICE", "cpu")


def _config(qwen3: bool):
    from transformers import LlamaConfig, Qwen3Config

    # Sizes in whole 128-row tiles for the block layouts (q 256, k and v 128 rows).
    shape = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=128, tie_word_embeddings=False)
    return Qwen3Config(**shape, head_dim=64) if qwen3 else LlamaConfig(**shape)


def _quantize(w: torch.Tensor, how: str, scale_dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(stored weight, stored scale, the float32 weight they stand for)."""
    w = w.double()
    out, cols = w.shape
    if how == "block":
        tiles = torch.zeros(-(-out // 128), -(-cols // 128), dtype=torch.float64)
        for i in range(tiles.shape[0]):
            for j in range(tiles.shape[1]):
                tiles[i, j] = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max() / 448
        scale = tiles.to(scale_dtype)
        per_weight = scale.double().repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)
        per_weight = per_weight[:, :cols]
    else:
        top = 127 if how == "int8" else 448
        if how == "tensor":
            scale = (w.abs().max() / top).reshape(1).to(scale_dtype)
            per_weight = scale.double().expand(out, cols)
        else:
            scale = (w.abs().amax(dim=1, keepdim=True) / top).to(scale_dtype)
            per_weight = scale.double().expand(out, cols)
    if how == "int8":
        q = torch.round(w / per_weight).clamp(-127, 127).to(torch.int8)
    else:
        q = (w / per_weight).clamp(-448, 448).to(FP8)
    return q, scale, (q.double() * per_weight).float()


def write_quantized(tmp_path, layout: str, qwen3: bool = True, config=None):
    """The checkpoint in `layout` (of `config`, by default this file's shape); returns
    (reference transformers model holding the values it stands for, the original float
    model's logits function, our format name)."""
    qconfig, scale_name, how, scale_dtype, fmt = LAYOUTS[layout]
    model = save_random_checkpoint(config or _config(qwen3), tmp_path)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    tensors = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.weight"):
                q, scale, values = _quantize(param, how, scale_dtype)
                tensors[name] = q
                tensors[name.removesuffix("weight") + scale_name] = scale
                param.copy_(values)
            else:  # bfloat16, as the published checkpoints keep them
                tensors[name] = param.to(torch.bfloat16)
                param.copy_(tensors[name].float())
    for old in tmp_path.glob("*.safetensors"):
        old.unlink()
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = qconfig
    (tmp_path / "config.json").write_text(json.dumps(config))
    return model, original, fmt


def _ours(layer_name: str, reference) -> torch.Tensor:
    """The weight our fused layer `layer_name` holds, from the reference's projections."""
    params = dict(reference.named_parameters())
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    leaf = layer_name.rpartition(".")[2]
    names = [layer_name.replace(leaf, p) for p in parts.get(leaf, (leaf,))]
    return torch.cat([params[f"{n}.weight"] for n in names])


def _sequences() -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(3)
    lens = [2, 9, 17]
    return [torch.randint(VOCAB, (n + 4,), generator=gen).tolist() for n in lens], lens


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((g - w).abs().max().item() / w.abs().max().item() for g, w in zip(got, want))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_quantized_checkpoint_loads_as_stored(tmp_path, layout):
    reference, original, fmt = write_quantized(tmp_path, layout)
    model, _ = load_hf_dir(tmp_path, device=DEVICE)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    stored = torch.int8 if fmt == "w8a8-int8" else FP8
    for name, layer in linears.items():
        assert layer.quant_method.format == fmt and layer.weight.dtype == stored, name
        assert torch.equal(layer.quant_method.dequantize(layer).cpu(),
                           _ours(name, reference)), name
    assert quantize_model(model, "auto") == fmt
    seqs, lens = _sequences()
    got = [g.cpu() for g in run_paged(model, seqs, lens)]
    error = _relative_error(got, reference_logits(reference, seqs))
    assert error < LOGIT_ERROR[fmt], error
    unquantized = transformers.AutoModelForCausalLM.from_config(reference.config)
    unquantized.load_state_dict(original)
    error = _relative_error(got, reference_logits(unquantized.eval(), seqs))
    assert error < FROM_FLOAT_ERROR, error


@pytest.mark.parametrize("layout", ["hf-fp8-block-bf16", "ct-fp8-channel", "ct-w8a8-int8"])
def test_quantization_none_dequantizes_a_quantized_checkpoint(tmp_path, layout):
    reference, _, fmt = write_quantized(tmp_path, layout, qwen3=False)
    model, _ = load_hf_dir(tmp_path)
    with pytest.raises(ValueError, match=f"stored in {fmt} already"):
        quantize_model(model, "int8" if fmt != "w8a8-int8" else "fp8")
    assert quantize_model(model, "none") == "none"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    seqs, lens = _sequences()
    for got, want in zip(run_paged(model, seqs, lens), reference_logits(reference, seqs)):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_an_fp8_checkpoint_serves_through_the_llm(tmp_path):
    """The default `quantization="auto"` keeps the checkpoint's FP8; greedy text equals
    transformers' on the values it stands for."""
    from infer import LLM, SamplingParams

    reference, _, _ = write_quantized(tmp_path, "hf-fp8-block-f32")
    save_word_tokenizer(tmp_path, VOCAB)
    llm = LLM(str(tmp_path), device="cpu", max_model_len=64, max_num_seqs=4)
    assert llm.engine.core.quantization == "fp8-block"
    prompts = [[5, 17, 200, 3], [250, 1, 30, 31, 32, 9]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                  min_new_tokens=6)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == want


def _rewrite_config(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _rewrite_tensor(path, name: str, tensor: torch.Tensor | None) -> None:
    from safetensors.torch import load_file

    tensors = load_file(path / "model.safetensors")
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, path / "model.safetensors")


Q_SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"
BAD = {
    "unknown quant_method": (lambda p: _rewrite_config(p, quant_method="awq"), "'awq'"),
    "e5m2": (lambda p: _rewrite_config(p, fmt="e5m2"), "e5m2"),
    "static activations": (lambda p: _rewrite_config(p, activation_scheme="static"),
                           "activation_scheme 'static'"),
    "bad block size": (lambda p: _rewrite_config(p, weight_block_size=[128]),
                       "weight_block_size"),
    "scale of the wrong shape": (
        lambda p: _rewrite_tensor(p, Q_SCALE, torch.ones(1, 2)), Q_SCALE),
    "scale that is not float": (
        lambda p: _rewrite_tensor(p, Q_SCALE, torch.ones(2, 2, dtype=torch.int8)), Q_SCALE),
    "weight without its scale": (lambda p: _rewrite_tensor(p, Q_SCALE, None),
                                 "q_proj.weight"),
    "static input scale": (
        lambda p: _rewrite_tensor(p, "model.layers.0.mlp.up_proj.input_scale",
                                  torch.ones(1)), "up_proj.input_scale"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_quantized_checkpoint_is_refused_before_the_model_is_built(
        tmp_path, monkeypatch, case):
    write_quantized(tmp_path, "hf-fp8-block-bf16")
    spoil, named = BAD[case]
    spoil(tmp_path)

    def build_model(*args, **kwargs):
        raise AssertionError("the model was built before the checkpoint was checked")

    monkeypatch.setattr(model_loader_module, "build_model", build_model)
    with pytest.raises(ModelLoadError, match=named.replace("[", r"\[").replace(".", r"\.")):
        load_hf_dir(tmp_path)


def test_a_linear_layer_stored_in_float_is_refused_by_name(tmp_path):
    """A layer the config would leave unquantized (a `modules_to_not_convert` entry that is
    a linear layer here) is not supported: refused, never copied into an FP8 weight."""
    write_quantized(tmp_path, "ct-fp8-channel", qwen3=False)
    name = "model.layers.1.mlp.down_proj"
    _rewrite_tensor(tmp_path, f"{name}.weight_scale", None)
    _rewrite_tensor(tmp_path, f"{name}.weight", torch.randn(256, 512).to(torch.bfloat16))
    with pytest.raises(ModelLoadError, match=rf"{name}\.weight.*stored as bfloat16"):
        load_hf_dir(tmp_path)
