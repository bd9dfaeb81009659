"""Constrained decoding with the grammar library on the real SmolLM2 vocabulary: whatever
tokens a sampler picks among the allowed ones, an output that ends (the grammar takes its
stop token, or allows nothing else) is valid, checked by independent parsers (json +
jsonschema, re.fullmatch)."""

from __future__ import annotations

import json
import re
from functools import cache

import pytest
import torch
from reference_tokenizers import ours

from infer.engine.structured_output import StructuredOutputs
from infer.sampling_params import SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0,
                                              "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -5,
                                            "maximum": 5}}, "required": ["x"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
     "required": ["ok", "note"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME,
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"},
                                              "minItems": 2, "maxItems": 2}},
     "required": ["ids"]},
    {"type": "object", "properties": {"code": {"type": "string",
                                               "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"owner": {"type": "object", "properties": {
        "name": NAME, "age": {"type": "integer", "minimum": 0}}, "required": ["name"]}},
     "required": ["owner"]},
    {"type": "object", "properties": {"name": NAME, "nick": NAME}, "required": ["name"]},
    {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                "required": ["a"]},
               {"type": "object", "properties": {"b": {"type": "boolean"}},
                "required": ["b"]}]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "maxItems": 4},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {
        "q": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 2}},
        "required": ["q"]}}, "required": ["p"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer"},
                                      "y": {"type": "integer"}},
     "required": ["kind", "x", "y"]},
    {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"},
                                                      {"type": "string", "maxLength": 4}]}},
     "required": ["v"]},
    {"type": "object", "properties": {"ratio": {"type": "number", "exclusiveMinimum": 0,
                                                "maximum": 1}}, "required": ["ratio"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "qty": {
            "type": "integer", "minimum": 1}}, "required": ["id", "qty"]}}},
     "required": ["items"]},
    {"type": "object", "properties": {"date": {"type": "string",
                                               "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
     "required": ["date"]},
    {"type": "boolean"},
]


@cache
def _so() -> StructuredOutputs:
    tok = ours("smollm2")
    return StructuredOutputs(tok, tok.vocab_size)


@cache
def _closing_bonus() -> torch.Tensor:
    """Tokens that close things (quotes, brackets, digits, the stop token) get a head start,
    so random walks end within the budget; any allowed token may still be chosen."""
    tok = ours("smollm2")
    bonus = torch.zeros(tok.vocab_size)
    for token_id in range(tok.vocab_size):
        text = tok.decode([token_id], skip_special_tokens=False)
        if text and len(text) <= 2 and any(c in '"]})0123456789,' for c in text):
            bonus[token_id] = 3.0
    for eos in tok.eos_token_ids:
        bonus[eos] = 6.0
    return bonus


def _walk(params: StructuredOutputsParams, seed: int, max_tokens: int = 120):
    """Sample among the allowed tokens with random logits until the grammar is finished:
    (text, ended). Each pick is checked against the mask independently, and a finished
    grammar must allow nothing but the stop token."""
    so, tok = _so(), ours("smollm2")
    matcher = so.matcher(so.compile(params))
    masks = so.allocate_masks(1)
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(max_tokens):
        so.fill_masks([matcher], masks)
        logits = torch.randn(1, tok.vocab_size, generator=gen) + _closing_bonus()
        so.apply_masks(logits, masks)
        allowed = torch.isfinite(logits[0])
        assert allowed.any(), "the grammar allows no token"
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
        bit = (int(masks[0, token // 32]) >> (token % 32)) & 1
        assert bit == 1 and bool(allowed[token])
        assert matcher.accept(token)
        if token in tok.eos_token_ids:
            assert matcher.terminated
            return tok.decode(ids), True
        ids.append(token)
        if matcher.terminated:
            so.fill_masks([matcher], masks)
            logits = torch.zeros(1, tok.vocab_size)
            so.apply_masks(logits, masks)
            assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) <= set(
                tok.eos_token_ids)
            return tok.decode(ids), True
    return tok.decode(ids), False


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_outputs_that_end_validate(index):
    schema = SCHEMAS[index]
    ended = 0
    for seed in range(4):
        text, done = _walk(StructuredOutputsParams(json=schema), seed)
        if done:
            ended += 1
            jsonschema.validate(json.loads(text), schema)
    assert ended >= 1  # the test must see at least one finished output


def test_json_object_regex_and_choice_outputs():
    for seed in range(3):
        text, done = _walk(StructuredOutputsParams(json_object=True), seed)
        assert not done or isinstance(json.loads(text), dict)
        text, done = _walk(StructuredOutputsParams(regex=r"[a-c]{2,5}-\d{1,3}"), seed)
        assert done and re.fullmatch(r"[a-c]{2,5}-\d{1,3}", text), text
        choices = ["positive", "negative", "very neutral"]
        text, done = _walk(StructuredOutputsParams(choice=choices), seed)
        assert done and text in choices, text


def test_a_grammar_ends_only_where_it_accepts():
    grammar = 'root ::= "(" digits ")"\ndigits ::= [0-9] | [0-9] digits'
    tok = ours("smollm2")
    for seed in range(3):
        text, done = _walk(StructuredOutputsParams(grammar=grammar), seed)
        assert done and re.fullmatch(r"\(\d+\)", text), text
    # Before the closing parenthesis the stop token is masked out.
    so = _so()
    matcher = so.matcher(so.compile(StructuredOutputsParams(grammar=grammar)))
    for token in tok.encode("(12", add_special_tokens=False):
        assert matcher.accept(token)
    masks = so.allocate_masks(1)
    so.fill_masks([matcher], masks)
    eos = tok.eos_token_ids[0]
    assert (int(masks[0, eos // 32]) >> (eos % 32)) & 1 == 0


def test_unconstrained_rows_are_left_alone():
    so = _so()
    matchers = [so.matcher(so.compile(StructuredOutputsParams(choice=["yes", "no"])))]
    masks = so.allocate_masks(2)
    so.fill_masks(matchers, masks)
    logits = torch.randn(2, so.vocab_size)
    before = logits.clone()
    so.apply_masks(logits, masks, rows=[0])
    assert torch.equal(logits[1], before[1])
    kept = torch.isfinite(logits[0])
    assert 0 < int(kept.sum()) < 10 and torch.equal(logits[0][kept], before[0][kept])


def test_sampler_masks_allow_every_token_on_the_rows_no_grammar_masks():
    so = _so()
    matcher = so.matcher(so.compile(StructuredOutputsParams(choice=["yes", "no"])))
    so.step_masks(3).zero_()  # what a step before left: stale bits on every row
    masks = so.sampler_masks(3, [(1, matcher)], torch.device("cpu"))
    alone = so.allocate_masks(1)
    so.fill_masks([matcher], alone)
    assert (masks[[0, 2]] == -1).all()
    assert torch.equal(masks[1], alone[0]) and (alone[0] != -1).any()


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "non-empty"),
    ({"choice": "ab"}, "non-empty list"),
    ({"regex": 5}, "non-empty string"),
    ({"json": 3}, "JSON schema"),
])
def test_malformed_params_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": {"type": "nonsense"}}, "structured_outputs.json"),
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"grammar": "root ::= ("}, "structured_outputs.grammar"),
])
def test_constraints_the_library_cannot_compile_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        _so().compile(StructuredOutputsParams(**kwargs))


