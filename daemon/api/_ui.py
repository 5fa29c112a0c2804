"""The dashboard (``/ui/``): static files only, so they need no token.

    GET /ui                  redirect to /ui/
    GET /ui/                 the single-page app (index.html)
    GET /ui/static/{name}    its script and style sheet

Every data call the page makes goes to the JSON API with the bearer token (the page asks for
it and keeps it in ``sessionStorage``, never in a URL). The routes are not in the OpenAPI
document: they are no API.
"""

from __future__ import annotations

from typing import Any

from quart import Response, redirect, send_from_directory
from quart_schema import hide
from quart_trio import QuartTrio
from werkzeug.exceptions import NotFound

from rolloutd.daemon.ui import STATIC_DIR

#: What the page may load and call: the daemon itself, nothing else.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'")
#: The files the page is made of; nothing else under STATIC_DIR is served.
ASSETS = ("app.js", "app.css")


def is_public(path: str) -> bool:
    """Whether ``path`` is one of the dashboard's files (served without a token)."""
    return path == "/ui" or path.startswith("/ui/")


def _harden(resp: Response) -> Response:
    resp.headers["Content-Security-Policy"] = CSP
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "no-referrer"
    resp.headers["Cache-Control"] = "no-cache"
    return resp


def register(app: QuartTrio) -> None:
    @app.get("/ui")
    @hide
    async def ui_root() -> Any:
        return redirect("ui/", 308)  # relative: the page's relative links work under a prefix

    @app.get("/ui/")
    @hide
    async def ui_index() -> Any:
        return _harden(await send_from_directory(STATIC_DIR, "index.html", mimetype="text/html"))

    @app.get("/ui/static/<name>")
    @hide
    async def ui_asset(name: str) -> Any:
        if name not in ASSETS:
            raise NotFound(f"no dashboard file {name!r}")
        return _harden(await send_from_directory(STATIC_DIR, name))
