"""The Triton backend (attention + norm/RoPE/activation kernels) end to end, in the Triton
interpreter: greedy tokens and logprobs equal to the torch reference backend on tiny random
checkpoints of every architecture, with and without the decode-graph static buffers.

On a GPU machine, `INFER_TEST_DEVICE=cuda` runs the same tests on CUDA with the graphs
really captured (conftest.py then leaves the interpreter off)."""

from __future__ import annotations

import os
import random

import pytest
from checkpoints import save_random_checkpoint, save_word_tokenizer

from infer import LLM, SamplingParams
from infer.engine.cuda_graphs import graph_batch_sizes
from infer.kernels import triton_available

pytestmark = pytest.mark.slow  # `pytest -m 'not slow'`: the quick inner loop skips it

DEVICE = os.environ.get("INFER_TEST_DEVICE", "cpu")
if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)
transformers = pytest.importorskip("transformers")

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=256)


def _config(case: str):
    t = transformers
    return {
        "llama-gqa": lambda: t.LlamaConfig(**BASE, num_attention_heads=8, num_key_value_heads=2),
        "mistral-window": lambda: t.MistralConfig(**BASE, num_attention_heads=4,
                                                  num_key_value_heads=2, sliding_window=6),
        "qwen2-bias": lambda: t.Qwen2Config(**BASE, num_attention_heads=4,
                                            num_key_value_heads=2),
        "qwen3-qk-norm": lambda: t.Qwen3Config(**BASE, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=24),
        "gemma3": lambda: t.Gemma3TextConfig(
            **BASE, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
            query_pre_attn_scalar=20, sliding_window=5,
            layer_types=["sliding_attention", "full_attention"]),
        "gpt2": lambda: t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2,
                                     n_positions=256),
    }[case]()


ARCHITECTURES = ["llama-gqa", "mistral-window", "qwen2-bias", "qwen3-qk-norm", "gemma3", "gpt2"]
# The Qwen2 case adds to the others only its projections' bias, which F.linear adds on
# every backend (linear.py): the tests of the attention backend's own paths leave it out.
ATTENTION_CASES = [case for case in ARCHITECTURES if case != "qwen2-bias"]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_random_checkpoint(_config(request.param), path, seed=3)
    save_word_tokenizer(path, VOCAB)
    return path


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    # A shared prefix of two full blocks. The last prompt is scheduled once the first
    # one's blocks are cached: its prefill reads them.
    shared = [rng.randrange(3, VOCAB) for _ in range(8)]
    prefixed = [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 9, 3)]
    alone = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 17)]
    return [prefixed[0], *alone, prefixed[1], prefixed[2]]


def _generate(path, graphs: str | None = None, **flags):
    llm = LLM(str(path), device=DEVICE, dtype="float32", cuda_graphs=False, block_size=4,
              max_model_len=64, max_num_seqs=6,
              max_num_batched_tokens=16, **flags)  # 16: long prompts go in chunks
    if graphs:
        llm.engine.runner.enable_decode_graphs(6, 64, capture=DEVICE != "cpu")
        if graphs == "mixed":
            llm.engine.runner.enable_mixed_graphs(16, 6, 64, capture=DEVICE != "cpu")
        else:
            llm.engine.runner.enable_piecewise_graphs(16, capture=DEVICE != "cpu")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert llm.engine.attention_backend == flags["attention_backend"]
    assert outs[-1].num_cached_tokens == 8  # the shared prefix (_prompts)
    if graphs:
        assert llm.engine.runner.graphs.steps >= 4
        served = llm.engine.runner.mixed if graphs == "mixed" else llm.engine.runner.piecewise
        assert served.steps >= 3  # every step with prompt tokens
    return outs


def _assert_same(outs, refs) -> None:
    for out, ref in zip(outs, refs):
        got, want = out.outputs[0], ref.outputs[0]
        assert got.token_ids == want.token_ids
        for lp, ref_lp, token in zip(got.logprobs, want.logprobs, want.token_ids):
            assert lp[token].logprob == pytest.approx(ref_lp[token].logprob, abs=1e-4)


