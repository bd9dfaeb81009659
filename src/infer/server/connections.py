"""Connection limits uvicorn lacks: a deadline for reading each request, and a cap on open
connections. `limited_protocol(...)` is what `uvicorn.Config(http=...)` takes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from infer.server.protocol import error_body

REQUEST_READ_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 1024
LINGER_S = 1.0


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus two limits. The read timer runs from the connection's
    start, or from the first byte of a later request, until the request (head and body) is
    read; idle time between requests is left to uvicorn's `timeout_keep_alive`."""

    request_read_timeout = REQUEST_READ_TIMEOUT_S
    max_connections = MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timer: asyncio.TimerHandle | None = None
        self.refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.refuse()
        else:
            self.update_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_read_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        super().data_received(data)
        self.update_read_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.update_read_timer()

    def update_read_timer(self) -> None:
        # IDLE counts as reading before this connection's first request (cycle is None)
        # and once bytes of a later one are buffered; otherwise it is keep-alive idle time.
        state = self.conn.their_state
        reading = state is h11.SEND_BODY or (state is h11.IDLE and (
            self.cycle is None or bool(self.conn.trailing_data[0])))
        if not reading or self.transport.is_closing():
            self.cancel_read_timer()
        elif self.read_timer is None:
            self.read_timer = self.loop.call_later(self.request_read_timeout, self.read_timed_out)

    def cancel_read_timer(self) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None

    def read_timed_out(self) -> None:
        self.read_timer = None
        if self.transport.is_closing():
            return
        self.logger.warning("Request not read within %ss; closing the connection.",
                            self.request_read_timeout)
        if self.conn.their_state is h11.IDLE:
            body = _json(error_body(f"request not received within "
                                    f"{self.request_read_timeout}s", "invalid_request_error", 408))
            try:
                self.transport.write(self.conn.send(h11.Response(
                    status_code=408, reason=b"Request Timeout", headers=[
                        *self.server_state.default_headers,
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close")])))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:
                pass
        # Mid-body the app is running: closing makes its receive() return http.disconnect.
        self.transport.close()

    def refuse(self) -> None:
        """503 without running the app. A refused connection does not count as open; it is
        half-closed and lingers (discarding input) so the client reads the 503 rather than a
        reset, then is closed on the client's EOF or after LINGER_S."""
        self.refused = True
        self.connections.discard(self)
        self.logger.warning("Exceeded max connections (%d).", self.max_connections)
        body = _json(error_body(f"too many open connections (max {self.max_connections}); "
                                "retry later", "ServiceUnavailable", 503))
        head = [b"HTTP/1.1 503 Service Unavailable"] + [
            name + b": " + value for name, value in [
                *self.server_state.default_headers,
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"), (b"connection", b"close")]]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def limited_protocol(request_read_timeout: float = REQUEST_READ_TIMEOUT_S,
                     max_connections: int = MAX_CONNECTIONS) -> type[LimitedH11Protocol]:
    """uvicorn instantiates `Config.http` itself, so the settings ride on a subclass."""
    if request_read_timeout <= 0 or max_connections < 1:
        raise ValueError("request_read_timeout must be > 0 and max_connections >= 1")
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {
        "request_read_timeout": request_read_timeout, "max_connections": max_connections})
