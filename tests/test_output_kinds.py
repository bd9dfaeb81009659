"""Output kinds (cumulative, delta, final only) and prompt forms, on SmolLM2: the three
kinds tell the same story; deltas never repeat anything (per-step work in proportion to
the new tokens), through the engine and through the server's streams."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
from engine_fixtures import make_llm
from server_fixtures import MODEL, live_server, shared_engine

from infer import RequestOutputKind, SamplingParams, TextPrompt, TokensPrompt

pytestmark = pytest.mark.slow  # `pytest -m 'not slow'`: the quick inner loop skips it

PARAMS = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=40, logprobs=2,
                        stop=[" the"], include_stop_str_in_output=True)


@pytest.fixture(scope="module")
def engine():
    return make_llm(num_blocks=128, max_model_len=512).engine


def _outputs(engine, kind: RequestOutputKind, rid: str, params=PARAMS, prompt="Once upon"):
    engine.add_request(rid, prompt, dataclasses.replace(params, output_kind=kind))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return outputs


def _final(outputs):
    return [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
             [sorted(e) for e in c.logprobs]) for c in outputs[-1].outputs]


def test_the_three_kinds_agree_and_deltas_never_repeat(engine):
    cumulative = _outputs(engine, RequestOutputKind.CUMULATIVE, "c")
    final = _outputs(engine, RequestOutputKind.FINAL_ONLY, "f")
    deltas = _outputs(engine, RequestOutputKind.DELTA, "d")
    assert len(final) == 1 and final[0].finished
    assert _final(final) == _final(cumulative)
    added: dict[int, list] = {0: ["", [], [], None], 1: ["", [], [], None]}
    for output in deltas:
        for c in output.outputs:
            acc = added[c.index]
            acc[0] += c.text
            acc[1] += c.token_ids
            acc[2] += [sorted(e) for e in c.logprobs]
            acc[3] = c.finish_reason
    want = {c.index: [c.text, c.token_ids, [sorted(e) for e in c.logprobs], c.finish_reason]
            for c in cumulative[-1].outputs}
    assert added == want
    assert any(c.finish_reason == "stop" for c in cumulative[-1].outputs)
    # each delta carries only sequences that changed, so an n=2 request whose sequences
    # finish at different steps has outputs with one completion
    assert any(len(o.outputs) == 1 for o in deltas) or len(deltas) == len(cumulative)


def test_decoding_work_per_token_does_not_grow_with_the_text(engine, monkeypatch):
    tok = engine.tokenizer
    real, windows = tok.decode, []

    def counting(ids, skip_special_tokens=True):
        windows.append(len(ids))
        return real(ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", counting)
    # The two-decode path, whose windows can be counted (tokenizers' DecodeStream keeps
    # the same window in Rust).
    monkeypatch.setattr(tok, "decode_stream", lambda skip_special_tokens=True: None)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True,
                            stop=["never appears in text"])
    [*_, last] = _outputs(engine, RequestOutputKind.DELTA, "long", params)
    assert len(last.outputs[0].token_ids) < 200 or last.finished
    assert max(windows) <= 16 and len(windows) <= 2 * 200 + 4, (max(windows), len(windows))


@pytest.mark.parametrize("form", ["text", "ids", "text dict", "ids dict", "typed"])
def test_prompt_forms(engine, form):
    ids = engine.tokenizer.encode("The capital of France is")
    prompt = {"text": "The capital of France is", "ids": ids,
              "text dict": {"prompt": "The capital of France is"},
              "ids dict": {"prompt_token_ids": ids},
              "typed": TokensPrompt(prompt_token_ids=ids)}[form]
    llm = make_llm(num_blocks=64, max_model_len=512)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    [out] = llm.generate(prompt, greedy, use_tqdm=False)
    assert out.prompt_token_ids == ids
    [again] = llm.generate([TextPrompt(prompt="The capital of France is")], greedy,
                           use_tqdm=False)
    assert out.outputs[0].token_ids == again.outputs[0].token_ids


@pytest.mark.parametrize(("prompt", "match"), [
    ({"prompt_ids": [1, 2]}, r"keys \['prompt_ids'\]"),
    ({"prompt": 3, "prompt_token_ids": [1]}, "a prompt dict must be"),  # text not a str
    ({"prompt_token_ids": "abc"}, "a prompt dict must be"),
    (3.5, "got float"),
    ([1, "a"], "got int"),  # a list of two prompts, the first an int
])
def test_prompt_forms_we_do_not_understand_are_refused_by_name(prompt, match):
    llm = make_llm(num_blocks=64, max_model_len=512)
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_server_streams_deltas_end_to_end(monkeypatch):
    engine = shared_engine()
    real, delivered = engine._deliver, []

    def deliver(outputs, now):
        delivered.extend(outputs)
        return real(outputs, now)

    monkeypatch.setattr(engine, "_deliver", deliver)
    with live_server(engine) as server:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    # What crossed from the core adds up to the answer exactly once: new token ids only.
    ids = [t for update in delivered for t in update.new_token_ids]
    assert len(ids) == 48
    assert engine.tokenizer.decode(ids) == text
    assert len(delivered) >= 40  # one delta per step, not one final output


QUIET = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)


def _core_outputs(engine, kind: RequestOutputKind, rid: str, steps: int | None = None):
    """What the core sent for `rid`'s sequences, step by step, and its request outputs."""
    engine.add_request(rid, "Once upon", dataclasses.replace(QUIET, output_kind=kind))
    sent: list[list] = []
    outputs = []
    core_step = engine.core.step

    def step():
        updates = core_step()
        sent.append([u for u in updates if u.seq_id.split("#")[0] == rid])
        return updates

    engine.core.step = step
    try:
        while engine.has_unfinished_requests() and (steps is None or len(sent) < steps):
            outputs += [o for o in engine.step() if o.request_id == rid]
    finally:
        del engine.core.step
    return sent, outputs