def test_triton_backend_matches_torch(model_dir):
    ref = _generate(model_dir, attention_backend="torch", kernel_backend="torch")
    _assert_same(_generate(model_dir, attention_backend="triton", kernel_backend="triton"), ref)


def test_one_sequence_through_the_gemv_matches_torch(model_dir, monkeypatch):
    """Every decode step of one sequence is one row: its matmuls without a bias go through
    kernels/gemv.py, a gated MLP's gate_up projection storing its activation
    (`gemv_gate_up`)."""
    import infer.kernels.gemv as gemv

    calls = []
    for name in ("gemv", "gemv_gate_up"):
        real = getattr(gemv, name)
        monkeypatch.setattr(gemv, name, lambda *a, _name=name, _real=real, **kw:
                            calls.append(_name) or _real(*a, **kw))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    prompt = _prompts()[:1]
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(model_dir), device=DEVICE, dtype="float32", cuda_graphs=False,
                  block_size=4, max_model_len=64, max_num_seqs=2, attention_backend=backend,
                  kernel_backend=backend, triton_gemv=True)
        outs[backend] = llm.generate(prompt, params, use_tqdm=False)
        assert bool(calls) == (backend == "triton"), backend
    _assert_same(outs["triton"], outs["torch"])
    if "gpt2" not in model_dir.name:  # GPT-2's projections all carry a bias
        assert "gemv_gate_up" in calls


@pytest.mark.parametrize("model_dir", ATTENTION_CASES, indirect=True)
@pytest.mark.parametrize("graphs", ["mixed", "piecewise"])
def test_graph_buffers_match_torch(model_dir, graphs):
    """The padded static-buffer paths of CUDA graphs (run eagerly here): 5 sequences
    decode as graph size 6, then fewer as they finish; the steps with prompt tokens go
    through whole-step graphs or graphs cut at attention; all against the reference."""
    ref = _generate(model_dir, attention_backend="torch", kernel_backend="torch")
    outs = _generate(model_dir, graphs=graphs, attention_backend="triton",
                     kernel_backend="torch" if DEVICE == "cpu" else "triton")
    _assert_same(outs, ref)


@pytest.mark.parametrize("model_dir", ATTENTION_CASES, indirect=True)
def test_long_prefills_through_sdpa_match_torch(model_dir, monkeypatch):
    """The per-size choice inside the Triton backend (long prefills -> SDPA), with the
    threshold lowered so that this test's prompts and chunks cross it."""
    from infer.attention import triton_backend

    monkeypatch.setattr(triton_backend, "DENSE_PREFILL_MIN_TOKENS", 8)
    calls = []
    real = triton_backend.dense_prefill
    monkeypatch.setattr(triton_backend, "dense_prefill",
                        lambda *args: calls.append(1) or real(*args))
    ref = _generate(model_dir, attention_backend="torch", kernel_backend="torch")
    assert not calls
    outs = _generate(model_dir, attention_backend="triton",
                     kernel_backend="torch" if DEVICE == "cpu" else "triton")
    # every Mistral layer has a sliding window, which stays on our kernel
    assert bool(calls) == ("mistral" not in model_dir.name)
    _assert_same(outs, ref)


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]


@pytest.mark.skipif(DEVICE != "cpu", reason="about the CPU")
def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch, model_dir):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(str(model_dir), device="cpu", attention_backend="triton")


@pytest.mark.parametrize("model_dir", ["llama-gqa", "qwen3-qk-norm", "gemma3"], indirect=True)
def test_an_fp8_kv_cache_on_triton_matches_torch(model_dir):
    """An FP8 cache (`kv_cache_dtype`): the Triton stores (plain, and fused with the q/k
    norms and RoPE) and attention against the torch ones, prefix caching and chunks
    included."""
    ref = _generate(model_dir, attention_backend="torch", kernel_backend="torch",
                    kv_cache_dtype="fp8")
    _assert_same(_generate(model_dir, attention_backend="triton", kernel_backend="triton",
                           kv_cache_dtype="fp8"), ref)
