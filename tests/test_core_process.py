"""The engine core in a process of its own: the same answers as in one process; a core
that dies fails its requests (500 / an error event) and stops the server; and no process
outlives the server, whether it stops cleanly, its core dies, or it is killed."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest
from server_fixtures import _free_port, live_server
from tiny_model import tiny_model_dir

from infer import LLM, SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.server import AsyncEngine

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")]
TINY = {"num_blocks": 64, "max_model_len": 128, "block_size": 8, "device": "cpu"}
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# `httpx.get` and the like make a client, and with it an SSL context, per call: ~60 ms of
# CPU each. One client instead, keeping no connection: each request opens its own, as
# theirs did (so goes to any API process, and never waits on a stopped one's).
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def _children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with suppress(OSError):  # a thread that just ended
            found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def _descendants(pid: int) -> set[int]:
    todo, found = [pid], set()
    while todo:
        for child in _children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _descendants_holding(pid: int, expected: set[int], timeout: float = 10.0) -> set[int]:
    """`_descendants(pid)` once it holds `expected`: a process whose spawning thread has
    just ended is, for a moment, being handed to another thread and listed by none."""
    deadline = time.monotonic() + timeout
    while not expected <= (found := _descendants(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert expected <= found, (expected, found)
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: set[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_running(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if _running(p)]}"
        time.sleep(0.1)


def test_a_steps_outputs_cross_the_pipe_unchanged_and_in_order():
    import pickle

    from infer.engine.core_process import pack_outputs, unpack_outputs
    from infer.engine.engine_core import SequenceOutput
    from infer.engine.prompt_logprobs import PromptLogprobs

    outputs = [
        SequenceOutput("a", [5], num_cached_tokens=16),
        SequenceOutput("b", [7], [-0.5], [([7, 9], [-0.5, -1.5])], ranks=[1]),
        SequenceOutput("c", [1, 2], num_cached_tokens=0),
        SequenceOutput("d", [], finish_reason="error", error="ValueError: bad"),
        SequenceOutput("e", [3], finish_reason="stop", stop_reason=3),
        SequenceOutput("f", [4]),
        SequenceOutput("g", [2], prompt_logprobs=PromptLogprobs([-1.0], [3], None)),
    ]
    packed = pickle.loads(pickle.dumps(pack_outputs(outputs)))
    assert unpack_outputs(packed) == outputs
    assert [place for place, _ in packed[3]] == [1, 3, 4, 6]  # only those go whole
    assert unpack_outputs(pack_outputs([])) == []


def test_a_core_process_answers_as_the_engine_in_this_process():
    config = EngineConfig(model=str(tiny_model_dir()), **TINY)
    expected = [o.outputs[0].token_ids for o in _offline(config)]
    engine = AsyncEngine.launch(config)
    pid = engine.core_pid
    try:
        assert pid is not None and pid != os.getpid() and _running(pid)

        async def run():
            streams = await engine.add_requests(
                [("a", "The quick brown fox"), ("b", "Once upon a time")], GREEDY)
            got = []
            for stream in streams:
                got.append([o async for o in stream][-1].outputs[0].token_ids)
            with pytest.raises(ValueError, match="out of range"):
                await engine.add_request("c", [10**6], GREEDY)
            aborted = await engine.add_request("d", "The sky", SamplingParams(max_tokens=100))
            await aborted.__anext__()
            aborted.abort()
            return got

        assert asyncio.run(run()) == expected
        deadline = time.monotonic() + 10
        while engine.stats["kv_blocks_used"] or engine.stats["num_requests_running"]:
            assert time.monotonic() < deadline, engine.stats  # the abort freed its blocks
            time.sleep(0.02)
        assert engine.stats["prompt_tokens_total"] > 0 and engine.alive
        # The core's loop accounts its time: inputs applied, steps, outputs sent.
        seconds = [engine.stats[f"core_{part}_seconds"] for part in ("input", "step", "output")]
        assert all(t > 0 for t in seconds), seconds
    finally:
        engine.shutdown()
    _wait_gone({pid}, 10)
    assert engine._client.exitcode == 0 and not engine.alive


def test_the_offline_api_with_a_core_process_answers_as_without():
    prompts = ["The quick brown fox", "Once upon a time"]
    params = [GREEDY, SamplingParams(max_tokens=24, temperature=0.8, seed=5, n=2,
                                     stop=[" the"], logprobs=2, prompt_logprobs=1)]
    here = LLM(str(tiny_model_dir()), **TINY)
    apart = LLM(str(tiny_model_dir()), core_process=True, **TINY)
    pid = apart.engine.core.client.runner.pid
    try:
        assert pid != os.getpid() and _running(pid)
        want = here.generate(prompts, params, use_tqdm=False)
        got = apart.generate(prompts, params, use_tqdm=False)
        for a, b in zip(got, want):
            assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in a.outputs] \
                == [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in b.outputs]
            for c, d in zip(a.outputs, b.outputs):  # float sums: the core has more threads
                if d.logprobs is not None:
                    assert [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs] == [
                        pytest.approx({t: lp.logprob for t, lp in e.items()}, abs=1e-4)
                        for e in d.logprobs]
            assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
            if b.prompt_logprobs is not None:
                assert len(a.prompt_logprobs) == len(a.prompt_token_ids)
                for e, f in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                    assert {t: lp.rank for t, lp in e.items()} == {
                        t: lp.rank for t, lp in f.items()}
                    assert {t: lp.logprob for t, lp in e.items()} == pytest.approx(
                        {t: lp.logprob for t, lp in f.items()}, abs=1e-4)
        for _out in apart.stream("Once upon a time", GREEDY):  # left after one output
            break
        [again] = apart.generate(prompts[:1], GREEDY, use_tqdm=False)
        assert again.outputs[0].token_ids == want[0].outputs[0].token_ids
        deadline = time.monotonic() + 10  # the core's last report: every block free
        while apart.engine.stats().get("kv_blocks_used", -1) != 0:
            assert time.monotonic() < deadline, apart.engine.stats()
            time.sleep(0.05)
    finally:
        apart.engine.shutdown()
    _wait_gone({pid})


def test_an_offline_engine_whose_core_dies_raises_instead_of_hanging():
    llm = LLM(str(tiny_model_dir()), core_process=True, **TINY)
    pid = llm.engine.core.client.runner.pid
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    stream = llm.stream("The quick brown fox", long)
    next(stream)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="engine core died"):
        for _ in stream:
            pass
    with pytest.raises(RuntimeError, match="engine core died"):
        llm.generate("Once upon a time", long, use_tqdm=False)
    llm.engine.shutdown()
    _wait_gone({pid})


def test_an_offline_engine_let_go_stops_its_core():
    llm = LLM(str(tiny_model_dir()), core_process=True, **TINY)
    pid = llm.engine.core.client.runner.pid
    assert llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    del llm
    _wait_gone({pid})


def _offline(config: EngineConfig):
    engine = LLMEngine(config)
    for rid, prompt in (("a", "The quick brown fox"), ("b", "Once upon a time")):
        engine.add_request(rid, prompt, GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return [finished["a"], finished["b"]]


def _started(pid: int) -> int:
    """When a process started (clock ticks since boot)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