def test_a_final_only_sequence_is_sent_on_its_first_token_and_at_its_end(engine):
    """One final output, no stop strings, no logprobs: the core builds no output for the
    steps between its first token and its last, and the last carries every token not
    sent; the result is the cumulative run's."""
    sent, final = _core_outputs(engine, RequestOutputKind.FINAL_ONLY, "q")
    cumulative = _core_outputs(engine, RequestOutputKind.CUMULATIVE, "qc")[1]

    def ends(outputs):
        return [(c.index, c.text, c.token_ids, c.finish_reason) for c in outputs[-1].outputs]

    assert len(final) == 1 and ends(final) == ends(cumulative)
    for index in (0, 1):
        mine = [(step, u) for step, updates in enumerate(sent) for u in updates
                if u.seq_id == f"q#{index}"]
        assert len(mine) == 2, [(step, len(u.new_token_ids)) for step, u in mine]
        (first_step, first), (last_step, last) = mine
        assert len(first.new_token_ids) == 1 and last.finish_reason == "length"
        assert first.new_token_ids + last.new_token_ids == final[0].outputs[index].token_ids
        assert last_step - first_step == len(last.new_token_ids)  # one token a step between


def test_a_final_only_sequence_that_fails_returns_every_token_it_made(engine):
    """An error ending a quiet sequence mid-way sends the tokens it had not sent yet: the
    failed output holds everything generated, as it did when every step was sent."""
    sent, _ = _core_outputs(engine, RequestOutputKind.FINAL_ONLY, "e", steps=8)
    seq_ids = [s for s in engine.core.sequences if s.split("#")[0] == "e"]
    made = {s: list(engine.core.sequences[s].request.output_token_ids) for s in seq_ids}
    assert all(len(tokens) > 2 for tokens in made.values())
    assert sum(len(u.new_token_ids) for updates in sent for u in updates) == len(seq_ids)
    processed = engine.output_processor.process(
        engine.core._end_with_error(seq_ids, "RuntimeError: boom"), 0.0)
    (output,) = processed.outputs
    assert output.finished and output.error == "RuntimeError: boom"
    assert sorted(c.token_ids for c in output.outputs) == sorted(made.values())
    engine.step()  # a step launched ahead for them, if any, is accounted (and dropped)
    assert not engine.has_unfinished_requests() and engine.kv.pool.num_used == 0
