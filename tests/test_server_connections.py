"""Connection limits on a live server, over raw sockets: stalled requests are closed within
the read timeout, idle keep-alive connections after uvicorn's keep-alive timeout, and
connections beyond max_connections get a JSON 503."""

from __future__ import annotations

import json
import socket
import time
from contextlib import ExitStack

import pytest
from server_fixtures import MODEL, live_server, shared_engine

from infer.cli import build_parser
from infer.server.connections import limited_protocol

READ_TIMEOUT = 0.5
KEEP_ALIVE = 0.5
MAX_CONNECTIONS = 4
MARGIN = 2.0
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def server():
    http = limited_protocol(READ_TIMEOUT, MAX_CONNECTIONS)
    with live_server(shared_engine(), uvicorn_kwargs={
            "http": http, "timeout_keep_alive": KEEP_ALIVE}) as s:
        yield s


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=READ_TIMEOUT + MARGIN)


def read_until_closed(sock: socket.socket, deadline_s: float) -> bytes:
    """Everything the server sends until it closes; fails if it is still open at the deadline."""
    deadline, data = time.monotonic() + deadline_s, b""
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"connection still open after {deadline_s}s: {data!r}") from None
        if not chunk:
            return data
        data += chunk


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One Content-Length response, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or pytest.fail(f"closed mid-head: {data!r}")
    head, body = data.split(b"\r\n\r\n", 1)
    status, headers = parse_head(head)
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536) or pytest.fail("closed mid-body")
    return status, headers, body


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}


def assert_error(data: bytes, status: int, type: str) -> dict[str, str]:
    head, body = data.split(b"\r\n\r\n", 1)
    code, headers = parse_head(head)
    assert code == status and headers["connection"] == "close"
    assert json.loads(body) == {"error": {"message": json.loads(body)["error"]["message"],
                                          "type": type, "param": None, "code": status}}
    return headers


def closed_in_time(sock: socket.socket, timeout: float) -> bytes:
    start = time.monotonic()
    data = read_until_closed(sock, timeout + MARGIN)
    assert time.monotonic() - start >= timeout * 0.8
    return data


def test_silent_client_is_closed_with_408(server):
    with connect(server) as sock:
        assert_error(closed_in_time(sock, READ_TIMEOUT), 408, "invalid_request_error")


def test_half_a_request_head_is_closed_with_408(server):
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        assert_error(closed_in_time(sock, READ_TIMEOUT), 408, "invalid_request_error")


def test_stalled_body_is_closed(server):
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                     b'{"model":"')
        closed_in_time(sock, READ_TIMEOUT)


def test_idle_keep_alive_is_closed_after_keep_alive_timeout(server):
    with connect(server) as sock:
        sock.sendall(HEALTH)
        assert read_response(sock)[0] == 200
        time.sleep(KEEP_ALIVE * 0.6)  # idle between requests: no read timer runs
        sock.sendall(HEALTH[:10])
        time.sleep(READ_TIMEOUT * 0.6)  # the read timer started at the first byte
        sock.sendall(HEALTH[10:])
        assert read_response(sock)[0] == 200
        assert closed_in_time(sock, KEEP_ALIVE) == b""


def test_a_stalled_second_request_is_closed_with_408(server):
    with connect(server) as sock:
        sock.sendall(HEALTH)
        assert read_response(sock)[0] == 200
        sock.sendall(HEALTH[:10])
        assert_error(closed_in_time(sock, READ_TIMEOUT), 408, "invalid_request_error")


def test_normal_and_slow_but_timely_requests_are_served(server):
    with connect(server) as sock:
        sock.sendall(HEALTH)
        assert read_response(sock)[0] == 200
        sock.sendall(HEALTH[:10])
        time.sleep(0.2)
        sock.sendall(HEALTH[10:])
        status, _, body = read_response(sock)
        assert status == 200, body


def test_connections_beyond_the_limit_get_503_then_recover(server):
    with ExitStack() as stack:
        idle = [stack.enter_context(connect(server)) for _ in range(MAX_CONNECTIONS)]
        time.sleep(0.1)  # let the server accept them all
        with connect(server) as extra:
            extra.sendall(HEALTH)
            headers = assert_error(read_until_closed(extra, MARGIN), 503, "ServiceUnavailable")
            assert headers["retry-after"] == "1"
        assert len(idle) == MAX_CONNECTIONS
    time.sleep(0.1)  # let the server see them close
    with connect(server) as sock:
        sock.sendall(HEALTH)
        assert read_response(sock)[0] == 200


def test_a_stream_outlasting_the_read_timeout_is_not_cut(server):
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 32,
                       "ignore_eos": True, "stream": True}).encode()
    with connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        data = read_until_closed(sock, 30)
        elapsed = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 200")
    assert data.rstrip().endswith(b"0") and b"data: [DONE]" in data
    assert elapsed > READ_TIMEOUT, f"stream took {elapsed:.2f}s: too short to test the timer"


def test_serve_flags():
    args = build_parser().parse_args(["serve"])
    assert (args.timeout_keep_alive, args.request_read_timeout, args.max_connections) == (
        5.0, 30.0, 1024)
    args = build_parser().parse_args(["serve", "--timeout-keep-alive", "2",
                                      "--request-read-timeout", "7.5", "--max-connections", "9"])
    assert (args.timeout_keep_alive, args.request_read_timeout, args.max_connections) == (
        2.0, 7.5, 9)

def test_serve_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--timeout-keep-alive", "--request-read-timeout", "--max-connections"):
        assert flag in help_text


def test_limited_protocol_rejects_nonsense():
    with pytest.raises(ValueError):
        limited_protocol(0, 10)
    with pytest.raises(ValueError):
        limited_protocol(1, 0)
