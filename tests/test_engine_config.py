"""EngineConfig validates at construction and names the conflicting fields."""

from __future__ import annotations

import pytest

from infer.cli import build_parser, engine_config
from infer.engine.config import EngineConfig


def test_defaults_are_valid():
    cfg = EngineConfig()
    assert cfg.kv_cache == "paged" and cfg.batching_mode == "continuous"


@pytest.mark.parametrize(
    ("fields", "needles"),
    [
        (dict(kv_cache="contiguous"), ["kv_cache='contiguous'", "prefix_caching=True"]),
        (dict(chunked_prefill=False, prefill_chunk_size=64),
         ["prefill_chunk_size", "chunked_prefill=False"]),
        (dict(chunked_prefill=False, max_model_len=4096, max_num_batched_tokens=1024),
         ["max_num_batched_tokens", "max_model_len"]),
        (dict(batching_mode="dynamic"), ["batching_mode"]),
        (dict(kv_cache="ring"), ["kv_cache"]),
        (dict(dtype="fp4"), ["dtype"]),
        (dict(device="tpu"), ["device"]),
        (dict(block_size=0), ["block_size"]),
        (dict(max_num_seqs=-1), ["max_num_seqs"]),
        (dict(num_blocks=1.5), ["num_blocks"]),
        (dict(threads=0), ["threads"]),
        (dict(gpu_memory_utilization=1.5), ["gpu_memory_utilization"]),
        (dict(attention_backend="cudnn"), ["attention_backend"]),
        (dict(mixed_step_graphs="yes"), ["mixed_step_graphs", "piecewise"]),
        (dict(grammar_threads=-1), ["grammar_threads"]),
        (dict(gemv_max_rows=0), ["gemv_max_rows"]),
        (dict(gemv_8bit_max_rows=0), ["gemv_8bit_max_rows", "[1, 2]"]),
        (dict(gemv_8bit_max_rows=3), ["gemv_8bit_max_rows", "MAX_ROWS"]),
        (dict(gemv_max_rows=17), ["gemv_max_rows", "16"]),
        (dict(w8a16_tensor_core_rows=1), ["w8a16_tensor_core_rows", "[2, 64]"]),
        (dict(w8a16_tensor_core_rows=65), ["w8a16_tensor_core_rows", "MAX_ROWS"]),
        (dict(fp8_mma_rows=65), ["fp8_mma_rows", "[0, 64]"]),
        (dict(fp8_mma_rows=-1), ["fp8_mma_rows", "MAX_ROWS"]),
        (dict(int8_mma_rows=65), ["int8_mma_rows", "[0, 64]"]),
        (dict(grammar_process=True, speculative_method="ngram"),
         ["grammar_process=True", "speculative_method='ngram'"]),
    ],
)
def test_invalid_fields_fail_with_their_names(fields, needles):
    with pytest.raises(ValueError) as info:
        EngineConfig(**fields)
    for needle in needles:
        assert needle in str(info.value)


def test_contiguous_without_prefix_caching_is_fine():
    EngineConfig(kv_cache="contiguous", prefix_caching=False)


def test_every_field_is_a_cli_flag():
    args = build_parser().parse_args([
        "generate", "hi", "--max-num-seqs", "3", "--no-prefix-caching", "--kv-cache",
        "contiguous", "--num-blocks", "7", "--batching-mode", "static",
    ])
    cfg = engine_config(args)
    assert (cfg.max_num_seqs, cfg.prefix_caching, cfg.kv_cache, cfg.num_blocks,
            cfg.batching_mode) == (3, False, "contiguous", 7, "static")
    assert cfg.block_size == EngineConfig().block_size


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_cpu_threads_leave_a_core_to_the_rest(monkeypatch, cores, threads):
    from infer.engine import cpu_threads

    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: cores)
    assert cpu_threads.default_cpu_threads() == threads


def test_a_cpu_engine_sets_its_threads():
    import torch
    from engine_fixtures import make_llm

    before = torch.get_num_threads()
    try:
        make_llm(threads=2)
        assert torch.get_num_threads() == 2
        make_llm()
        from infer.engine.cpu_threads import default_cpu_threads

        assert torch.get_num_threads() == default_cpu_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_a_cuda_engine_sets_torchs_host_threads_only_when_asked():
    import torch
    from tiny_model import tiny_model_dir

    from infer import LLM

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        LLM(str(tiny_model_dir()), device="cuda", num_blocks=64, max_model_len=128)
        assert torch.get_num_threads() == 3
        LLM(str(tiny_model_dir()), device="cuda", num_blocks=64, max_model_len=128, threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