def test_objects_are_closed_unless_the_schema_says_otherwise():
    from infer.structured_outputs import closed_objects

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "open": {"type": "object", "additionalProperties": True},
        "list": {"type": "array", "items": {"properties": {"c": {}}}},
        "either": {"anyOf": [{"type": "object"}, {"type": "string"}]},
        "lit": {"enum": [{"type": "object"}], "default": {"type": "object"}}},
        "$defs": {"d": {"type": "object"}}}
    closed = {"type": "object", "additionalProperties": False, "properties": {
        "a": {"type": "object", "additionalProperties": False,
              "properties": {"b": {"type": "integer"}}},
        "open": {"type": "object", "additionalProperties": True},
        "list": {"type": "array", "items": {"properties": {"c": {}},
                                            "additionalProperties": False}},
        "either": {"anyOf": [{"type": "object", "additionalProperties": False},
                             {"type": "string"}]},
        "lit": {"enum": [{"type": "object"}], "default": {"type": "object"}}},
        "$defs": {"d": {"type": "object", "additionalProperties": False}}}
    assert closed_objects(schema) == closed
    # In use: after the one property it names, an object may only close.
    so, tok = _so(), ours("smollm2")
    matcher = so.matcher(so.compile(StructuredOutputsParams(json=SCHEMAS[0])))
    assert all(matcher.accept(t) for t in tok.encode('{"name":"x"', add_special_tokens=False))
    masks = so.allocate_masks(1)
    so.fill_masks([matcher], masks)
    logits = torch.zeros(1, so.vocab_size)
    so.apply_masks(logits, masks)
    allowed = {tok.decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten().tolist()}
    assert "}" in allowed and not any("," in text for text in allowed)


