"""Structured output through the server: OpenAI's response_format and vLLM's
structured_outputs / guided_* fields, with the official openai client, on the real
SmolLM2; outputs checked with jsonschema and re, bad constraints refused by field name."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from server_fixtures import MODEL, live_server, shared_engine

from infer.server.constraints import ConstraintError, output_constraint
from infer.structured_outputs import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "population": {"type": "integer", "minimum": 0}}, "required": ["city", "population"]}
ASK = [{"role": "user", "content": "Name a big city and its population, as JSON."}]


@pytest.fixture(scope="module")
def server():
    with live_server(shared_engine()) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize(("fields", "expected", "field"), [
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}},
     StructuredOutputsParams(json_object=True), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY,
                                                                  "strict": True}}},
     StructuredOutputsParams(json=CITY), "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutputsParams(regex="a+"),
     "structured_outputs"),
    ({"guided_json": json.dumps(CITY)}, StructuredOutputsParams(json=json.dumps(CITY)),
     "guided_json"),
    ({"guided_choice": ["x", "y"]}, StructuredOutputsParams(choice=["x", "y"]), "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"'),
     "guided_grammar"),
])
def test_each_spelling_becomes_one_constraint(fields, expected, field):
    got = output_constraint(fields)
    assert got == (None if expected is None else (expected, field))


@pytest.mark.parametrize(("fields", "param", "match"), [
    ({"response_format": {"type": "xml"}}, "response_format", "json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c"}}},
     "response_format", "json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "only one"),
])
def test_mistakes_name_their_field(fields, param, match):
    with pytest.raises(ConstraintError, match=match) as info:
        output_constraint(fields)
    assert info.value.param == param


def test_response_format_json_schema_validates_stream_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                  "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60,
                                       temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    chunks = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60,
                                            temperature=0, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content


def test_parse_with_a_pydantic_model(client):
    class City(pydantic.BaseModel):
        city: str
        population: int

    r = client.beta.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=60,
                                           temperature=0, response_format=City)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.city


def test_json_object_on_completions_and_seeded_sampling(client):
    for seed in range(3):
        r = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=40,
                                      temperature=1.0, seed=seed,
                                      extra_body={"response_format": {"type": "json_object"}})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].text), dict)
        else:
            assert r.choices[0].finish_reason == "length"


def test_vllm_fields_regex_choice_grammar(client):
    r = client.completions.create(model=MODEL, prompt="The year is", max_tokens=10,
                                  temperature=0, extra_body={"guided_regex": r" [0-9]{4}"})
    assert re.fullmatch(r" [0-9]{4}", r.choices[0].text)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=5,
        temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="Say hi:", max_tokens=10, temperature=0,
                                  extra_body={"guided_grammar": 'root ::= " hi" | " hello"'})
    assert r.choices[0].text in (" hi", " hello")


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "integer",
                                                                  "minimum": "zero"}}}},
     "response_format"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_bad_constraints_get_400_naming_the_field(server, extra, param):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(server.url + "/v1/completions",
                    json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # the server goes on


def test_a_grammar_that_compiles_too_long_fails_only_its_request(server, client, monkeypatch):
    """The server compiles each new constraint in a thread under a time limit: one past it
    is a 400 naming its field, and the next constraint compiles in a fresh thread."""
    import time
    import uuid

    processor = server.engine.input_processor
    library = processor.structured_outputs()
    real = library._grammar

    def slow(kind, text):
        if "slowly" in text:
            time.sleep(2)
        return real(kind, text)

    monkeypatch.setattr(library, "_grammar", slow)
    monkeypatch.setattr(processor.compile_thread, "timeout_s", 0.5)
    tag = uuid.uuid4().hex[:8]
    started = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Say", "max_tokens": 4,
        "structured_outputs": {"regex": f"slowly{tag}[a-z]+"}})
    assert r.status_code == 400 and time.monotonic() - started < 1.8, r.text
    error = r.json()["error"]
    assert error["param"] == "structured_outputs"
    assert "took longer than 0.5 s" in error["message"]
    choices = [f"yes {tag}", f"no {tag}"]
    out = client.completions.create(model=MODEL, prompt="Say", max_tokens=20,
                                    extra_body={"guided_choice": choices})
    assert out.choices[0].text in choices
    server.wait_idle()
