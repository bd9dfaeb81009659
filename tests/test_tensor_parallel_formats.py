"""Tensor parallelism and weight formats: a model loaded and converted on each of 2 ranks
(a gloo world of CPU processes) as the engine does it (`method_made_at_load`, the loader,
then `quantize_model` with the GGUF file's blocks, inside `tensor_parallel`) gives the
logits of the same format on one rank: GGUF dequantized and kept quantized (4-bit groups,
INT8 requantized, the GPU's blocks through the Triton interpreter), INT8 and FP8 made at
load, INT4 too, and the checkpoint layouts stored quantized. What cannot be cut is refused by name.

One world runs every case (a spawn costs more than a case); a case that fails returns its
traceback, so it fails only its own test.
"""

from __future__ import annotations

import random
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from paged_runner import run_paged
from tp_ranks import run_ranks

from infer.kernels import cpu_extension

pytest.importorskip("transformers")
pytest.importorskip("gguf")

TP = 2


class Case(NamedTuple):
    source: str  # a checkpoint made by `_write`
    quantization: str
    format: str  # what quantize_model says
    tolerance: float  # of |TP logits - one rank's|, relative to the largest logit
    blocks: bool = False  # the GPU's way: the file's blocks (`keep_gguf_quantized`)
    int8x: bool | None = None  # `cpu_int8_activations` (None: this CPU's default)


# |TP logits - one rank's| / the largest logit, measured on the CPU: exact formats 7e-7;
# 16-bit activations (INT8, INT4: their matmuls return bfloat16, so each rank's partial
# sum is rounded apart from the whole one) 3e-3..1e-2; FP8 and W8A8 INT8 quantize each
# rank's slice of the activations per token on its own, not the whole row: 1.4e-2 (INT8),
# 4-6e-2 (FP8, 3 mantissa bits; the same layouts dequantized are exact, below).
EXACT, A16, A8 = 1e-5, 3e-2, 1e-1
CASES = {
    "gguf-q4_0-none": Case("llama-Q4_0.gguf", "none", "none", EXACT),
    "gguf-q4_0-int4": Case("llama-Q4_0.gguf", "auto", "gguf", A16),
    # o_proj's 128 input columns a rank cut a Q4_K block of 256: cut as groups of 32
    "gguf-q4_k-int4": Case("llama-Q4_K.gguf", "auto", "gguf", A16),
    "gguf-q8_0-int8": Case("llama-Q8_0.gguf", "gguf", "gguf", A16),
    # infer's CPU block kernels: 4-bit layers, a Q8_0 table (an odd vocabulary: padded rows)
    "gguf-q4_0-int8x": Case("llama-Q4_0.gguf", "auto", "gguf", A16, int8x=True),
    "gguf-q8_0-int8x": Case("llama-Q8_0.gguf", "auto", "gguf", A16, int8x=True),
    "gguf-qwen2-q4_0-int4": Case("qwen2-Q4_0.gguf", "auto", "gguf", A16),
    "gguf-gpt2-q8_0": Case("gpt2-Q8_0.gguf", "auto", "gguf", A16),
    # o_proj requantized to INT8 on the ranks (below)
    "gguf-q4_k-blocks": Case("llama-Q4_K.gguf", "gguf", "gguf", A16, blocks=True),
    "int8-at-load": Case("llama", "int8", "int8", A16),
    "int4-at-load": Case("llama", "int4", "int4", A16),
    "fp8-at-load": Case("qwen3-kv1", "fp8", "fp8", A8),
    "ct-fp8-channel": Case("ct-fp8-channel", "auto", "fp8", A8),
    "ct-fp8-tensor-kv-replicated": Case("ct-fp8-tensor", "auto", "fp8", A8),
    "ct-w8a8-int8": Case("ct-w8a8-int8", "auto", "w8a8-int8", A8),
    "hf-fp8-block-kv-replicated": Case("hf-fp8-block", "auto", "fp8-block", EXACT),
    "ct-fp8-block": Case("ct-fp8-block", "auto", "fp8-block", EXACT),
    "hf-fp8-block-dequantized": Case("hf-fp8-block", "none", "none", EXACT),
    "ct-fp8-channel-dequantized": Case("ct-fp8-channel", "none", "none", EXACT),
    "ct-fp8-tensor-dequantized": Case("ct-fp8-tensor", "none", "none", EXACT),
    "ct-w8a8-int8-dequantized": Case("ct-w8a8-int8", "none", "none", EXACT),
}


def _batch(vocab: int, blocks: bool) -> tuple[list[list[int]], list[int], int]:
    """(sequences, prompt lengths, chunk). The Triton interpreter is slow: one short
    sequence for the blocks."""
    rng = random.Random(vocab)
    lens, decode = ([5], 2) if blocks else ([3, 9, 14], 3)
    return [[rng.randrange(vocab) for _ in range(n + decode)] for n in lens], lens, 4