# -- in the engine, on the real SmolLM2 ------------------------------------------------
ENGINE_SCHEMAS = [SCHEMAS[i] for i in (0, 1, 4, 5, 6, 12, 15)]
PROMPT = "Answer in JSON. A record for a small grey cat named Tom who is 3 years old:"


@cache
def _llm(async_scheduling: bool = True):
    from engine_fixtures import make_llm

    return make_llm(num_blocks=256, async_scheduling=async_scheduling)


def _constrained(seed: int, **constraint) -> SamplingParams:
    return SamplingParams(max_tokens=48, temperature=0.7, seed=seed,
                          structured_outputs=StructuredOutputsParams(**constraint))


def test_the_engine_generates_outputs_that_validate():
    llm = _llm()
    params = [_constrained(seed, json=schema) for schema in ENGINE_SCHEMAS for seed in (1, 2)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    stopped = 0
    for out, p in zip(outs, params):
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(c.text), p.structured_outputs.json)
    assert stopped >= len(params) // 2
    [choice, regex] = llm.generate(
        [PROMPT, PROMPT], [_constrained(3, choice=["cat", "dog", "a grey cat"]),
                           _constrained(4, regex=r"Tom is [0-9] years old\.")],
        use_tqdm=False)
    assert choice.outputs[0].text in ("cat", "dog", "a grey cat")
    assert choice.outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"Tom is [0-9] years old\.", regex.outputs[0].text)
    assert llm.engine.stats()["num_steps_launched_ahead"] > 0  # the async path ran


def test_launching_ahead_changes_nothing_and_neighbours_are_untouched():
    greedy = [SamplingParams(max_tokens=32, temperature=0,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for schema in ENGINE_SCHEMAS[:4]]
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [PROMPT] * len(greedy) + ["The capital of France is"]
    ahead = _llm(True).generate(prompts, [*greedy, plain], use_tqdm=False)
    in_step = _llm(False).generate(prompts, [*greedy, plain], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ahead] == [o.outputs[0].token_ids for o in in_step]
    [alone] = _llm(True).generate(prompts[-1:], [plain], use_tqdm=False)
    assert alone.outputs[0].token_ids == ahead[-1].outputs[0].token_ids


def test_a_bad_constraint_is_refused_and_the_engine_goes_on():
    llm = _llm()
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        llm.generate(PROMPT, _constrained(1, regex="(unclosed"), use_tqdm=False)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a"))
    [out] = llm.generate(PROMPT, _constrained(1, choice=["yes", "no"]), use_tqdm=False)
    assert out.outputs[0].text in ("yes", "no")
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_an_engine_in_one_process_sets_up_the_grammar_library_once():
    engine = _llm().engine
    assert engine.input_processor.structured_outputs() is engine.core.structured_outputs()


def test_properties_come_in_the_order_the_schema_lists_them():
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"},
                                               "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"]}
    for seed in range(3):
        text, done = _walk(StructuredOutputsParams(json=schema), seed)
        assert done and text.startswith('{"zeta":') and json.loads(text).keys() == {
            "zeta", "alpha"}, text


