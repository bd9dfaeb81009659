"""What a vLLM or OpenAI user expects of the server around the endpoints: CORS (preflights,
headers on every answer), GET /version, GET /v1/models/{id}, and --chat-template; each from
the `infer serve` flags through `build_app`."""

from __future__ import annotations

import asyncio
import importlib.metadata

import httpx
import openai
import pytest
from server_fixtures import live_server, make_tiny_engine
from tiny_model import tiny_model_dir

from infer import cli
from infer.cli import build_parser, load_chat_template, serve_app
from infer.loader.chat_template import ChatTemplateError
from infer.server import build_app

NAMES = ["org/tiny-llama", "tiny"]  # a slash, as HF names have
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
ORIGIN = "http://ui.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture(scope="module")
def engine():
    engine = make_tiny_engine(tiny_model_dir())
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with live_server(engine, NAMES, chat_template=TEMPLATE) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_a_preflight_is_answered_for_any_origin_by_default(server):
    r = httpx.options(server.url + "/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in r.headers
    r = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    # a page may read the ignored-fields header
    assert "x-infer-ignored-fields" in r.headers["access-control-expose-headers"].lower()


def test_cors_with_an_api_key_set_origins_and_credentials(engine):
    with live_server(engine, "tiny", api_key="sekret", allowed_origins=[ORIGIN],
                     allow_credentials=True) as server:
        url = server.url + "/v1/chat/completions"
        r = httpx.options(url, headers=PREFLIGHT)  # no key: a browser sends none here
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert r.headers["access-control-allow-credentials"] == "true"
        other = httpx.options(url, headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        # the 401 carries CORS headers, so the page can read why
        r = httpx.post(url, headers={"Origin": ORIGIN}, json={})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
        r = httpx.get(server.url + "/v1/models",
                      headers={"Origin": ORIGIN, "Authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        version = httpx.get(server.url + "/version")  # open, as /health
        assert version.status_code == 200


def test_version_is_the_installed_packages(server):
    r = httpx.get(server.url + "/version")
    assert r.status_code == 200
    assert r.json() == {"version": importlib.metadata.version("infer")}


def test_a_model_is_retrieved_by_its_served_name(server, client):
    for name in NAMES:
        model = client.models.retrieve(name)
        assert (model.id, model.object, model.owned_by) == (name, "model", "infer")
        assert model.model_extra["max_model_len"] == server.engine.max_model_len
    r = httpx.get(server.url + "/v1/models/org/tiny-llama")
    assert r.status_code == 200 and r.json()["id"] == "org/tiny-llama"
    assert [m.id for m in client.models.list()] == NAMES


def test_an_unknown_model_is_a_404_naming_the_served_ones(server, client):
    for path in ("gpt-9", "org/other", "org"):
        r = httpx.get(f"{server.url}/v1/models/{path}")
        assert r.status_code == 404
        error = r.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("NotFoundError", 404, "model")
        assert path in error["message"] and all(n in error["message"] for n in NAMES)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_the_chat_template_renders_tokenize_and_chat(server, client):
    tok = server.engine.tokenizer
    expected = tok.encode_chat(CHAT, True, chat_template=TEMPLATE)
    assert expected != tok.encode_chat(CHAT, True)  # the model's own differs
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "messages": CHAT})
    assert r.status_code == 200 and r.json()["tokens"] == expected
    assert tok.decode(expected, skip_special_tokens=False).endswith(
        "[user] What is 2+2?\n[assistant]")
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert out.usage.prompt_tokens == len(expected)
    server.wait_idle()


def test_a_template_that_does_not_compile_fails_at_start(capsys):
    with pytest.raises(ChatTemplateError, match="syntax error"):
        build_app(None, "tiny", chat_template="{% for m in messages %}")
    assert cli.main(["serve", "--device", "cpu", "--chat-template", "{% if %}"]) == 2
    err = capsys.readouterr().err
    assert "--chat-template" in err and "syntax error (line 1)" in err


def test_the_chat_template_flag_takes_a_path_or_the_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="cannot read the file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    path.write_bytes(b"\xff\xfe{{")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_chat_template(str(path))


@pytest.mark.parametrize(("argv", "origin", "allowed"), [
    ([], "http://any.example", "*"),
    (["--allowed-origins", ORIGIN, "http://b.example"], "http://b.example",
     "http://b.example"),
    (["--allowed-origins", f'["{ORIGIN}"]'], ORIGIN, ORIGIN),  # vLLM's older JSON form
    (["--allowed-origins", ORIGIN], "http://b.example", None),
    (["--allowed-origins", ORIGIN, "--allow-credentials"], ORIGIN, ORIGIN),
])
def test_the_cors_flags_reach_the_app(argv, origin, allowed):
    args = build_parser().parse_args(["serve", *argv])
    app = serve_app(args)  # no engine: CORS answers all the same

    async def preflight() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.options("/v1/completions", headers={**PREFLIGHT, "Origin": origin})

    r = asyncio.run(preflight())
    assert r.headers.get("access-control-allow-origin") == allowed
    assert (r.headers.get("access-control-allow-credentials") == "true") == (
        "--allow-credentials" in argv)


def test_the_cors_flags_refuse_a_broken_json_list(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "[oops"])
    assert "not a JSON list" in capsys.readouterr().err
