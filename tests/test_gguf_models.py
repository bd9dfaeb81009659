"""GGUF loading: real files and synthetic ones vs transformers loading the same file.

transformers reads GGUF with its own metadata mapping and name map (built on gguf-py's
TensorNameMap), its own q/k un-permutation and Gemma norm offset, so matching its logits
checks our metadata parsing, renaming and layout end to end. Synthetic files are written
here the way llama.cpp's converter writes them (its q/k permutation, Gemma's 1 + w norms,
GPT-2's transposed Conv1D weights).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import reference_logits
from engine_fixtures import hf_model
from paged_runner import run_paged

from infer.loader import ModelLoadError, gguf_config, load_gguf
from infer.loader.gguf_file import open_gguf
from infer.models import ARCHITECTURES

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

pytestmark = pytest.mark.slow  # `pytest -m 'not slow'`: the quick inner loop skips it

needs_gemma3 = pytest.mark.skipif(
    "gemma3" not in ARCHITECTURES, reason="infer has no Gemma 3 model code yet"
)


def tf_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def random_batch(vocab: int, prompt_lens: list[int], decode: int, seed: int):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n + decode)] for n in prompt_lens], prompt_lens


def max_error(model, ref, seqs, prompt_lens, block_size=4) -> float:
    ours = run_paged(model, seqs, prompt_lens, block_size=block_size)
    refs = reference_logits(ref, seqs)
    return max(float((a - b).abs().max()) for a, b in zip(ours, refs))


# ---------------------------------------------------------------- real GGUF files


class _Real:
    """Our model and transformers' model from one real file, loaded once per class."""

    prompt_lens: tuple[int, ...]
    atol: float

    @pytest.fixture(scope="class")
    def loaded(self, request):
        path = request.cls.path()
        model, cfg = load_gguf(path)
        ref = hf_model(str(path))  # cached for the session: other tests use it too
        yield path, model, cfg, ref
        del model

    def test_config_matches_transformers(self, loaded):
        _, _, cfg, ref = loaded
        hf = ref.config
        assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
            hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
        assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
            hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
        assert cfg.norm_eps == pytest.approx(hf.rms_norm_eps)
        assert cfg.tie_word_embeddings == hf.tie_word_embeddings
        assert cfg.max_position_embeddings == hf.max_position_embeddings
        assert cfg.bos_token_id == hf.bos_token_id and cfg.eos_token_ids == (hf.eos_token_id,)

    def test_logits_match_transformers(self, loaded):
        _, model, cfg, ref = loaded
        seqs, prompt_lens = random_batch(cfg.vocab_size, list(self.prompt_lens), decode=4, seed=1)
        err = max_error(model, ref, seqs, prompt_lens, block_size=16)
        print(f"{type(self).__name__}: max |logit error| = {err:.3g}")
        assert err <= self.atol


class TestSmolLM2(_Real):
    prompt_lens = (5, 17, 40)
    atol = 2e-4  # measured 6e-5..8e-5 over 30 layers (logits of magnitude ~30)

    @staticmethod
    def path() -> Path:
        from real_models import smollm2_gguf

        return smollm2_gguf()

    def test_qk_unpermuted_like_transformers(self, loaded):
        _, model, cfg, ref = loaded
        hf = dict(ref.named_parameters())
        qkv = model.model.layers[7].self_attn.qkv_proj.weight
        assert torch.equal(qkv[:cfg.q_size], hf["model.layers.7.self_attn.q_proj.weight"])
        assert torch.equal(qkv[cfg.q_size:cfg.q_size + cfg.kv_size],
                           hf["model.layers.7.self_attn.k_proj.weight"])


@needs_gemma3
class TestGemma3(_Real):
    # All prompts are far shorter than the real sliding window (512 tokens), so every layer
    # attends to the whole prefix here; the synthetic Gemma 3 test uses a window of 8.
    prompt_lens = (3, 12, 40)
    atol = 1e-3  # measured 4e-4 over 18 layers

    @staticmethod
    def path() -> Path:
        from real_models import gemma3_gguf

        return gemma3_gguf()

    def test_gemma3_specifics(self, loaded):
        _, _, cfg, ref = loaded
        hf = ref.config
        assert cfg.layer_types == tuple(hf.layer_types)
        assert cfg.sliding_window == hf.sliding_window == 512
        assert cfg.query_pre_attn_scalar == hf.query_pre_attn_scalar
        assert cfg.rope.theta == hf.rope_parameters["full_attention"]["rope_theta"]
        assert cfg.rope_local.theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
        assert cfg.hidden_act == hf.hidden_activation


