"""HTTP details: HEAD /health, the 401 challenge, and an OpenAPI schema that documents
what the server answers (400 not 422, the error body, non-JSON bodies)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_fixtures import MODEL, live_server, shared_engine

from infer.server import build_app

KEY = "sekret"
ERROR_REF = "#/components/schemas/ErrorResponse"


@pytest.fixture(scope="module")
def server():
    with live_server(shared_engine(), api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def schema(server):
    r = httpx.get(server.url + "/openapi.json")
    assert r.status_code == 200
    return r.json()


def test_head_health(server):
    r = httpx.head(server.url + "/health")
    assert r.status_code == 200 and r.content == b""
    get = httpx.get(server.url + "/health")
    assert get.status_code == 200 and get.content == b""


def test_head_health_while_loading():
    async def run():
        transport = httpx.ASGITransport(app=build_app(None, MODEL))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.head("/health"), await c.get("/health")

    head, get = asyncio.run(run())
    assert head.status_code == 503 and get.status_code == 503


@pytest.mark.parametrize("auth", [None, "Bearer wrong", KEY])
def test_401_carries_the_bearer_challenge(server, auth):
    headers = {"Authorization": auth} if auth else {}
    for r in (httpx.get(server.url + "/v1/models", headers=headers),
              httpx.post(server.url + "/v1/completions", headers=headers,
                         json={"model": MODEL, "prompt": "hi", "max_tokens": 1})):
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == 401
    ok = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and "www-authenticate" not in ok.headers


def test_openapi_has_no_422(schema):
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text


def test_openapi_documents_the_errors_of_completions(schema):
    responses = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "401", "404", "413", "500", "503", "504"} <= set(responses)
    for status in ("400", "401", "404", "413", "500", "503", "504"):
        assert responses[status]["content"] == {"application/json": {"schema": {"$ref": ERROR_REF}}}
    assert responses["503"]["headers"]["Retry-After"]["required"]
    assert responses["401"]["headers"]["WWW-Authenticate"]["required"]
    ok = responses["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/CompletionResponse"}
    assert "text/event-stream" in ok
    detail = schema["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}


def test_openapi_non_json_bodies(schema):
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain; version=0.0.4; charset=utf-8"]
    assert metrics["text/plain; version=0.0.4; charset=utf-8"]["schema"] == {"type": "string"}
    health = schema["paths"]["/health"]
    assert set(health) == {"get", "head"}
    for operation in health.values():
        assert "content" not in operation["responses"]["200"]
        assert operation["responses"]["503"]["content"]["application/json"]["schema"] == {
            "$ref": ERROR_REF}
