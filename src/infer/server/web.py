"""The built-in chat page: `GET /` and its static files, plain files with no build step
that load nothing from other hosts (the page works offline)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).parent / "static"
_ROUTES = {"/": ("index.html", "text/html"),
           "/static/chat.css": ("chat.css", "text/css"),
           "/static/markdown.js": ("markdown.js", "text/javascript"),
           "/static/chat.js": ("chat.js", "text/javascript")}
# Exact paths: the API-key check lets them through by exact comparison.
PAGE_PATHS = tuple(_ROUTES)


def add_chat_page(app: FastAPI) -> None:
    """GET routes for the page, kept out of the OpenAPI schema (they are not the API)."""
    for path, (name, media_type) in _ROUTES.items():
        app.add_api_route(path, _serve(name, media_type), methods=["GET"],
                          include_in_schema=False)


def _serve(name: str, media_type: str) -> Callable[[], Awaitable[FileResponse]]:
    # no-cache: the browser revalidates (ETag), so a new server version shows at once.
    async def endpoint() -> FileResponse:
        return FileResponse(STATIC_DIR / name, media_type=media_type,
                            headers={"Cache-Control": "no-cache"})

    return endpoint