# ---------------------------------------------------------------- synthetic GGUF files

QUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
# The gguf package dequantises k-quants but cannot quantise them; their blocks are random
# bytes (every bit pattern is a valid block) with the fp16 super-block scales set so the
# values stay small. Byte offsets of those fp16 fields, from ggml's block structs:
KQUANT_FP16_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
                      Q.Q6_K: (208,)}


def random_kquant_blocks(n_values: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_values // block, size), dtype=np.uint8)

    def set_scales(value: float) -> None:
        for off in KQUANT_FP16_FIELDS[qtype]:
            scales = np.full(len(blocks), value, dtype=np.float16)
            blocks[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)

    set_scales(0.0)
    assert not gguf.dequantize(blocks, qtype).any(), "fp16 scale offsets are wrong"
    set_scales(1.0)
    peak = float(np.abs(gguf.dequantize(blocks, qtype)).max())
    set_scales(0.2 / peak)  # values are linear in the super-block scales
    return blocks


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k reordering: per head, rows (2, d/2) -> (d/2, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(path: Path, arch: str, hf_model, qtype: Q = Q.F32, seed: int = 0,
               extra_meta=None, extra_tensors=None) -> Path:
    """Convert a transformers model to GGUF the way llama.cpp does (1-D tensors stay F32)."""
    c = hf_model.config
    rng = np.random.default_rng(seed)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(getattr(c, "intermediate_size", None) or 4 * c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    if arch == "gpt2":
        w.add_layer_norm_eps(c.layer_norm_epsilon)
    else:
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_rope_freq_base(c.rope_parameters.get("rope_theta")
                             or c.rope_parameters["full_attention"]["rope_theta"])
        w.add_vocab_size(c.vocab_size)
        if arch in ("qwen3", "gemma3"):
            w.add_key_length(c.head_dim)
            w.add_value_length(c.head_dim)
        if arch == "gemma3":
            w.add_sliding_window(c.sliding_window)
    w.add_token_list([f"tok{i}" for i in range(c.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in (extra_meta or {}).items():  # (value, type) overrides, None drops
        if value is None:
            del w.kv_data[0][key]
        else:
            w.add_key_value(key, *value)
    for name, param in hf_model.named_parameters():
        base, suffix = name.rsplit(".", 1)
        gname = f"{names.get_name(base)}.{suffix}"
        data = param.detach().numpy().astype(np.float32)
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in gname else c.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        if arch == "gemma3" and gname.endswith("norm.weight"):
            data = data + 1.0
        if arch == "gpt2" and gname.endswith(("attn_qkv.weight", "attn_output.weight",
                                              "ffn_up.weight", "ffn_down.weight")):
            data = data.T.copy()
        if data.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gname, data)
        elif qtype == Q.F16:
            w.add_tensor(gname, data.astype(np.float16))
        elif qtype in QUANTIZABLE:
            w.add_tensor(gname, gguf.quantize(data, qtype), raw_dtype=qtype)
        else:
            blocks = random_kquant_blocks(data.size, qtype, rng)
            byte_shape = gguf.quant_shape_to_byte_shape(data.shape, qtype)
            w.add_tensor(gname, blocks.reshape(byte_shape), raw_dtype=qtype)
    for name, (data, raw_dtype) in (extra_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_hf_model(config):
    """transformers model with random weights, norm weights and biases perturbed so a
    wrong offset or a dropped bias shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


# Row lengths (hidden and intermediate sizes) are multiples of 256 for the k-quants.
def llama_config(layers: int = 2):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama_source():
    return random_hf_model(llama_config())


SYNTH_BATCH = dict(prompt_lens=[3, 9, 20], decode=4)
QTYPES = [*QUANTIZABLE, *KQUANT_FP16_FIELDS]


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_synthetic_llama_quant_types(tmp_path, llama_source, qtype):
    path = write_gguf(tmp_path / f"llama-{qtype.name}.gguf", "llama", llama_source, qtype)
    model, cfg = load_gguf(path)
    ref = tf_from_gguf(path)
    hf = dict(ref.named_parameters())
    # Same dequantised values as transformers for every tensor, q/k un-permuted alike.
    layer = model.model.layers[1]
    q, k, v = layer.self_attn.qkv_proj.weight.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
    for ours, name in ((q, "self_attn.q_proj"), (k, "self_attn.k_proj"),
                       (v, "self_attn.v_proj"), (layer.mlp.down_proj.weight, "mlp.down_proj")):
        assert torch.equal(ours, hf[f"model.layers.1.{name}.weight"]), name
    assert torch.equal(model.lm_head.weight, hf["lm_head.weight"])
    seqs, lens = random_batch(cfg.vocab_size, seed=2, **SYNTH_BATCH)
    err = max_error(model, ref, seqs, lens)
    print(f"llama {qtype.name}: max |logit error| = {err:.3g}")
    assert err <= 5e-5  # measured <= 8e-6


def test_synthetic_llama_f32_equals_source_weights(tmp_path, llama_source):
    """Un-permutation checked against the HF weights themselves, not another loader."""
    model, cfg = load_gguf(write_gguf(tmp_path / "llama.gguf", "llama", llama_source))
    src = dict(llama_source.named_parameters())
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv, torch.cat([src[f"model.layers.0.self_attn.{p}_proj.weight"]
                                       for p in "qkv"]))
    assert not cfg.tie_word_embeddings and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


def test_synthetic_llama_q8_0_close_to_source(tmp_path, llama_source):
    model, cfg = load_gguf(write_gguf(tmp_path / "llama.gguf", "llama", llama_source, Q.Q8_0))
    src = dict(llama_source.named_parameters())
    q = model.model.layers[0].self_attn.qkv_proj.weight[:cfg.q_size]
    want = src["model.layers.0.self_attn.q_proj.weight"]
    assert (q - want).abs().max() <= want.abs().max() / 127  # half a step of the worst block


def _qwen_case(arch: str):
    from transformers import Qwen2Config, Qwen3Config

    if arch == "qwen2":  # q/k/v biases, tied embeddings
        return Qwen2Config(vocab_size=320, hidden_size=256, intermediate_size=512,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=128, tie_word_embeddings=True)
    # transformers' GGUF mapping ignores key_length for qwen3, so head_dim must be its
    # default (128).
    return Qwen3Config(vocab_size=320, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=128, max_position_embeddings=128, tie_word_embeddings=False)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_K], ids=lambda q: q.name)
def test_synthetic_qwen_not_permuted(tmp_path, arch, qtype):
    source = random_hf_model(_qwen_case(arch))
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, source, qtype)
    model, cfg = load_gguf(path)
    assert cfg.architecture == arch and cfg.qk_norm == (arch == "qwen3")
    assert cfg.attention_bias == (arch == "qwen2")
    ref = tf_from_gguf(path)
    if qtype == Q.F32:  # q/k rows exactly as in the source: nothing was permuted
        src = dict(source.named_parameters())
        qkv = model.model.layers[1].self_attn.qkv_proj.weight
        assert torch.equal(qkv[:cfg.q_size], src["model.layers.1.self_attn.q_proj.weight"])
    seqs, lens = random_batch(cfg.vocab_size, seed=3, **SYNTH_BATCH)
    err = max_error(model, ref, seqs, lens)
    print(f"{arch} {qtype.name}: max |logit error| = {err:.3g}")
    assert err <= 5e-5  # measured <= 8e-6


def test_synthetic_gpt2(tmp_path):
    from transformers import GPT2Config

    # transformers maps GGUF context_length to n_ctx only, leaving n_positions at its
    # default, so the position table must have GPT-2's 1024 rows to load there.
    source = random_hf_model(GPT2Config(vocab_size=320, n_positions=1024, n_embd=64, n_layer=2,
                                        n_head=4))
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", source, Q.Q8_0)
    model, cfg = load_gguf(path)
    assert cfg.architecture == "gpt2" and cfg.tie_word_embeddings
    seqs, lens = random_batch(cfg.vocab_size, seed=4, **SYNTH_BATCH)
    err = max_error(model, tf_from_gguf(path), seqs, lens)
    print(f"gpt2 Q8_0: max |logit error| = {err:.3g}")
    assert err <= 5e-5  # measured <= 8e-6


@needs_gemma3
def test_synthetic_gemma3(tmp_path):
    from transformers import Gemma3TextConfig

    # head_dim 256 = transformers' default query_pre_attn_scalar, which its GGUF loader
    # keeps (llama.cpp scales by head_dim); 6 layers = 5 sliding + 1 global.
    config = Gemma3TextConfig(vocab_size=320, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=256, max_position_embeddings=128, sliding_window=8)
    source = random_hf_model(config)
    path = write_gguf(tmp_path / "gemma3.gguf", "gemma3", source, Q.Q8_0)
    model, cfg = load_gguf(path)
    assert cfg.layer_types == tuple(config.layer_types) and cfg.sliding_window == 8
    seqs, lens = random_batch(cfg.vocab_size, seed=5, **SYNTH_BATCH)
    err = max_error(model, tf_from_gguf(path), seqs, lens)
    print(f"gemma3 Q8_0: max |logit error| = {err:.3g}")
    assert err <= 5e-5  # measured <= 8e-6


def test_llama3_rope_freqs(tmp_path, llama_source):
    """Llama 3.1 scaling arrives as a `rope_freqs` tensor (llama.cpp's converter formula)."""
    theta, factor, low, high, old = 500000.0, 8.0, 1.0, 4.0, 8192
    head_dim = 64
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    divisors = np.where(wavelen < old / high, 1.0,
                        np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    meta = {"llama.rope.freq_base": (theta, gguf.GGUFValueType.FLOAT32)}
    path = write_gguf(tmp_path / "l3.gguf", "llama", llama_source, extra_meta=meta,
                      extra_tensors={"rope_freqs.weight": (divisors.astype(np.float32), None)})
    _, cfg = load_gguf(path)  # rope_freqs is consumed by the config, not the weights
    assert (cfg.rope.kind, cfg.rope.factor, cfg.rope.theta) == ("llama3", factor, theta)
    assert (cfg.rope.low_freq_factor, cfg.rope.high_freq_factor) == (low, high)
    assert cfg.rope.original_max_position_embeddings == old

    bad = write_gguf(tmp_path / "bad.gguf", "llama", llama_source, extra_tensors={
        "rope_freqs.weight": (np.linspace(1, 3, head_dim // 2, dtype=np.float32), None)})
    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*rope_freqs"):
        load_gguf(bad)


# ---------------------------------------------------------------- broken files


def test_truncated_real_file(tmp_path):
    from real_models import smollm2_gguf

    data = smollm2_gguf().read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: not a valid GGUF file"):
        load_gguf(path)


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf file at all" * 20])
def test_not_gguf(tmp_path, content):
    path = tmp_path / "junk.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=r"junk\.gguf: not a valid GGUF file"):
        load_gguf(path)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match=r"nope\.gguf: file not found"):
        load_gguf(tmp_path / "nope.gguf")


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"mamba\.gguf: unsupported architecture 'mamba'"):
        load_gguf(path)


def test_unsupported_quant_type(tmp_path, llama_source):
    size = GGML_QUANT_SIZES[Q.Q8_K][1]
    path = write_gguf(tmp_path / "q8k.gguf", "llama", llama_source, extra_tensors={
        "blk.0.extra.weight": (np.zeros((2, size), dtype=np.uint8), Q.Q8_K)})
    with pytest.raises(ModelLoadError, match=r"q8k\.gguf: unsupported quantization type Q8_K"):
        load_gguf(path)


def test_missing_metadata(tmp_path, llama_source):
    path = write_gguf(tmp_path / "nokey.gguf", "llama", llama_source,
                      extra_meta={"llama.embedding_length": None})
    with pytest.raises(ModelLoadError, match=r"nokey\.gguf: GGUF metadata lacks "
                                             r"'llama\.embedding_length'"):
        load_gguf(path)
    path = write_gguf(tmp_path / "badkey.gguf", "llama", llama_source, extra_meta={
        "llama.embedding_length": ("wide", gguf.GGUFValueType.STRING)})
    with pytest.raises(ModelLoadError, match=r"badkey\.gguf: invalid GGUF metadata"):
        load_gguf(path)


def test_metadata_that_contradicts_the_tensors(tmp_path, llama_source):
    path = write_gguf(tmp_path / "odd.gguf", "llama", llama_source, extra_meta={
        "llama.feed_forward_length": (999, gguf.GGUFValueType.UINT32)})
    with pytest.raises(ModelLoadError,
                       match=r"odd\.gguf: tensor .*gate_proj.* expects \(999, 256\)"):
        load_gguf(path)
    assert gguf_config(open_gguf(path)).intermediate_size == 999
