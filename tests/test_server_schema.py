"""Schemathesis against the app's own OpenAPI schema, on a live server over the tiny random
Llama: valid and invalid requests for every operation; none may get a 5xx, and every
error must carry an OpenAI error body."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from server_fixtures import tiny_server

from infer.server import build_app

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("transformers")

NAME = "tiny-llama"
SCHEMA = schemathesis.openapi.from_dict(build_app(None, NAME).openapi())
OPERATIONS = {op.label: op for op in (r.ok() for r in SCHEMA.get_all_operations())}
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
# Operations without inputs (GET /health) have no invalid requests to generate.
CASES = [(label, mode) for label, op in sorted(OPERATIONS.items())
         for mode in (POSITIVE, NEGATIVE) if mode is POSITIVE or len(op.body) or len(op.query)]
EXAMPLES = 25
# Valid requests may ask for a lot of work (n=128 over several prompts); keep each small.
CAPS = {"n": 2, "max_tokens": 8, "max_completion_tokens": 8}


@pytest.fixture(scope="module")
def server():
    with tiny_server(NAME) as s:
        yield s


def _small_and_served(case):
    """Valid cases name the served model (else all are 404s) and ask for little work."""
    body = case.body
    if isinstance(body, dict):
        if "model" in body:
            body["model"] = NAME
        for key, cap in CAPS.items():
            if isinstance(body.get(key), int) and body[key] > cap:
                body[key] = cap
        if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 4:
            body["prompt"] = body["prompt"][:4]
    return case


def _check(response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


@pytest.mark.parametrize(("label", "mode"), CASES, ids=[f"{lb}-{m.value}" for lb, m in CASES])
def test_no_server_errors(server, label, mode):
    strategy = OPERATIONS[label].as_strategy(generation_mode=mode)
    if mode is POSITIVE:
        strategy = strategy.map(_small_and_served)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        _check(case.call(base_url=server.url, timeout=60))

    run()
    server.wait_idle()
