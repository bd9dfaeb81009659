"""GGUF weights kept quantized (the default for GGUF files on a CPU): the 4-bit blocks read
as exactly the values ggml dequantizes them to, the INT4 kernel against float64, a model
kept quantized against the same file dequantized (every type the default model uses, a
k-quant, the 8-bit requantized types), and the real SmolLM2: its greedy text against the
dequantized path and its perplexity within 3 % (the 4-bit target)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from paged_runner import run_paged
from real_models import smollm2_gguf
from test_gguf_models import llama_config, random_hf_model, random_kquant_blocks, write_gguf
from test_quantization import TEXT, _perplexity

from infer.kernels import cpu_extension, triton_available
from infer.loader import load_gguf
from infer.loader.gguf_file import open_gguf, quantized_blocks
from infer.models.linear import (
    LinearBase,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from infer.quantization import int4, quantize_model
from infer.quantization.cpu_blocks import Q4BlocksLinearMethod, Q8BlocksTableMethod
from infer.quantization.gguf import keep_gguf_quantized
from infer.quantization.gguf_blocks import GGUFBlocks, int4_groups
from infer.quantization.gguf_gpu import GGUFBlocksLinearMethod
from infer.quantization.int4 import DEQUANTIZE_ROWS, Int4GroupLinearMethod
from infer.quantization.int8 import Int8WeightOnlyLinearMethod


def _blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype == Q.Q4_K:  # the gguf package cannot quantize k-quants: random valid blocks
        return random_kquant_blocks(rows * cols, qtype, rng).reshape(rows, -1)
    return quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)


def _weight(q: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    groups = q.double().view(rows, -1, 32) * a.double()[..., None] + b.double()[..., None]
    return groups.view(rows, cols)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_4bit_groups_are_the_values_ggml_dequantizes(qtype):
    rows, cols = 48, 512
    raw = _blocks(qtype, rows, cols)
    ref = torch.from_numpy(dequantize(raw, qtype).reshape(rows, cols).astype(np.float64))
    blocks = GGUFBlocks.of("w", qtype, (rows, cols), raw)
    q, a, b = int4_groups(blocks)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and a.shape == (rows, cols // 32)
    assert torch.equal(_weight(q, a, b), ref)
    blocks.row_order = torch.randperm(rows)  # rows in another order than the file's
    assert torch.equal(_weight(*int4_groups(blocks)), ref[blocks.row_order])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33, DEQUANTIZE_ROWS + 7])  # the last dequantizes
def test_int4_matmul_matches_float64_from_the_groups(dtype, rows):
    torch.manual_seed(rows)
    layer = RowParallelLinear(256, 96, bias=True).to(dtype)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(96))
    q, a, b = int4_groups(GGUFBlocks.of("w", Q.Q4_1, (96, 256), _blocks(Q.Q4_1, 96, 256)))
    Int4GroupLinearMethod().load(layer, q, a, b)
    x = torch.randn(rows, 256).to(dtype)
    y = layer(x)
    # A16: the activations as the kernel takes them (bfloat16), everything else float64
    ref = x.to(torch.bfloat16).double() @ _weight(q, a, b).T + layer.bias.double()
    assert y.dtype == dtype and y.shape == (rows, 96)
    assert (y.double() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()


@pytest.mark.parametrize(("rows", "cols"), [(96, 256), (960, 576), (3072, 576), (576, 1536),
                                          (48, 256), (16, 64)])
def test_int4_weights_read_back_as_packed(rows, cols):
    """What a step of many rows multiplies by: the packed values and the stored (bfloat16)
    scales, `(q - 8) * scale + zero`, whatever tiles this CPU's packing uses (32 rows with
    AVX2, 64 with AVX-512, others for the rows left over)."""
    q, a, b = int4_groups(GGUFBlocks.of("w", Q.Q4_1, (rows, cols), _blocks(Q.Q4_1, rows, cols)))
    layer = RowParallelLinear(cols, rows)
    method = Int4GroupLinearMethod()
    method.load(layer, q, a, b)
    assert method.dequantizable(layer)
    scale = a.to(torch.bfloat16).double()[..., None]
    zero = (b + 8 * a).to(torch.bfloat16).double()[..., None]
    ref = ((q.double().view(rows, -1, 32) - 8) * scale + zero).view(rows, cols)
    got = method.dequantize(layer)
    assert got.dtype == torch.float32 and (got.double() - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_a_packing_that_is_no_reordering_keeps_the_kernel(monkeypatch):
    """Where torch's packing could not be read back (here: a stand-in that loses values),
    the layer is not dequantized: long steps keep torch's kernel, which reads its own
    packing."""
    q, a, b = int4_groups(GGUFBlocks.of("w", Q.Q4_1, (32, 64), _blocks(Q.Q4_1, 32, 64)))
    layer = RowParallelLinear(64, 32)
    method = Int4GroupLinearMethod()
    method.load(layer, q, a, b)
    real_pack = int4._pack
    monkeypatch.setattr(int4, "_pack", lambda values: real_pack(values & 0x7))
    int4.unpack_order.cache_clear()
    try:
        assert not method.dequantizable(layer)
        with pytest.raises(NotImplementedError, match="layout"):
            method.dequantize(layer)
        x = torch.randn(DEQUANTIZE_ROWS, 64)
        want = x.to(torch.bfloat16).double() @ _weight(q, a, b).T
        assert (layer(x).double() - want).abs().max() < 2e-2 * want.abs().max()
    finally:
        int4.unpack_order.cache_clear()


@pytest.fixture(scope="module")
def llama_source():
    return random_hf_model(llama_config())


BLOCK_KERNELS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_extension.available(), reason="infer's CPU block kernels do not build here"))]


# Q4_0 / Q4_1: the default model's; Q4_K: a k-quant in 4 bits; Q8_0 / Q6_K: requantized
# (Q8_0 kept as stored in the tables with infer's block kernels)
@pytest.mark.parametrize("int8x", BLOCK_KERNELS, ids=["torch", "int8x"])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q6_K],
                         ids=lambda q: q.name)
def test_a_model_kept_quantized_gives_the_dequantized_logits(tmp_path, llama_source, qtype,
                                                            int8x):
    path = write_gguf(tmp_path / f"llama-{qtype.name}.gguf", "llama", llama_source, qtype)
    reference, cfg = load_gguf(path)
    model, _ = load_gguf(path)
    blocks = quantized_blocks(open_gguf(path), cfg)
    assert quantize_model(model, "auto", blocks, cpu_int8_activations=int8x) == "gguf"
    four_bits = qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K)
    kept = Int8WeightOnlyLinearMethod if not four_bits else \
        Q4BlocksLinearMethod if int8x else Int4GroupLinearMethod
    # converted once: "auto" runs the weights as they are now, a format of its own refuses
    assert quantize_model(model, "auto", blocks) == kept.format
    with pytest.raises(ValueError, match=r"stored in .* already"):
        quantize_model(model, "fp8")
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(isinstance(m.quant_method, kept) for m in linears)
    tables = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding)]
    as_stored = int8x and qtype == Q.Q8_0
    assert len(tables) == 2 and all(
        isinstance(m.quant_method, Q8BlocksTableMethod) == as_stored and
        m.weight.dtype == (torch.uint8 if as_stored else torch.int8) for m in tables)
    # q/k rows are un-permuted from llama.cpp's order: a wrong order would not come close
    sequences = [[5, 17, 200, 3, 99, 41, 7, 12], [250, 1, 1, 30]]
    got = run_paged(model, sequences, [5, 4])
    want = run_paged(reference, sequences, [5, 4])
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() < 3e-2 * w.abs().max().item()


def test_quantization_gguf_keeps_the_blocks_and_needs_a_gguf_file(tmp_path, llama_source):
    path = write_gguf(tmp_path / "llama-Q4_K.gguf", "llama", llama_source, Q.Q4_K)
    model, cfg = load_gguf(path)
    with pytest.raises(ValueError, match="not loaded from a GGUF file"):
        quantize_model(model, "gguf", None)
    assert quantize_model(model, "gguf", quantized_blocks(open_gguf(path), cfg),
                          cpu_int8_activations=False) == "gguf"
    assert all(isinstance(m.quant_method, Int4GroupLinearMethod)
               for m in model.modules() if isinstance(m, LinearBase))


def test_quantization_none_keeps_the_file_dequantized(tmp_path, llama_source):
    path = write_gguf(tmp_path / "llama-Q4_0.gguf", "llama", llama_source, Q.Q4_0)
    model, cfg = load_gguf(path)
    blocks = quantized_blocks(open_gguf(path), cfg)
    assert quantize_model(model, "none", blocks) == "none"
    assert all(p.dtype == torch.float32 for p in model.parameters())


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.slow
@pytest.mark.parametrize("int8x", BLOCK_KERNELS, ids=["torch", "int8x"])
def test_smollm2_kept_quantized_text_and_perplexity(int8x):
    """Its linear layers are Q4_1 (kept exactly), its tied embedding Q8_0 (requantized to
    INT8 per row for PyTorch's kernels, as stored for infer's, x rounded to int8). Greedy
    text equals the dequantized path's, or where a token differs the
    dequantized model's own margin between the two tokens was within the logit error of
    the quantized one at that position; perplexity within 3 %."""
    from infer import LLM, SamplingParams

    path = str(smollm2_gguf())
    small = dict(device="cpu", max_model_len=512, num_blocks=64)  # a KV pool of its own size
    dequantized = LLM(path, quantization="none", **small)
    kept = LLM(path, cpu_int8_activations=int8x, **small)
    assert (dequantized.engine.info.quantization, kept.engine.info.quantization) == \
        ("none", "gguf")
    linears = [m for m in kept.engine.model.modules() if isinstance(m, LinearBase)]
    method = Q4BlocksLinearMethod if int8x else Int4GroupLinearMethod
    assert all(isinstance(m.quant_method, method) for m in linears)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
               "The three primary colors are"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = dequantized.generate(prompts, params, use_tqdm=False)
    got = kept.generate(prompts, params, use_tqdm=False)
    same = 0
    for w, g in zip(want, got):
        a, b = w.outputs[0].token_ids, g.outputs[0].token_ids
        i = _first_difference(a, b)
        if i is None:
            same += 1
            continue
        prefix = w.prompt_token_ids + a[:i]
        ref = run_paged(dequantized.engine.model, [prefix], [len(prefix)])[0][-1].double()
        ours = run_paged(kept.engine.model, [prefix], [len(prefix)])[0][-1].double()
        margin, error = (ref[a[i]] - ref[b[i]]).item(), (ours - ref).abs().max().item()
        print(f"{w.prompt!r}: token {i} differs; margin {margin:.3f}, logit error {error:.3f}")
        assert 0 <= margin <= error
    # How many are the same depends on the CPU's kernels (3 of 4 on one machine, 1 on
    # another, with margins of 0.04-0.14 under errors of 0.55-0.67): the margins are the
    # test, and perplexity below says the quantized model is the model.
    print(f"{same} of {len(prompts)} the same")
    ids = kept.get_tokenizer().encode(TEXT)
    before = _perplexity(dequantized.engine.model, ids)
    after = _perplexity(kept.engine.model, ids)
    print(f"perplexity: {before:.3f} dequantized, {after:.3f} kept quantized")
    assert abs(after - before) / before < 0.03, (before, after)


# -- the GPU's way: the file's blocks and the Triton kernels (the interpreter on a CPU) ----

DEVICE = os.environ.get("INFER_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def one_layer_source():
    """The models the interpreter runs (seconds a launch) have one layer: it has every kind
    of linear layer, norm and table that more have."""
    return random_hf_model(llama_config(layers=1))


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)  # Q4_K_M's types
def test_a_model_kept_as_blocks_gives_the_dequantized_logits(tmp_path, one_layer_source,
                                                             qtype):
    path = write_gguf(tmp_path / f"llama-{qtype.name}.gguf", "llama", one_layer_source, qtype)
    reference, cfg = load_gguf(path)
    model, _ = load_gguf(path, device=DEVICE)
    blocks = quantized_blocks(open_gguf(path), cfg)
    assert keep_gguf_quantized(model, blocks, as_blocks=True)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(isinstance(m.quant_method, GGUFBlocksLinearMethod)
                           and m.weight.dtype == torch.uint8 for m in linears)
    tables = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding)]
    assert len(tables) == 2 and all(isinstance(m.quant_method, GGUFBlocksLinearMethod)
                                    for m in tables)
    # one sequence at a time: its prefill (5 or 18 rows) and its one-row decode step read
    # the blocks
    for seq, prefill in (([5, 17, 200, 3, 99, 41], 5), (list(range(30, 49)), 18)):
        [got] = run_paged(model, [seq], [prefill])
        [want] = run_paged(reference, [seq], [prefill])
        assert (got.cpu() - want).abs().max().item() < 1e-4 * want.abs().max().item()


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_a_quantized_model_with_x_rounded_to_int8_stays_near_the_dequantized_logits(
        tmp_path, one_layer_source, qtype):
    """`gguf_int8_activations` through a whole model: its decode step's logits move by x's
    rounding only (the prefill, more than one row, stays exact)."""
    from infer.quantization.gguf_gpu import set_gguf_int8_activations

    path = write_gguf(tmp_path / f"llama-{qtype.name}.gguf", "llama", one_layer_source, qtype)
    reference, cfg = load_gguf(path)
    model, _ = load_gguf(path, device=DEVICE)
    assert keep_gguf_quantized(model, quantized_blocks(open_gguf(path), cfg), as_blocks=True)
    set_gguf_int8_activations(model, True)
    seq = list(range(30, 49))
    [got] = run_paged(model, [seq], [18])
    [want] = run_paged(reference, [seq], [18])
    error = (got.cpu() - want).abs().max().item() / want.abs().max().item()
    assert 1e-6 < error < 3e-2, error  # rounded (not the exact path), and near it


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_x_rounded_where_it_is_made_gives_the_logits_of_a_launch_of_its_own(
        tmp_path, one_layer_source, monkeypatch, qtype):
    """`gguf_fused_x_rounding`: the norms hand their one-row outputs to q/k/v, gate/up and
    the LM head rounded, the gated activation is rounded in its own launch; the decode
    logits are those of rounding x apart (but for the order of the sums' additions), and
    only the attention output (o) is still rounded by a launch of its own."""
    from infer.kernels import int8_rows
    from infer.models.layers import set_kernel_backend
    from infer.quantization.gguf_gpu import set_gguf_int8_activations

    path = write_gguf(tmp_path / f"llama-{qtype.name}.gguf", "llama", one_layer_source, qtype)
    logits, calls = [], []
    real = int8_rows.quantize_x
    monkeypatch.setattr(int8_rows, "quantize_x",
                        lambda x, act="": calls.append(act) or real(x, act))
    for fused in (False, True):
        model, cfg = load_gguf(path, device=DEVICE)
        assert keep_gguf_quantized(model, quantized_blocks(open_gguf(path), cfg),
                                   as_blocks=True)
        set_kernel_backend(model, "triton")
        set_gguf_int8_activations(model, True, fused)
        calls.clear()
        logits.append(run_paged(model, [list(range(30, 49))], [18])[0].cpu())
    unfused, fused = logits
    assert (fused - unfused).abs().max().item() < 1e-5 * unfused.abs().max().item()
    layers = cfg.num_layers  # in the one-row decode step after the prefill:
    assert calls.count("") == layers  # o
    assert calls.count("silu") == layers  # down


def _q4_k_m_qkv_layer(cols: int, seed: int) -> tuple[QKVParallelLinear, list[torch.Tensor]]:
    """A fused q/k/v layer of `cols` inputs kept in GGUF blocks as Q4_K_M stores it (q and
    k in Q4_K, v in Q6_K), and its three weights dequantized by gguf (float64)."""
    rng = np.random.default_rng(seed)
    layer = QKVParallelLinear(cols, 64, 4, 2).to(DEVICE)
    shards, parts = [], []
    for name, qtype, rows in (("q", Q.Q4_K, 256), ("k", Q.Q4_K, 128), ("v", Q.Q6_K, 128)):
        raw = random_kquant_blocks(rows * cols, qtype, rng).reshape(rows, -1)
        shards.append(GGUFBlocks.of(name, qtype, (rows, cols), raw))
        parts.append(torch.from_numpy(dequantize(raw, qtype).reshape(rows, cols)).double())
    GGUFBlocksLinearMethod().load(layer, shards)
    return layer, parts


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_a_fused_layer_of_mixed_types_keeps_a_run_per_type():
    """Q4_K_M's way: q and k in Q4_K, v in Q6_K, one fused q/k/v layer."""

    layer, parts = _q4_k_m_qkv_layer(256, seed=0)
    assert [qtype for _, qtype in layer.gguf_runs] == [Q.Q4_K, Q.Q6_K]
    for rows in (1, 40):  # the kernels, then the dequantized weight
        x = torch.randn(rows, 256)
        y = layer(x.to(DEVICE)).cpu().double()
        ref = x.double() @ torch.cat(parts).T
        assert (y - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_gguf_int8_activations_take_the_k_quant_runs_of_one_row_only():
    """With the knob, one row's Q4_K runs go to their dp4a kernel (x rounded to int8; its
    launch splits K here) and the Q6_K run to its own, x rounded once for both; larger
    steps stay exact."""
    from infer.kernels import gguf_q4k_int8x as q4k
    from infer.kernels import gguf_q6k_int8x as q6k
    from infer.kernels.gguf_gemv import gemv_words
    from infer.quantization.gguf_gpu import set_gguf_int8_activations

    cols = 1024  # 4 Q4_K super-blocks a row: its launch splits K in two
    layer, parts = _q4_k_m_qkv_layer(cols, seed=1)
    set_gguf_int8_activations(layer, True)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    y = layer(x).cpu().double()
    (q4_name, q4_type), (q6_name, q6_type) = layer.gguf_runs
    assert (q4_type, q6_type) == (Q.Q4_K, Q.Q6_K)
    words = gemv_words(getattr(layer, q4_name), Q.Q4_K)
    the_launch = q4k.launch(len(words), cols, x.device)
    assert the_launch["split"] > 1
    quantized = q4k.quantize_x(x)
    rounded = q4k.q4k_gemv_int8x(x, words, cols, quantized=quantized, **the_launch)
    assert torch.equal(y[:, :384], rounded.cpu().double())
    words = gemv_words(getattr(layer, q6_name), Q.Q6_K)
    rounded = q6k.q6k_gemv_int8x(x, words, cols, quantized=quantized,
                                 **q6k.launch(len(words), cols, x.device))
    assert torch.equal(y[:, 384:], rounded.cpu().double())
    ref = x.cpu().double() @ torch.cat(parts).T
    scale = ref.abs().max().item()
    assert (y - ref).abs().max().item() < 2e-2 * scale
    assert (y[:, :384] - ref[:, :384]).abs().max().item() > 1e-5 * scale  # rounded x
    assert (y[:, 384:] - ref[:, 384:]).abs().max().item() > 1e-5 * scale
    forty = torch.randn(40, cols).to(DEVICE)  # more rows: exact
    ref = forty.cpu().double() @ torch.cat(parts).T
    assert (layer(forty).cpu().double() - ref).abs().max().item() < 1e-5 * ref.abs().max()
    set_gguf_int8_activations(layer, False)
    y = layer(x).cpu().double()
    ref = x.cpu().double() @ torch.cat(parts).T
    assert (y - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_gguf_int8_activations_leave_q6_k_rows_of_odd_super_blocks_exact():
    """Q6_K rows of an odd number of 210-byte super-blocks are no whole number of words
    (K = 768): the int8-x Q6_K kernel cannot read them, the exact path multiplies them."""
    from infer.quantization.gguf_gpu import set_gguf_int8_activations

    layer, parts = _q4_k_m_qkv_layer(768, seed=2)
    set_gguf_int8_activations(layer, True)
    x = torch.randn(1, 768, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    y = layer(x).cpu().double()
    ref = x.cpu().double() @ torch.cat(parts).T
    scale = ref.abs().max().item()
    assert (y[:, 384:] - ref[:, 384:]).abs().max().item() < 1e-5 * scale  # Q6_K: exact
    assert (y[:, :384] - ref[:, :384]).abs().max().item() > 1e-5 * scale  # Q4_K: rounded x
