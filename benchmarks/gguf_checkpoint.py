"""Random-weight GGUF files in the benchmark shapes (benchmarks/configs/*.json), for the
speed of GGUF weights kept quantized: every weight a random run of valid blocks of its
type (the bytes are random; each block's fp16 scales are set small so the values stay
finite), written with the `gguf` package, with a plain `t0 .. t{V-1}` vocabulary.

Mixes (which type each tensor gets):
- `Q8_0`: every matrix Q8_0.
- `Q4_K_M`: llama.cpp's Q4_K_M choice for Llama models: Q4_K everywhere, except Q6_K for
  the output matrix and, in the first and last eighth of the layers and every third layer
  between, for attn_v and ffn_down.
Norms stay F32. A file is written once per checkpoint root and reused.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

MIXES = ("Q8_0", "Q4_K_M")
# byte offsets of the fp16 scale fields in a block, from ggml's block structs
_FP16_FIELDS = {"Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the layers Q4_K_M gives 6 bits in attn_v / ffn_down."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, mix: str, layers: int) -> str:
    if mix == "Q8_0":
        return "Q8_0"
    if name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        return "Q6_K" if _more_bits(layer, layers) else "Q4_K"
    return "Q4_K"


def _random_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    import gguf

    q = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.constants.GGML_QUANT_SIZES[q]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scale = np.full(len(blocks), 2e-3, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    for offset in _FP16_FIELDS[qtype]:
        blocks[:, offset:offset + 2] = scale
    return blocks.reshape(rows, cols // block * size)


def write_gguf(path: Path, shape: dict, mix: str, seed: int = 0) -> None:
    import gguf

    if shape.get("model_type") not in ("llama", None):
        raise SystemExit(f"GGUF benchmark files are written for Llama shapes only, not "
                         f"{shape.get('model_type')!r}")
    rng = np.random.default_rng(seed)
    layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    inter, vocab = shape["intermediate_size"], shape["vocab_size"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(shape.get("max_position_embeddings", 8192))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(shape.get("rms_norm_eps", 1e-5))
    w.add_rope_freq_base(float(shape.get("rope_theta", 500000.0)))
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([1] * vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    matrices = {"token_embd.weight": (vocab, hidden)}
    if not shape.get("tie_word_embeddings", False):
        matrices["output.weight"] = (vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        for name, rows_cols in (("attn_q", (heads * head_dim, hidden)),
                                ("attn_k", (kv_heads * head_dim, hidden)),
                                ("attn_v", (kv_heads * head_dim, hidden)),
                                ("attn_output", (hidden, heads * head_dim)),
                                ("ffn_gate", (inter, hidden)), ("ffn_up", (inter, hidden)),
                                ("ffn_down", (hidden, inter))):
            matrices[f"blk.{i}.{name}.weight"] = rows_cols
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, dtype=np.float32))
    for name, (rows, cols) in matrices.items():
        qtype = tensor_type(name, mix, layers)
        w.add_tensor(name, _random_blocks(rows, cols, qtype, rng),
                     raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def get_gguf(name: str, mix: str, tiny: bool, root_arg: str | None) -> Path:
    """The GGUF file of shape `name` in `mix`, written once per checkpoint root."""
    import common

    if mix not in MIXES:
        raise SystemExit(f"unknown GGUF mix {mix!r}; known: {', '.join(MIXES)}")
    shape = common.load_shape(name, tiny)
    if tiny:  # rows of whole 256-weight k-quant super-blocks
        shape.update(hidden_size=256, intermediate_size=512, head_dim=64)
    counts = common.shape_counts(shape)
    root = common.checkpoint_root(root_arg, counts.total_params)
    path = root / f"{name}{'-tiny' if tiny else ''}-{mix}.gguf"
    marker = path.with_suffix(".json")
    if path.exists() and marker.exists() and json.loads(marker.read_text()) == shape:
        print(f"[gguf] reusing {path}", flush=True)
        return path
    t = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    write_gguf(partial, shape, mix)
    partial.rename(path)
    marker.write_text(json.dumps(shape))
    print(f"[gguf] wrote {path.name}: {path.stat().st_size / 1e9:.2f} GB in "
          f"{time.perf_counter() - t:.1f} s", flush=True)
    return path