def test_the_step_mask_buffer_grows_and_is_reused():
    so = StructuredOutputs(ours("smollm2"), ours("smollm2").vocab_size)
    assert so.step_masks(2).shape[0] == 2
    grown = so.step_masks(5)
    assert grown.shape == (5, (so.vocab_size + 31) // 32)
    assert so.step_masks(3).data_ptr() == grown.data_ptr()  # reused, not reallocated
    assert so.step_masks(11).shape[0] == 11


def test_a_core_sets_up_the_grammar_library_in_the_background():
    from infer.engine.config import EngineConfig
    from infer.engine.engine_core import EngineCore

    engine = _llm().engine  # a second core over the same weights, its library not made
    core = EngineCore(EngineConfig(device="cpu", num_blocks=16), engine.model,
                      engine.model_config, torch.device("cpu"), torch.float32, 128, (0,),
                      engine.tokenizer)
    assert core.grammars._library is None
    thread = core.warm_structured_outputs()
    thread.join(120)
    library = core.grammars._library
    assert library is not None and core.structured_outputs() is library


def test_a_core_compiles_grammars_off_its_step_loop(monkeypatch):
    """A core that meets a constraint first (as one in its own process does) compiles it
    in its grammar thread: the others keep stepping meanwhile, a compile past the time
    limit fails only its own request, and one that finishes in time is served."""
    import itertools
    import time
    import uuid

    engine = _llm().engine
    structured = engine.core.structured_outputs()
    monkeypatch.setattr(engine.input_processor, "compile_constraint", lambda *a, **k: None)
    real = structured._grammar

    def slow_for_some(kind, text):
        if "slow" in text:
            time.sleep(float(text.split("slow")[1][:3]))
        return real(kind, text)

    monkeypatch.setattr(structured, "_grammar", slow_for_some)
    monkeypatch.setattr(engine.core.grammars.compile_thread, "timeout_s", 0.6)
    tag = uuid.uuid4().hex[:8]  # constraints no earlier test compiled
    requests = {
        "plain": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        "too-slow": _constrained(1, regex=f"slow1.5{tag}[a-z]+"),
        "slow-enough": _constrained(2, regex=f"slow0.2{tag}[a-z]+"),
        "hit": _constrained(3, choice=["yes", "no"]),  # compiled by an earlier test
    }
    for rid, params in requests.items():
        engine.add_request(rid, "The capital of France is", params)
    done, plain_tokens_at = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "plain":
                plain_tokens_at[time.monotonic()] = len(out.outputs[0].token_ids)
            if out.finished:
                done[out.request_id] = out
    assert "took longer than 0.6 s" in done["too-slow"].error
    assert done["slow-enough"].error is None
    assert re.fullmatch(f"slow0.2{tag}[a-z]+", done["slow-enough"].outputs[0].text)
    assert done["hit"].outputs[0].text in ("yes", "no") and done["plain"].error is None
    assert len(done["plain"].outputs[0].token_ids) == 24
    assert engine.stats()["kv_blocks_used"] == 0
    # the plain request's tokens kept coming while the 1.5 s compile ran (a compile on the
    # step loop would have held them for the 0.6 s until it was given up; a step of this
    # model took up to 0.404 s on a loaded 2-core machine)
    times = sorted(plain_tokens_at)
    assert len(times) > 10 and max(b - a for a, b in itertools.pairwise(times)) < 0.5


def test_masks_are_filled_only_into_a_whole_int32_cpu_matrix():
    """The library writes through the buffer's pointer: a buffer of another type or
    layout is refused by name, before the library could write past it."""
    so = _so()
    matcher = so.matcher(so.compile(StructuredOutputsParams(regex="[0-9]+")))
    good = so.allocate_masks(2)
    for bad in (good.float(), good[:, ::2], good[0]):
        with pytest.raises(ValueError, match="contiguous 2-D int32 CPU tensor"):
            so.fill_masks([matcher], bad)
        with pytest.raises(ValueError, match="contiguous 2-D int32 CPU tensor"):
            so.fill_masks_with_drafts([(0, matcher, [])], bad)
    so.fill_masks([matcher], good, [1])
    assert good[1].any() and not good[0].any()