def _run(path: str, case: Case) -> tuple[str, Counter, list[torch.Tensor]]:
    """Load, convert and run one case on this process (a rank, in `tensor_parallel`):
    the format, the linear layers' formats, the logits."""
    from infer.engine.setup import gguf_blocks_of
    from infer.loader import load_gguf, load_hf_dir
    from infer.models.linear import LinearBase
    from infer.quantization import method_made_at_load, quantize_model
    from infer.quantization.gguf import keep_gguf_quantized

    load = load_gguf if path.endswith(".gguf") else load_hf_dir
    model, cfg = load(path, torch.float32, "cpu", method_made_at_load(case.quantization))
    blocks = gguf_blocks_of(path, cfg, case.quantization)
    if case.blocks:
        fmt = "gguf" if keep_gguf_quantized(model, blocks, as_blocks=True) else "none"
    else:
        fmt = quantize_model(model, case.quantization, blocks, case.int8x)
        if case.int8x:  # the block kernels took the layers, or the table
            from infer.quantization.cpu_blocks import Q4BlocksLinearMethod, Q8BlocksTableMethod

            assert any(isinstance(m.quant_method, (Q4BlocksLinearMethod, Q8BlocksTableMethod))
                       for m in model.modules() if hasattr(m, "quant_method"))
    linears = Counter(m.quant_method.format for m in model.modules()
                      if isinstance(m, LinearBase))
    seqs, lens, chunk = _batch(cfg.vocab_size, case.blocks)
    return fmt, linears, run_paged(model, seqs, lens, block_size=4, chunk=chunk)


def _rank_cases(group, jobs: dict[str, tuple[str, Case]]) -> dict[str, Any]:
    from infer.distributed.group import tensor_parallel

    out: dict[str, Any] = {}
    for name, (path, case) in jobs.items():
        try:
            with tensor_parallel(group):
                out[name] = _run(path, case)
        except Exception:
            out[name] = traceback.format_exc()
    return out


# ---------------------------------------------------------------- checkpoints


def _llama(**kw):
    from transformers import LlamaConfig

    # k-quant rows: hidden and intermediate sizes multiples of 256; an odd vocabulary
    return LlamaConfig(**{**dict(vocab_size=321, hidden_size=256, intermediate_size=512,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=128,
                                 tie_word_embeddings=False), **kw})


