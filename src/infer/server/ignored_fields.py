"""Request fields the server accepts but ignores (protocol.py): logged once per request at
WARNING, and named to the client in the `X-Infer-Ignored-Fields` header of the answer,
whatever its status (a 400 for another field included)."""

from __future__ import annotations

import logging
from urllib.parse import quote

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)
IGNORED_FIELDS_HEADER = "X-Infer-Ignored-Fields"
# Names come from the client: the log line and the header stay bounded whatever it sends.
MAX_SHOWN = 16
MAX_NAME_CHARS = 64
_STATE_KEY = "infer_ignored_fields"


def note_ignored(names: list[str], request: Request) -> None:
    """Log a request body's ignored fields and keep them for the answer's header."""
    if not names:
        return
    shown = [name[:MAX_NAME_CHARS] for name in names[:MAX_SHOWN]]
    more = f" (and {len(names) - MAX_SHOWN} more)" if len(names) > MAX_SHOWN else ""
    log.warning("The following fields were present in the request but ignored: {%s}%s",
                ", ".join(map(repr, shown)), more)
    # percent-encoded: ASCII, and no name holds the comma that parts them
    value = ",".join(quote(name, safe="", errors="surrogatepass") for name in shown)
    setattr(request.state, _STATE_KEY, value + (",..." if more else ""))


class IgnoredFieldsHeader:
    """Adds the header to the answer of a request whose handler noted ignored fields."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                value = scope.get("state", {}).get(_STATE_KEY)
                if value is not None:
                    headers = [*message.get("headers", ()),
                               (IGNORED_FIELDS_HEADER.lower().encode(), value.encode())]
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)
