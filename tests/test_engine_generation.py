"""The engine on real models: greedy text equals transformers', and the sampling
features (seeds, stops, n, logprobs, min_tokens, abort) behave end to end."""

from __future__ import annotations

import math

import pytest
import torch
from engine_fixtures import gemma3_gguf, hf_greedy, make_llm, smollm2_gguf

from infer import SamplingParams

pytestmark = pytest.mark.slow  # `pytest -m 'not slow'`: the quick inner loop skips it


@pytest.fixture(scope="module")
def llm():
    return make_llm(num_blocks=128)


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_greedy_equals_transformers(which):
    path = smollm2_gguf() if which == "smollm2" else gemma3_gguf()
    llm = make_llm(path, num_blocks=64)
    tok = llm.get_tokenizer()
    prompts = ["The quick brown fox", "Water boils at a temperature of"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(path, ids, 10)
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)


def test_seeded_sampling_is_independent_of_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=8, seed=1234)
    alone = llm.generate("Tell me a joke.", params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = ["Hello there", "Tell me a joke.", "List three colors:"]
    others = SamplingParams(temperature=0.8, max_tokens=5)
    outs = llm.generate(crowd, [others, params, others], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_k=50, max_tokens=8, seed=99)
    assert llm.generate("Tell me a joke.", other_seed, use_tqdm=False)[0].outputs[0].token_ids \
        != alone


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    # Pick a stop string that starts inside one token and ends inside the next.
    text = full.text
    pieces = [llm.get_tokenizer().decode(full.token_ids[:i]) for i in range(len(full.token_ids))]
    boundary = len(pieces[3])
    stop = text[boundary - 2: boundary + 2]
    assert len(stop) == 4 and stop in text
    cut = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    streamed = [o.outputs[0].text for o in llm.stream("The capital of France is", cut)]
    final = streamed[-1]
    assert final == text[: text.index(stop)]
    assert all(stop not in s and final.startswith(s) for s in streamed)
    out = llm.generate("The capital of France is", cut, use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    keep = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                          include_stop_str_in_output=True)
    assert llm.generate("The capital of France is", keep, use_tqdm=False)[0].outputs[0].text \
        == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate("Count: one, two,", params, use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    target = full.token_ids[5]
    first = full.token_ids.index(target)
    stop = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                          stop_token_ids=[target])
    out = llm.generate("Count: one, two,", stop, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", target)


def test_eos_stops_unless_ignored_and_min_tokens(llm):
    tok = llm.get_tokenizer()
    chat = tok.encode_chat([{"role": "user", "content": "Say hi."}])
    out = llm.generate(chat, SamplingParams(temperature=0, max_tokens=64),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in tok.eos_token_ids
    n = len(out.token_ids)
    longer = llm.generate(chat, SamplingParams(temperature=0, max_tokens=n + 5, min_tokens=n + 2),
                          use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= n + 2
    assert not set(longer.token_ids[: n + 1]) & set(tok.eos_token_ids)


def test_logprobs_are_raw_model_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=4, ignore_eos=True)
    out = llm.generate([1, 2, 3, 4, 5], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    ids = out.prompt_token_ids + completion.token_ids
    model = llm.engine.model
    # Independent reference: the whole sequence through the paged runner in one prefill.
    from paged_runner import run_paged

    logits = run_paged(model, [ids], [len(ids)], block_size=16)[0].double()
    ref = torch.log_softmax(logits, dim=-1)
    total = 0.0
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(out.prompt_token_ids) - 1 + step]
        top = torch.topk(row, 4)
        assert entry[token].rank == 1  # greedy
        assert set(entry) == set(top.indices.tolist())
        for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert math.isclose(entry[tid].logprob, lp, abs_tol=1e-4)
        total += row[token].item()
    assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-3)


def test_n_completions_share_the_prompt(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7, ignore_eos=True)
    out = llm.generate("Name a fruit:", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate("Name a fruit:", params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    rid = engine.add_request(None, "A long story begins", SamplingParams(max_tokens=50))
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    assert engine.abort_request(rid)
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("x" * 20000, SamplingParams(), "prompt has"),
        ("", SamplingParams(), "empty"),
        ([10**9], SamplingParams(), "out of range"),
        ([1.5], SamplingParams(), "token ids"),
    ],
)
def test_bad_requests_are_rejected_before_queueing(prompt, params, match):
    llm = make_llm(num_blocks=64, max_model_len=512)
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request(None, prompt, params)
    assert not llm.engine.has_unfinished_requests()


def test_request_that_can_never_fit_the_pool_is_rejected():
    llm = make_llm(num_blocks=4, block_size=4, max_model_len=512)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.engine.add_request(None, "hello", SamplingParams(max_tokens=100))


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_text_decoded_once_at_the_end_equals_the_streamed_text(which, monkeypatch):
    """LLM.generate wants final outputs only, so without stop strings it decodes the text
    once at the end; it must equal the text built token by token for a stream."""
    from infer.engine.detokenizer import IncrementalDetokenizer

    llm = make_llm(gemma3_gguf() if which == "gemma3" else smollm2_gguf(), num_blocks=128)
    prompts = ["日本の首都は", "Party time 🎉🎉 and", "Ünïcödé façade, naïve café:",
               "def f(x):\n    return"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"s{i}", prompt, p)
    streamed = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] = out.outputs[0]
    pushes = []
    real_push = IncrementalDetokenizer.push
    monkeypatch.setattr(IncrementalDetokenizer, "push",
                        lambda self, t: pushes.append(t) or real_push(self, t))
    at_end = llm.generate(prompts, params, use_tqdm=False)
    assert not pushes
    for i, out in enumerate(at_end):
        assert out.outputs[0].token_ids == streamed[f"s{i}"].token_ids
        assert out.outputs[0].text == streamed[f"s{i}"].text
