"""The engine at tensor_parallel_size > 1 on this CPU (gloo): the same tokens as one rank
under every scheduling variant, the real SmolLM2 split over 3 ranks, clear start-up
errors, and a rank that dies: errors for the requests in flight, no hang, no process left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest
from checkpoints import save_random_checkpoint, save_word_tokenizer
from engine_fixtures import make_llm
from server_fixtures import live_server
from test_core_process import _descendants, _running, _wait_gone
from tiny_model import tiny_model_dir

from infer import LLM, SamplingParams
from infer.engine.config import EngineConfig
from infer.server import AsyncEngine

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")]
VOCAB = 97  # not a multiple of 2: the last rank's part of the vocabulary is padded
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny Llama with 8 query heads and 2 KV heads, 4 layers."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tp-llama")
    save_random_checkpoint(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False), path)
    save_word_tokenizer(path, VOCAB)
    return str(path)


PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((3, 17, 9, 30))]


def _tokens(llm: LLM, params=GREEDY, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def alone(model_dir) -> list[list[int]]:
    """Each prompt alone, on one rank."""
    llm = LLM(model_dir, device="cpu", num_blocks=64)
    return [_tokens(llm, prompts=[p])[0] for p in PROMPTS]


VARIANTS = {
    "continuous": dict(num_blocks=64),
    "synchronous": dict(num_blocks=64, async_scheduling=False),
    "chunked-small": dict(num_blocks=64, prefill_chunk_size=3, max_num_batched_tokens=8),
    "contiguous": dict(kv_cache="contiguous", prefix_caching=False, max_model_len=64,
                       max_num_seqs=4),
    "static": dict(num_blocks=64, batching_mode="static", max_num_seqs=2),
    "preempting": dict(num_blocks=10, block_size=4, prefix_caching=False),
    # No peer memory between CPU ranks: every rank must decline it alike and use gloo.
    "custom-all-reduce": dict(num_blocks=64, custom_all_reduce=True),
    "unfused-all-reduce-norm": dict(num_blocks=64, fuse_all_reduce_norm=False),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_give_one_ranks_tokens(model_dir, alone, variant):
    llm = LLM(model_dir, device="cpu", tensor_parallel_size=2, **VARIANTS[variant])
    try:
        assert _tokens(llm) == alone
        stats = llm.engine.stats()
        assert stats["kv_blocks_used"] == 0
        if variant == "preempting":
            assert stats["num_preemptions"] > 0
    finally:
        llm.engine.shutdown()


def test_two_ranks_with_an_fp8_kv_cache_give_one_ranks_tokens(model_dir):
    """`kv_cache_dtype="fp8"` under tensor parallelism (every rank builds its runner from
    the same config): the greedy tokens are one rank's with an FP8 cache."""
    one = LLM(model_dir, device="cpu", num_blocks=64, kv_cache_dtype="fp8")
    want = _tokens(one)
    two = LLM(model_dir, device="cpu", num_blocks=64, kv_cache_dtype="fp8",
              tensor_parallel_size=2)
    try:
        assert two.engine.info.kv_cache_dtype == "float8_e4m3fn"
        assert _tokens(two) == want
    finally:
        two.engine.shutdown()


def test_prefix_hits_sampling_and_prompt_logprobs_match_one_rank(model_dir, alone):
    one = LLM(model_dir, device="cpu", num_blocks=64, block_size=4)
    two = LLM(model_dir, device="cpu", num_blocks=64, block_size=4, tensor_parallel_size=2)
    try:
        assert _tokens(two) == alone
        again = two.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                             use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == alone
        assert two.engine.stats()["prefix_cache_hits"] > 0
        seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=11, n=2)
        assert _tokens(two, seeded) == _tokens(one, seeded)
        scored = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, logprobs=2)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        for a, b in zip(two.generate(prompts, scored, use_tqdm=False),
                        one.generate(prompts, scored, use_tqdm=False)):
            assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(b.prompt_logprobs)
            for x, y in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs,
                            b.prompt_logprobs[1:] + b.outputs[0].logprobs):
                assert {t: lp.rank for t, lp in x.items()} == {t: lp.rank for t, lp in y.items()}
                assert {t: lp.logprob for t, lp in x.items()} == pytest.approx(
                    {t: lp.logprob for t, lp in y.items()}, abs=1e-5)
    finally:
        two.engine.shutdown()