@contextmanager
def _serve(*flags: str, spawned: int = 1, poll_s: float = 0.2
           ) -> Iterator[tuple[subprocess.Popen, str, int]]:
    """`infer serve` on the tiny model in a subprocess: (process, url, core pid). With
    `spawned` > 1, the last item is the pids of the processes it spawned, the core first.
    /health is polled every `poll_s` until it answers 200."""
    port = _free_port()
    cmd = [sys.executable, "-m", "infer.cli", "serve", "--model", str(tiny_model_dir()),
           "--port", str(port), "--log-level", "warning", *flags,
           *(f"--{k.replace('_', '-')}={v}" for k, v in TINY.items())]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not become healthy"
            try:
                if HTTP.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(poll_s)
        # The core (beside multiprocessing's resource tracker). Its parent, the thread that
        # loaded the engine, exits after /health turns 200: for a moment the core is being
        # handed to another thread and is nobody's child.
        while len(cores := [c for c in _children(proc.pid)
                            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
                  ) < spawned:
            assert time.monotonic() < deadline, "no engine core process found"
            time.sleep(0.05)
        if spawned == 1:
            [core] = cores
            yield proc, url, core
        else:
            yield proc, url, sorted(cores, key=_started)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _wait_for_line(proc: subprocess.Popen, text: str, timeout: float) -> None:
    """Read the server's output (from its pipe's descriptor, unbuffered) until it holds
    `text`."""
    deadline = time.monotonic() + timeout
    fd, seen = proc.stdout.fileno(), b""
    while text.encode() not in seen:
        left = deadline - time.monotonic()
        assert left > 0 and select.select([fd], [], [], left)[0], seen
        chunk = os.read(fd, 1 << 16)
        assert chunk, seen  # the output ended
        seen += chunk


def test_a_dead_core_fails_its_requests_and_stops_the_server():
    with _serve() as (proc, url, core):
        events, started = [], threading.Event()
        model = HTTP.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hi", "max_tokens": 4}
        assert HTTP.post(url + "/v1/completions", json=body).status_code == 200
        client = threading.Thread(target=_stream_into, args=(url, model, events, started),
                                  daemon=True)
        client.start()
        assert started.wait(30)
        descendants = _descendants(proc.pid)
        os.kill(core, signal.SIGKILL)
        client.join(30)
        assert events and "[DONE]" not in events
        error = json.loads(events[-1])["error"]
        assert error["code"] == 500
        assert "engine core died (exit code -9)" in error["message"]
        assert proc.wait(30) == 1
        assert "the engine core died" in proc.stdout.read()
        _wait_gone(descendants)


def _stream_into(url: str, model: str, events: list[str], started: threading.Event) -> None:
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 100,
            "ignore_eos": True, "stream": True}
    with HTTP.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def test_a_killed_server_leaves_no_core_behind():
    with _serve() as (proc, _, core):
        descendants = _descendants(proc.pid)
        assert core in descendants
        proc.kill()
        proc.wait(10)
        _wait_gone(descendants)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, -15)])
