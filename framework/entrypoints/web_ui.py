"""The browser UI that ``tokenmill serve`` serves at ``/``: a chat page and a live engine page.

Plain HTML, CSS and JavaScript shipped in the package (``web/``), with no build step and no
request to any other host (a Content-Security-Policy of ``'self'`` enforces it). The pages
hold nothing about the server: they are public, and they reach the API like any client, so
with ``--api-key`` the chat page asks for the key and sends it as a bearer header. The engine
page reads ``/metrics``, the numbers Prometheus scrapes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import Response

WEB_DIR = Path(__file__).parent / "web"

PAGES = {"/": "chat.html", "/engine": "engine.html"}
"""URL path -> the page's file in ``WEB_DIR``."""

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
}

HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def web_files() -> dict[str, bytes]:
    """Every file of the UI by name, read once."""
    return {
        p.name: p.read_bytes()
        for p in sorted(WEB_DIR.iterdir())
        if p.is_file() and p.suffix in MEDIA_TYPES
    }


def add_web_ui(app: FastAPI) -> None:
    """Serve the pages at ``PAGES`` and their assets under ``/ui/``."""
    files = web_files()

    def respond(name: str) -> Response:
        if name not in files:
            raise HTTPException(404, "Not Found")
        media_type = MEDIA_TYPES[Path(name).suffix]
        return Response(files[name], media_type=media_type, headers=HEADERS)

    def page(name: str) -> Callable[[], Awaitable[Response]]:
        async def serve() -> Response:
            return respond(name)

        return serve

    for path, name in PAGES.items():
        app.add_api_route(path, page(name), methods=["GET"], include_in_schema=False)

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        return respond(name)
