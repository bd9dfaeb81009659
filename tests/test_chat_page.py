"""The chat page at `GET /`: its files are served without the API key and load nothing
from other hosts; in headless Chromium it takes the key, names the model, shows server
errors, streams a reply, stops it (the server aborts the request) and renders markdown
without letting the model's text inject markup."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_fixtures import LiveServer, live_server, make_tiny_engine
from tiny_model import tiny_model_dir

NAME = "tiny-chat"
KEY = "sk-chat-page-test"
CONTEXT = 16384
# tokens: ~10 s of generation on the tiny model (4,000 took 2.6 s on a 2-core CPU with its
# C++ kernels), long enough to press Stop however slowly the browser gets to it
LONG_REPLY = 16000
ASSETS = {"static/chat.css": "text/css", "static/markdown.js": "text/javascript",
          "static/chat.js": "text/javascript"}


def _long_context_tiny_model() -> Path:
    """The tiny random Llama with room for a reply of LONG_REPLY tokens (its rotary
    embedding works at any position; only the declared limit is raised)."""
    path = Path(tempfile.mkdtemp(prefix="infer-chat-page-")) / "tiny"
    shutil.copytree(tiny_model_dir(), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config,
                                                  "max_position_embeddings": CONTEXT}))
    return path


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engine = make_tiny_engine(_long_context_tiny_model(), max_model_len=CONTEXT,
                              num_blocks=CONTEXT // 8 + 8)
    try:
        with live_server(engine, NAME, api_key=KEY) as s:
            yield s
    finally:
        engine.shutdown()


def test_page_and_its_files_are_served_without_the_key(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    linked = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(linked) == sorted(ASSETS)
    bodies = [page.text]
    for asset, media_type in ASSETS.items():
        response = httpx.get(f"{server.url}/{asset}")
        assert response.status_code == 200, asset
        assert response.headers["content-type"].split(";")[0] == media_type
        bodies.append(response.text)
    for body in bodies:  # offline: no CDN, fonts or scripts from other hosts
        assert not re.findall(r"https?://|//[\w-]+\.[\w.-]+/", body)
    assert httpx.get(server.url + "/static/missing.js").status_code == 401  # only its files
    assert httpx.get(server.url + "/v1/models").status_code == 401
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert models.status_code == 200


def test_page_routes_stay_out_of_the_api_schema(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    assert not [p for p in schema["paths"] if p == "/" or p.startswith("/static")]


# --- in a browser ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("the browser tests need Debian's chromium and chromium-driver "
                    "(apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="infer-chat-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--disable-quic", "--window-size=1280,800",
                f"--user-data-dir={profile}"):
        options.add_argument(arg)
    # An explicit driver path: Selenium Manager never looks for one on the network.
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(driver, condition, timeout: float = 10.0, message: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        lambda d: condition(d), message)


def _text(driver, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById('{element_id}').value "
                                 f"?? document.getElementById('{element_id}').textContent")


def _set(driver, element_id: str, value: str) -> None:
    """Types `value` into a field as a user would (so its input/change events fire)."""
    from selenium.webdriver.common.keys import Keys

    field = driver.find_element("id", element_id)
    field.clear()
    field.send_keys(value, Keys.TAB)


def _send(driver, message: str) -> None:
    from selenium.webdriver.common.keys import Keys

    driver.find_element("id", "input").send_keys(message, Keys.ENTER)


def _open(driver, server: LiveServer) -> None:
    """The page with the API key saved, as a returning user has it."""
    driver.get(server.url + "/")
    driver.execute_script("localStorage.clear(); localStorage.setItem('infer.api_key', "
                          "arguments[0])", KEY)
    driver.refresh()
    _wait(driver, lambda d: _text(d, "model") == NAME, message="no model name")


def _reply(driver) -> str:
    return driver.execute_script("const m = document.querySelectorAll('.message.assistant');"
                                 "return m.length ? m[m.length - 1].textContent : ''")


def test_api_key_field_unlocks_the_model(browser, server):
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    _wait(browser, lambda d: "API key" in _text(d, "model"), message="no 401 shown")
    _set(browser, "api_key", KEY)
    _wait(browser, lambda d: _text(d, "model") == NAME, message="model not shown")
    assert browser.execute_script("return localStorage.getItem('infer.api_key')") == KEY


def test_server_error_is_shown_in_the_conversation(browser, server):
    _open(browser, server)
    _set(browser, "max_tokens", str(CONTEXT * 2))
    _send(browser, "hello")
    error = _wait(browser, lambda d: d.find_elements("css selector", ".message.error"),
                  message="no error shown")[0]
    assert str(CONTEXT) in error.text, error.text  # the server's message, not a status
    assert browser.find_elements("css selector", ".message.user.unsent")
    assert _text(browser, "input") == "hello"  # back in the input, to send again
    assert not browser.find_elements("css selector", ".message.assistant")


def test_streams_a_reply_and_stop_aborts_it(browser, server, tmp_path):
    _open(browser, server)
    _set(browser, "temperature", "0")  # greedy: the tiny model's reply runs to max_tokens
    _set(browser, "max_tokens", str(LONG_REPLY))
    before = server.engine.stats["generation_tokens_total"]
    _send(browser, "Hello there")
    first = _wait(browser, lambda d: len(_reply(d)), message="no streamed text")
    _wait(browser, lambda d: len(_reply(d)) > first, message="the text did not grow")
    stop = browser.find_element("id", "stop")
    assert stop.is_displayed(), "the reply finished before Stop could be pressed"
    stop.click()
    server.wait_idle(timeout=5)
    generated = server.engine.stats["generation_tokens_total"] - before
    assert generated < LONG_REPLY // 2, generated  # aborted, not finished
    stopped = _reply(browser)
    time.sleep(0.3)
    assert _reply(browser) == stopped
    assert "(stopped)" in _text(browser, "stats")
    assert browser.find_element("id", "send").is_displayed()
    _save_screenshot(browser, tmp_path)


def _save_screenshot(driver, tmp_path: Path) -> None:
    folder = Path(os.environ.get("INFER_TEST_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "chat-page.png"
    assert driver.save_screenshot(str(path))
    print(f"chat page screenshot: {path}")


def test_markdown_renders_and_never_injects_markup(browser, server):
    browser.get(server.url + "/")
    reply = ("**b** `c` <script>x</script> <img src=x onerror=alert(1)> "
             "[no](javascript:alert(1)) [yes](https://example.org/a?b=1&c=2)\n"
             "```py\nprint(1)\n```\n- *one*\n- two\n# Title")
    browser.execute_script("const div = document.createElement('div');"
                           "div.className = 'message assistant'; div.id = 'probe';"
                           "div.innerHTML = renderMarkdown(arguments[0]);"
                           "document.getElementById('messages').append(div)", reply)
    probe = browser.find_element("id", "probe")

    def count(selector: str) -> int:
        return len(probe.find_elements("css selector", selector))

    assert count("strong") == 1 and count("em") == 1 and count("li") == 2
    assert count("pre > code.language-py") == 1 and count("code") == 2
    assert count("h1") == 1
    assert count("script") == count("img") == 0
    assert [a.get_attribute("href") for a in probe.find_elements("css selector", "a")] == \
        ["https://example.org/a?b=1&c=2"]
    assert "<script>x</script>" in probe.text  # shown as text
