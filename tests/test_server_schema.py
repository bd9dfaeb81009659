"""Schemathesis against the app's own OpenAPI schema, on a live server over the tiny random
Llama: generated (fuzzing) and boundary (coverage) requests, valid and invalid, for every
operation. Every response must pass schemathesis's conformance checks (status code,
content type, headers, body schema, valid data accepted, invalid data refused, 405 with
Allow for undeclared methods), get no 5xx, and carry an OpenAI error body when an error."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from server_fixtures import tiny_server

from infer.server import build_app

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("transformers")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

pytestmark = pytest.mark.slow  # `pytest -m 'not slow'`: the quick inner loop skips it

NAME = "tiny-llama"
SCHEMA = schemathesis.openapi.from_dict(build_app(None, NAME).openapi())
OPERATIONS = {op.label: op for op in (r.ok() for r in SCHEMA.get_all_operations())}
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
# Operations without inputs (GET /health) have no invalid requests to generate.
CASES = [(label, mode) for label, op in sorted(OPERATIONS.items())
         for mode in (POSITIVE, NEGATIVE) if mode is POSITIVE or len(op.body) or len(op.query)]
EXAMPLES = 25
# Valid requests may ask for a lot of work (n=128 over several prompts); keep each small.
CAPS = {"n": 2, "max_tokens": 8, "max_completion_tokens": 8, "min_tokens": 2}
TINY_VOCAB = 256  # ids below this exist in the tiny byte-level vocabulary
# Schema-valid requests refused on purpose (docs/architecture.md, "The OpenAPI schema"):
# fields declared for OpenAI compatibility but refused unless left at their no-op value,
# and a prompt over the context length (counted in tokens, which no schema can say).
# Output constraints and tools are free-form objects and strings to the schema; a random
# one is refused by the grammar library or the tool checks, naming its field.
REFUSED_PARAMS = {"echo", "suffix", "best_of", "logit_bias", "tools", "tool_choice",
                  "chat_template_kwargs", "response_format", "structured_outputs",
                  "guided_json", "guided_regex", "guided_choice", "guided_grammar"}
CONTEXT_LENGTH = "context_length_exceeded"


@pytest.fixture(scope="module")
def server():
    with tiny_server(NAME) as s:
        yield s


def _ints(value):
    """JSON Schema counts 2.0 as an integer; the server's strict types do not (on purpose)."""
    if isinstance(value, list):
        return [_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _in_vocab(value):
    if isinstance(value, list):
        return [_in_vocab(v) for v in value]
    return value % TINY_VOCAB if type(value) is int else value


def _served(case):
    """A valid case made to fit what the schema cannot say: the served model's name and
    vocabulary, the rules across fields, and little work."""
    model_id = (case.path_parameters or {}).get("model_id")
    if isinstance(model_id, str) and len(model_id) % 2 == 0:  # the others: a 404
        case.path_parameters["model_id"] = NAME
    if not isinstance(case.body, dict):
        return case
    body = case.body = _ints(case.body)
    if "model" in body:
        body["model"] = NAME
    for key, cap in CAPS.items():
        if isinstance(body.get(key), int) and body[key] > cap:
            body[key] = cap
    if isinstance(body.get("prompt"), list):
        body["prompt"] = _in_vocab(body["prompt"][:4])
    for key in ("tokens", "stop_token_ids"):
        if isinstance(body.get(key), list):
            body[key] = _in_vocab(body[key])
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if limit is not None and body.get("min_tokens", 0) > limit:
        body["min_tokens"] = limit  # min_tokens <= max_tokens
    if body.get("top_logprobs") is not None:
        body["logprobs"] = True  # top_logprobs needs logprobs
    if body.get("stream_options") is not None:
        body["stream"] = True  # stream_options needs stream
    if body.get("stream"):  # prompt logprobs and echoed logprobs are not streamed
        body.pop("prompt_logprobs", None)
        if body.get("echo"):
            body.pop("logprobs", None)
    if body.get("max_tokens") == 0 and not (body.get("echo") and not body.get("stream")):
        body["max_tokens"] = 1  # 0 only scores an echoed prompt
    if body.get("logit_bias"):  # keys are token ids
        body["logit_bias"] = {"1": 0.5}
    return case


def _refused_on_purpose(response) -> bool:
    if response.status_code != 400:
        return False
    error = response.json()["error"]
    return error["code"] == CONTEXT_LENGTH or error["param"] in REFUSED_PARAMS


def _check(case, response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400 and response.request.method != "HEAD":
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    excluded = [positive_data_acceptance] if _refused_on_purpose(response) else []
    case.validate_response(response, excluded_checks=excluded)


@pytest.mark.parametrize(("label", "mode"), CASES, ids=[f"{lb}-{m.value}" for lb, m in CASES])
def test_generated_requests(server, label, mode):
    strategy = OPERATIONS[label].as_strategy(generation_mode=mode)
    if mode is POSITIVE:
        strategy = strategy.map(_served)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        _check(case, case.call(base_url=server.url, timeout=60))

    run()
    server.wait_idle()


def _boundary_cases(operation, modes):
    return SCHEMA.iter_coverage_cases(
        operation, generation_modes=modes,
        generation_config=SCHEMA.config.generation_for(operation=operation))


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_boundary_requests(server, label):
    """Schemathesis's coverage phase: each bound at and past its edge, missing and extra
    fields, wrong types, and the HTTP methods the schema does not declare."""
    for case in _boundary_cases(OPERATIONS[label], [POSITIVE, NEGATIVE]):
        if case.meta.generation.mode is POSITIVE:
            _served(case)
        _check(case, case.call(base_url=server.url, timeout=60))
    server.wait_idle()


def test_answers_while_loading():
    """Before the model has loaded every operation answers the documented 503 (but GET
    /version, which needs no model)."""
    app = build_app(None, NAME)
    for label, operation in OPERATIONS.items():
        case = _served(next(iter(_boundary_cases(operation, [POSITIVE]))))
        response = case.call(app=app)
        assert response.status_code == (200 if label == "GET /version" else 503), response.text
        case.validate_response(response, excluded_checks=[not_a_server_error])