def test_smollm2_split_over_three_ranks_writes_the_same_text():
    """The real model: 9 query heads and 3 KV heads, one of each KV head per rank."""
    prompts = ["The capital of France is", "def fibonacci(n):\n    "]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    config = dict(num_blocks=64, max_model_len=256)
    want = [o.outputs[0].text for o in make_llm(**config).generate(prompts, params,
                                                                    use_tqdm=False)]
    llm = LLM(**config, device="cpu", quantization="none", tensor_parallel_size=3)
    try:
        got = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert got == want and all(want)


# ---------------------------------------------------------------- start-up errors


@pytest.mark.parametrize(("config", "message"), [
    (dict(tensor_parallel_size=3), "must divide the model's 4 attention heads"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    (dict(tensor_parallel_size=2, speculative_method="ngram"), "not supported yet"),
    (dict(tensor_parallel_size=2, device="cuda:1"), "CUDA_VISIBLE_DEVICES"),
])
def test_start_up_refuses_what_cannot_be_split(config, message):
    """Refused before any rank starts: nothing is left running."""
    before = set(_descendants(os.getpid()))
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_model_dir()), **{"device": "cpu", **config})
    assert {p for p in _descendants(os.getpid()) - before if _running(p)} == set()


def test_too_few_gpus_are_named():
    import torch

    from infer.distributed.checks import check_tensor_parallel
    from infer.engine.setup import model_config_of

    config = EngineConfig(tensor_parallel_size=2)
    mc = model_config_of(str(tiny_model_dir()))
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match=r"needs 2 GPUs, one per rank; \d visible"):
            check_tensor_parallel(config, mc, torch.device("cuda"))


# ---------------------------------------------------------------- a rank that dies


def _spawned(pid: int) -> set[int]:
    """The running processes under `pid` that multiprocessing spawned (its resource
    tracker is not one)."""
    found = set()
    for p in _descendants(pid):
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if _running(p) and "spawn_main" in cmdline:
            found.add(p)
    return found


def test_an_offline_engine_whose_rank_dies_raises_and_leaves_no_process(model_dir):
    before = _spawned(os.getpid())
    llm = LLM(model_dir, device="cpu", num_blocks=64, tensor_parallel_size=2)
    [worker] = _spawned(os.getpid()) - before
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, min_tokens=200)
    stream = llm.stream({"prompt_token_ids": PROMPTS[1]}, long)
    next(stream)
    os.kill(worker, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 exited \(exit code -9\)"):
        for _ in stream:
            pass
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)
    llm.engine.shutdown()
    _wait_gone({worker})


def test_a_server_whose_rank_dies_fails_its_streams_and_stops(model_dir):
    engine = AsyncEngine.launch(EngineConfig(model=model_dir, device="cpu", num_blocks=64,
                                             tensor_parallel_size=2))
    died = threading.Event()
    engine.on_core_death = died.set
    core = engine.core_pid
    try:
        [worker] = _spawned(core)
        with live_server(engine, "tp") as server:
            body = {"model": "tp", "prompt": [1, 2, 3], "max_tokens": 200, "min_tokens": 200,
                    "stream": True}
            events: list[str] = []
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        if not events:
                            os.kill(worker, signal.SIGKILL)
                        events.append(line[6:])
            assert any("error" in e for e in events), events[-3:]
            assert died.wait(30) and not engine.alive
            assert httpx.get(server.url + "/health").status_code == 503
    finally:
        engine.shutdown()
    _wait_gone({core, worker})


def test_workers_exit_when_rank_0_is_killed(model_dir):
    script = textwrap.dedent(f"""
        import os, time
        from infer import LLM
        llm = LLM({model_dir!r}, device="cpu", num_blocks=64, tensor_parallel_size=2)
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        workers = _spawned(proc.pid)
        assert len(workers) == 1
        proc.kill()
        proc.wait(10)
        _wait_gone(workers, 15)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ranks_started_as_torchrun_starts_them_meet_through_the_environment(model_dir):
    """Each rank its own `infer` command with RANK / WORLD_SIZE / MASTER_* set, as torchrun
    (or a launcher on each host) sets them: rank 0 writes the text, rank 1 only computes."""
    from tp_ranks import free_port

    command = [sys.executable, "-m", "infer.cli", "generate", "t5 t9 t3 t11", "--model",
               model_dir, "--device", "cpu", "--num-blocks", "64", "--max-tokens", "8",
               "--temperature", "0"]
    alone = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([*command, "--tensor-parallel-size", "2"],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    if [p.returncode for p in ranks] != [0, 0]:
        pytest.fail("\n".join(f"rank {r} exited {p.returncode}; stderr:\n{err[-3000:]}"
                               for r, (p, (_, err)) in enumerate(zip(ranks, outs))))
    assert outs[0][0] == alone.stdout and alone.stdout.strip()
    assert outs[1][0] == ""
