"""A small HTTP/1.1 client on asyncio streams, enough to stream OpenAI completions
(chunked or sized bodies, keep-alive, http and https), so that `infer bench serve` needs
nothing beyond the standard library."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class HttpError(Exception):
    """The server broke the protocol, closed the connection, or a read timed out."""


class Response:
    def __init__(self, status: int, headers: dict[str, str], reader: asyncio.StreamReader,
                 timeout: float) -> None:
        self.status, self.headers = status, headers
        self._reader, self._timeout = reader, timeout
        self.complete = False  # the whole body was read: the connection may be reused

    async def _read(self, aw):
        try:
            return await asyncio.wait_for(aw, self._timeout)
        except asyncio.TimeoutError:
            raise HttpError(f"no data for {self._timeout:g} s") from None
        except asyncio.IncompleteReadError:
            raise HttpError("the server closed the connection mid-response") from None

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                line = await self._read(self._reader.readline())
                try:
                    size = int(line.split(b";")[0], 16)
                except ValueError:
                    raise HttpError(f"bad chunk size line {line[:80]!r}") from None
                if size == 0:
                    while (await self._read(self._reader.readline())).strip():
                        pass  # trailers
                    break
                data = await self._read(self._reader.readexactly(size + 2))
                yield data[:-2]
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left:
                data = await self._read(self._reader.read(min(left, 65536)))
                if not data:
                    raise HttpError("the server closed the connection mid-response")
                left -= len(data)
                yield data
        else:  # the body runs to the end of the connection
            while data := await self._read(self._reader.read(65536)):
                yield data
            return
        self.complete = True

    async def iter_lines(self) -> AsyncIterator[str]:
        pending = b""
        async for data in self.iter_bytes():
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if pending:
            yield pending.decode()

    async def read(self) -> bytes:
        return b"".join([data async for data in self.iter_bytes()])


class HttpClient:
    """Requests to one server (`base_url`), over a pool of keep-alive connections: one per
    request in flight, opened as needed. `timeout`: seconds any connect or read may wait."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None,
                 timeout: float = 600.0) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.prefix = url.path.rstrip("/")
        self.headers = {"Host": url.netloc, **(headers or {})}
        self.timeout = timeout
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    @contextlib.asynccontextmanager
    async def request(self, method: str, path: str,
                      body: dict[str, Any] | None = None) -> AsyncIterator[Response]:
        data = b"" if body is None else json.dumps(body).encode()
        head = [f"{method} {self.prefix}{path} HTTP/1.1",
                *(f"{k}: {v}" for k, v in self.headers.items()),
                f"Content-Length: {len(data)}"]
        if body is not None:
            head.append("Content-Type: application/json")
        message = ("\r\n".join(head) + "\r\n\r\n").encode() + data
        reader, writer, status_line = await self._send(message)
        response = None
        try:
            parts = status_line.decode("latin-1").split(None, 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
                raise HttpError(f"not an HTTP response: {status_line[:80]!r}")
            headers = {}
            while line := (await self._wait(reader.readline())).strip():
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            response = Response(int(parts[1]), headers, reader, self.timeout)
            yield response
        finally:
            if (response is not None and response.complete
                    and response.headers.get("connection", "").lower() != "close"):
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def get_json(self, path: str) -> Any:
        async with self.request("GET", path) as r:
            body = await r.read()
            if r.status != 200:
                raise HttpError(f"GET {path}: HTTP {r.status}: {body[:200]!r}")
            return json.loads(body)

    async def close(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()

    async def _send(self, message: bytes
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
        """Send on an idle connection, or a new one if there is none or the server has
        closed the idle one meanwhile (keep-alive timeouts)."""
        while True:
            reused = bool(self._idle)
            if reused:
                reader, writer = self._idle.pop()
            else:
                reader, writer = await self._wait(
                    asyncio.open_connection(self.host, self.port, ssl=self.ssl))
            try:
                writer.write(message)
                await self._wait(writer.drain())
                status_line = await self._wait(reader.readline())
            except ConnectionError:
                writer.close()
                if reused:
                    continue
                raise
            except HttpError:
                writer.close()
                raise
            if status_line:
                return reader, writer, status_line
            writer.close()
            if not reused:
                raise HttpError("the server closed the connection without answering")

    async def _wait(self, aw):
        try:
            return await asyncio.wait_for(aw, self.timeout)
        except asyncio.TimeoutError:
            raise HttpError(f"no answer for {self.timeout:g} s") from None