def _zero_mean_q4_k(n_values: int, qtype, rng) -> np.ndarray:
    """Q4_K blocks of random nibbles whose sub-blocks all have scale 8 and min 60, so the
    weights are `8 d (q - 7.5)`, symmetric about 0 (the gguf package cannot quantize
    k-quants). Random bytes as scales and mins make weights of one sign, whose mean
    swamps what the layers add: a wrong cut would hardly move the logits."""
    blocks = rng.integers(0, 256, (n_values // 256, 144), dtype=np.uint8)
    blocks[:, 0:4] = np.array([1.5e-3, 1.5e-3], dtype=np.float16).view(np.uint8)  # d, dmin
    # six-bit scales and mins, packed as ggml's get_scale_min_k4 reads them
    blocks[:, 4:16] = [8] * 4 + [60 | 3 << 6] * 4 + [8 | 12 << 4] * 4
    return blocks


def _write(root: Path) -> dict[str, Path]:
    """Every source of CASES, by name."""
    import test_gguf_models
    from checkpoints import save_random_checkpoint
    from gguf import GGMLQuantizationType as Q
    from test_gguf_models import random_hf_model, write_gguf
    from test_quantized_checkpoints import write_quantized
    from transformers import GPT2Config, Qwen2Config, Qwen3Config

    out = {}
    llama = random_hf_model(_llama())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_gguf_models, "random_kquant_blocks", _zero_mean_q4_k)
        for qtype in (Q.Q4_0, Q.Q4_K, Q.Q8_0):
            out[f"llama-{qtype.name}.gguf"] = write_gguf(
                root / f"llama-{qtype.name}.gguf", "llama", llama, qtype)
    # q/k/v biases, tied, one KV head replicated on both ranks
    qwen2 = Qwen2Config(vocab_size=320, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                        max_position_embeddings=128, tie_word_embeddings=True)
    out["qwen2-Q4_0.gguf"] = write_gguf(root / "qwen2-Q4_0.gguf", "qwen2",
                                        random_hf_model(qwen2), Q.Q4_0)
    # the fused c_attn stays float (transposed in the file); the tables are quantized
    gpt2 = GPT2Config(vocab_size=321, n_positions=1024, n_embd=64, n_layer=2, n_head=4)
    out["gpt2-Q8_0.gguf"] = write_gguf(root / "gpt2-Q8_0.gguf", "gpt2",
                                       random_hf_model(gpt2), Q.Q8_0)
    save_random_checkpoint(_llama(), root / "llama")
    out["llama"] = root / "llama"
    qwen3 = Qwen3Config(vocab_size=321, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=64, max_position_embeddings=128, tie_word_embeddings=True)
    save_random_checkpoint(qwen3, root / "qwen3-kv1")
    out["qwen3-kv1"] = root / "qwen3-kv1"
    for layout in ("ct-fp8-channel", "ct-w8a8-int8"):
        write_quantized(root / layout, layout, config=_llama(vocab_size=320))
    # per-tensor scales: the replicated KV shard's scale is its own tensor's
    write_quantized(root / "ct-fp8-tensor", "ct-fp8-tensor",
                    config=_llama(vocab_size=320, num_key_value_heads=1))
    # 128x128 tiles: every rank's part whole tiles (heads of 128)
    write_quantized(root / "hf-fp8-block", "hf-fp8-block-bf16", config=_llama(
        vocab_size=320, num_attention_heads=2, num_key_value_heads=1, head_dim=128))
    write_quantized(root / "ct-fp8-block", "ct-fp8-block", config=_llama(
        vocab_size=320, num_attention_heads=2, num_key_value_heads=2, head_dim=128))
    for name in ("ct-fp8-channel", "ct-w8a8-int8", "ct-fp8-tensor", "hf-fp8-block",
                 "ct-fp8-block"):
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return _write(tmp_path_factory.mktemp("tp_formats"))


@pytest.fixture(scope="module")
def tp_results(sources) -> dict[str, list[Any]]:
    jobs = {name: (str(sources[case.source]), case) for name, case in CASES.items()}
    ranks = run_ranks(_rank_cases, TP, jobs)
    return {name: [r[name] for r in ranks] for name in jobs}


@pytest.mark.parametrize("name", list(CASES))
def test_tensor_parallel_logits_equal_one_rank_of_the_same_format(sources, tp_results,
                                                                   name):
    case = CASES[name]
    if case.int8x and not cpu_extension.available():
        pytest.skip("infer's CPU block kernels do not build here")
    fmt, linears, want = _run(str(sources[case.source]), case)
    assert fmt == case.format
    scale = max(w.abs().max().item() for w in want)
    for rank, result in enumerate(tp_results[name]):
        assert not isinstance(result, str), f"rank {rank} failed:\n{result}"
        got_fmt, got_linears, got = result
        assert got_fmt == fmt
        if name != "gguf-q4_k-blocks":
            assert got_linears == linears
        error = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
        print(f"{name}: {error / scale:.2e}")
        assert error <= case.tolerance * scale, (error, scale)


def test_q4_k_blocks_cut_by_a_rank_are_requantized(tp_results):
    """The GPU's way: o_proj's rank holds 128 input columns, half a Q4_K block: INT8 from its
    dequantized columns; every other layer keeps the file's blocks."""
    for result in tp_results["gguf-q4_k-blocks"]:
        assert not isinstance(result, str), result
        assert result[1] == Counter({"gguf": 6, "int8": 2})


# ---------------------------------------------------------------- refused, and the cuts


def test_fp8_tiles_straddling_two_ranks_are_refused_by_name(tmp_path):
    """64 KV rows a rank (2 heads of 64) would cut the checkpoint's 128-row tiles; building
    rank 0's part refuses, before any collective."""
    from test_quantized_checkpoints import write_quantized

    from infer.distributed.group import TensorParallelGroup, tensor_parallel
    from infer.loader import load_hf_dir
    from infer.models.weights import WeightError

    write_quantized(tmp_path, "hf-fp8-block-f32")
    with tensor_parallel(TensorParallelGroup(0, TP)), pytest.raises(
            WeightError, match=r"fp8-block .*tensor_parallel_size=2: .*64 rows of shard 'k'"):
        load_hf_dir(tmp_path)


def test_gguf_blocks_cut_rows_in_checkpoint_order_and_columns_on_block_boundaries():
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    from infer.quantization.gguf_blocks import GGUFBlocks

    rows, cols = 6, 96
    raw = quantize(np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32),
                   Q.Q8_0)
    values = dequantize(raw, Q.Q8_0).reshape(rows, cols)
    blocks = GGUFBlocks.of("w", Q.Q8_0, (rows, cols), raw)
    blocks.row_order = torch.tensor([5, 4, 3, 2, 1, 0])

    def decoded(b: GGUFBlocks) -> np.ndarray:
        return dequantize(np.array(b.data), Q.Q8_0).reshape(b.rows, b.cols)

    assert np.array_equal(decoded(blocks.part(0, 2, 2)), values[[3, 2]])
    padded = blocks.part(0, 4, 4)  # a vocabulary's last part: two rows, two of padding
    assert np.array_equal(decoded(padded), np.concatenate([values[[1, 0]],
                                                           np.zeros((2, cols))]))
    assert np.array_equal(decoded(blocks.part(1, 32, 64).part(0, 0, 6)),
                          values[::-1, 32:])
    with pytest.raises(ValueError, match="cut a Q8_0 block of 32"):
        blocks.part(1, 48, 48)
