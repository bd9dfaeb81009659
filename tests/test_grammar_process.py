"""Grammar matchers in a process of their own (`EngineConfig.grammar_process`): the engine
gives the same tokens as with matchers on its step loop, the worker's masks are the
library's own, its verdicts say when a grammar finished or refused a token, and a worker
that dies ends only the constrained sequences. The device's side of the handshake (a
kernel waiting on host memory, ids published to it) against hand-made counters, in the
Triton interpreter (`INFER_TEST_DEVICE=cuda`: on the GPU, over registered host memory)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from reference_tokenizers import ours

from infer.sampling_params import SamplingParams, StructuredOutputsParams

pytest.importorskip("llguidance")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else os.environ.get("INFER_TEST_DEVICE", "cpu")
PROMPT = "Reply in JSON. A person:"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "tags"]}


def _llm(grammar_process: bool, **config):
    from engine_fixtures import make_llm

    return make_llm(num_blocks=256, grammar_process=grammar_process, **config)


def _requests() -> tuple[list[str], list[SamplingParams]]:
    def constrained(seed: int, **kind) -> SamplingParams:
        return SamplingParams(max_tokens=40, temperature=0.8, seed=seed,
                              structured_outputs=StructuredOutputsParams(**kind))

    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    params = [constrained(1, json=SCHEMA), plain, constrained(2, regex=r"[a-c]{2,5}x"),
              constrained(3, choice=["red", "green", "a blue one"]),
              SamplingParams(max_tokens=30, temperature=0,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              constrained(4, json_object=True)]
    return [PROMPT] * len(params), params


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_worker_gives_the_tokens_the_step_loop_gives(async_scheduling):
    prompts, params = _requests()
    llm = _llm(True, async_scheduling=async_scheduling)
    worker = llm.generate(prompts, params, use_tqdm=False)
    core = llm.engine.core
    assert core._grammar_process is not None and core._grammar_process.process.is_alive()
    loop = _llm(False, async_scheduling=async_scheduling).generate(prompts, params,
                                                                    use_tqdm=False)
    assert [o.outputs[0].token_ids for o in worker] == [o.outputs[0].token_ids for o in loop]
    assert [o.outputs[0].finish_reason for o in worker] == \
        [o.outputs[0].finish_reason for o in loop]
    texts = [o.outputs[0].text for o in worker]
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in worker)
    if worker[0].outputs[0].finish_reason == "stop":
        pytest.importorskip("jsonschema").validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(r"[a-c]{2,5}x", texts[2]), texts[2]
    assert texts[3] in ("red", "green", "a blue one")
    assert llm.engine.stats()["kv_blocks_used"] == 0
    if async_scheduling:
        assert llm.engine.stats()["num_steps_launched_ahead"] > 0


def test_a_dead_worker_ends_the_constrained_sequences_only():
    prompts, params = _requests()
    llm = _llm(True)
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # the worker is up
    [alone] = _llm(False).generate(prompts[1:2], params[1:2], use_tqdm=False)
    process = llm.engine.core._grammar_process.process
    process.kill()
    process.join()
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    for i, p in enumerate(params):
        out = last[f"r{i}"]
        if p.structured_outputs is None:  # untouched, token for token
            assert out.outputs[0].token_ids == alone.outputs[0].token_ids
            assert out.error is None and out.outputs[0].finish_reason == "length"
        else:
            assert out.outputs[0].finish_reason == "error", out
            assert "grammar worker exited" in out.error
    assert llm.engine.stats()["kv_blocks_used"] == 0
    [after] = llm.generate(prompts[1:2], params[1:2], use_tqdm=False)
    assert after.outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.fixture(scope="module")
def worker():
    from infer.engine.grammar_process import GrammarProcess
    from infer.engine.structured_output import StructuredOutputs

    tokenizer = ours("smollm2")
    process = GrammarProcess(tokenizer, tokenizer.vocab_size, 4, torch.device("cpu"))
    yield process, StructuredOutputs(tokenizer, tokenizer.vocab_size)
    process.close()


def test_the_workers_masks_and_verdicts_are_the_librarys(worker):
    """Row masks equal the in-process library's for matchers fed the same tokens; a
    grammar that has taken its whole text is finished, a token outside it refused."""
    process, library = worker
    grammars = [library.compile(StructuredOutputsParams(regex=r"ab|cd")),
                library.compile(StructuredOutputsParams(json=SCHEMA))]
    remote = [process.matcher(g) for g in grammars]
    local = [library.matcher(g) for g in grammars]
    tokenizer = ours("smollm2")
    texts = ["ab", '{"name":"x","tags":["a"]}']
    plans = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    vocab = tokenizer.vocab_size
    for i in range(max(map(len, plans))):
        rows = [(row, m) for row, m in zip((0, 2), remote) if i < len(plans[row // 2])]
        logits = torch.zeros(3, vocab)
        step = process.mask(logits, rows)
        expected = library.allocate_masks(3)
        library.fill_masks([local[row // 2] for row, _ in rows], expected,
                           [row for row, _ in rows])
        for row, _ in rows:
            assert np.array_equal(process.layout.masks[row], expected[row].numpy())
            allowed = torch.isfinite(logits[row])
            assert allowed.sum() > 0 and allowed.sum() < vocab
        ids = torch.tensor([plans[row // 2][i] if row != 1 and i < len(plans[row // 2])
                            else 0 for row in range(3)])
        process.publish(step, ids, rows)
        assert process.verdicts(step, rows) == []
        for row, _ in rows:
            assert local[row // 2].accept(int(ids[row]))
    assert remote[0].terminated and remote[1].terminated
    assert local[0].terminated and local[1].terminated
    fresh = process.matcher(grammars[0])
    step = process.mask(torch.zeros(1, vocab), [(0, fresh)])
    bad = tokenizer.encode("zz", add_special_tokens=False)[0]
    process.publish(step, torch.tensor([bad]), [(0, fresh)])
    assert process.verdicts(step, [(0, fresh)]) == [0]
    process.drop([fresh, *remote])


def test_a_grammar_the_worker_cannot_take_is_a_value_error(worker):
    process, _ = worker
    with pytest.raises(ValueError, match="structured_outputs"):
        process.matcher('{"grammars": [{"lark_grammar": "start: nonsense_rule"}]}')


def _host_words(n: int) -> torch.Tensor:
    """Host memory the device reads and writes: registered (pinned) on CUDA."""
    words = torch.zeros(n, dtype=torch.int64)
    return words.pin_memory() if DEVICE != "cpu" else words


def test_the_device_waits_for_a_host_counter_and_says_when_it_gave_up():
    from infer.kernels.host_signal import wait_for_host

    counter, gave_up = _host_words(1), _host_words(1)
    counter[0] = 7
    wait_for_host(counter, gave_up, 7)
    wait_for_host(counter, gave_up, 3)
    torch.cuda.synchronize() if DEVICE != "cpu" else None
    assert gave_up[0] == 0
    wait_for_host(counter, gave_up, 8, max_polls=100)
    torch.cuda.synchronize() if DEVICE != "cpu" else None
    assert gave_up[0] == 8


@pytest.mark.parametrize("n", [1, 300, 1500])
def test_ids_are_published_to_the_host_with_their_stamp(n):
    from infer.kernels.host_signal import publish_to_host

    ids = torch.randint(0, 2**31 - 1, (n,), dtype=torch.int32, device=DEVICE)
    out, stamp = _host_words(n + 1), _host_words(1)
    out[n] = -5  # past the ids: untouched
    publish_to_host(ids, out, stamp, 42)
    torch.cuda.synchronize() if DEVICE != "cpu" else None
    assert stamp[0] == 42
    assert torch.equal(out[:n], ids.cpu().to(torch.int64)) and out[n] == -5