def test_a_stopped_server_stops_its_core(sig, code):
    with _serve() as (proc, _, core):
        descendants = _descendants(proc.pid)
        assert core in descendants
        proc.send_signal(sig)
        assert proc.wait(30) == code
        _wait_gone(descendants)


def test_health_turns_503_when_the_core_dies():
    engine = AsyncEngine.launch(EngineConfig(model=str(tiny_model_dir()), **TINY))
    died = threading.Event()
    engine.on_core_death = died.set
    try:
        with live_server(engine, "tiny") as server:
            pid = engine.core_pid
            os.kill(pid, signal.SIGKILL)
            assert died.wait(30) and not engine.alive
            assert HTTP.get(server.url + "/health").status_code == 503
            r = HTTP.post(server.url + "/v1/completions",
                           json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 500 and "core is not running" in r.json()["error"]["message"]
    finally:
        engine.shutdown()
    _wait_gone({pid}, 10)


def _metric(text: str, name: str) -> float:
    [value] = [float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ")]
    return value


def test_further_api_processes_serve_the_port_and_any_death_stops_all():
    with _serve("--api-server-count", "2", spawned=2) as (proc, url, (core, api)):
        model = HTTP.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hi", "max_tokens": 4}
        os.kill(proc.pid, signal.SIGSTOP)  # only the further process can answer now
        try:
            for _ in range(3):
                r = HTTP.post(url + "/v1/completions", json=body, timeout=30)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert HTTP.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        # Whichever process answers a scrape, it counts all four requests' tokens.
        deadline = time.monotonic() + 20
        while True:
            scrapes = [HTTP.get(url + "/metrics", timeout=10).text for _ in range(6)]
            tokens = [_metric(m, "infer:generation_tokens_total") for m in scrapes]
            requests = [_metric(m, "infer:e2e_request_latency_seconds_count") for m in scrapes]
            if set(tokens) == {16.0} and set(requests) == {4.0}:
                break
            assert time.monotonic() < deadline, (tokens, requests)
            time.sleep(0.5)
        descendants = _descendants_holding(proc.pid, {core, api})
        os.kill(api, signal.SIGKILL)
        assert proc.wait(30) == 1
        assert "an API server process died" in proc.stdout.read()
        _wait_gone(descendants)


def test_once_health_is_200_every_api_process_answers_and_sigterm_stops_them_all():
    """No process may say "loading" after any has said it is ready: a client that polls
    /health and then sends requests (each on a new connection, so to any process) gets
    answers from the first request on. Stopped, the server stops every process it
    spawned."""
    with _serve("--api-server-count", "3", spawned=3, poll_s=0.005) as (proc, url, spawned):
        codes = [HTTP.get(url + "/v1/models", timeout=10).status_code for _ in range(24)]
        assert set(codes) == {200}, codes
        descendants = _descendants_holding(proc.pid, set(spawned))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -15
        _wait_gone(descendants)


def test_further_api_processes_told_nothing_exit_when_the_core_goes():
    """The server's first process may die between its engine's /health turning 200 and
    telling the others to serve: they must not wait for that word forever."""
    from infer.cli import build_parser, engine_config
    from infer.server.api_servers import ApiServers, listening_socket

    args = build_parser().parse_args(
        ["serve", "--model", str(tiny_model_dir()), "--port", str(_free_port()),
         *(f"--{k.replace('_', '-')}={v}" for k, v in TINY.items())])
    engine, sides = AsyncEngine.launch_shared(engine_config(args), 2)
    sock = listening_socket("127.0.0.1", args.port)
    others = None
    try:
        others = ApiServers(args, sides, sock, on_death=lambda: None)
        [process] = others.processes
        assert process.is_alive()
        engine.shutdown()  # the core stops; nobody calls others.serve()
        process.join(30)
        assert process.exitcode == 0
    finally:
        engine.shutdown()
        if others is not None:
            others.stop()
        sock.close()


def test_an_orphaned_api_process_exits_even_if_its_server_never_stops():
    """The watch each further API process runs: a process whose parent is killed exits
    within ORPHAN_EXIT_S (and a poll) even when its server ignores `should_exit`."""
    from infer.server.api_servers import ORPHAN_EXIT_S

    child = ("import os, sys, threading, time, types; sys.path[:0] = sys.argv[1:2]; "
             "from infer.server.api_servers import _exit_when_orphaned; "
             "stuck = types.SimpleNamespace(should_exit=False); "
             "threading.Thread(target=_exit_when_orphaned, args=(int(sys.argv[2]), stuck), "
             "daemon=True).start(); print('watching', flush=True); time.sleep(120)")
    parent = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys, time; "
         "c = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2], "
         "str(os.getpid())]); "
         "print(c.pid, flush=True); time.sleep(120)", child, str(Path("src").resolve())],
        stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert parent.stdout.readline() == "watching\n" and _running(pid)
        parent.kill()
        parent.wait(10)
        start = time.monotonic()
        _wait_gone({pid}, ORPHAN_EXIT_S + 10)
        assert time.monotonic() - start >= ORPHAN_EXIT_S - 1  # it waited its grace first
    finally:
        parent.kill()


def test_further_api_processes_take_the_flags_and_a_killed_server_leaves_none(tmp_path):
    """A further process answers with the chat template and CORS origins given; the
    server's first process killed, no further process (nor the core) is left behind."""
    from infer.loader.tokenizer import Tokenizer

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    origin = "http://ui.example"
    chat = [{"role": "user", "content": "Hi"}]
    expected = Tokenizer.from_hf_dir(tiny_model_dir()).encode_chat(chat, chat_template=template)
    preflight = {"Access-Control-Request-Method": "POST"}
    with _serve("--api-server-count", "2", "--chat-template", str(tmp_path / "t.jinja"),
                "--allowed-origins", origin, spawned=2) as (proc, url, spawned):
        # The first process answers /health just before it lets the further one serve
        # (it prints "serving on" then): stopped in between, it never would.
        _wait_for_line(proc, "infer: serving on", 60)
        os.kill(proc.pid, signal.SIGSTOP)  # only the further process can answer now
        try:
            # The further process may still be starting its server (seconds on a loaded
            # 2-core machine); it accepts the waiting connection once it serves.
            r = HTTP.post(url + "/tokenize", json={"messages": chat}, timeout=90)
            assert r.status_code == 200 and r.json()["tokens"] == expected
            allowed = HTTP.options(url + "/v1/completions", timeout=30,
                                    headers={**preflight, "Origin": origin})
            assert allowed.headers["access-control-allow-origin"] == origin
            other = HTTP.options(url + "/v1/completions", timeout=30,
                                  headers={**preflight, "Origin": "http://b.example"})
            assert other.status_code == 400
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        descendants = _descendants_holding(proc.pid, set(spawned))
        proc.kill()
        proc.wait(10)
        _wait_gone(descendants)
