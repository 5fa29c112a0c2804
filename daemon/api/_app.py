"""``create_app``: the quart-trio application, from the parts of a node its routes call.

Each resource module registers its routes with ``register(app, part)``, where ``part`` is
the narrow protocol that module declares; this module adds what every route shares: the
bearer-token check (not on /healthz and the dashboard's files), reading any body left unread, error answers (``rolloutd.daemon.errors`` mapped in
``_errors``), and the OpenAPI document.
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Any, Protocol

from quart import Response, request
from quart_schema import HttpSecurityScheme, QuartSchema
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from rolloutd.daemon.api import (
    _backends,
    _batches,
    _federation,
    _images,
    _operations,
    _rollouts,
    _ui,
)
from rolloutd.daemon.api._errors import HTTP_TYPES, answer_for
from rolloutd.daemon.api._http import INTERNAL, REF_TEMPLATE, OpenAPIDocument, discard_body, error
from rolloutd.daemon.config import Settings
from rolloutd.daemon.errors import RequestError
from rolloutd.daemon.tasks.registry import TaskRegistry

log = logging.getLogger(__name__)

#: A request body must arrive within this many seconds.
BODY_TIMEOUT_S = 60


class Front(_rollouts.Rollouts, _batches.Batches, _federation.Peers, Protocol):
    """Rollouts, batches and peers (``rolloutd.daemon.front.Front``)."""


class Parts(_operations.Operations, Protocol):
    """What the application is built from (``rolloutd.daemon.node.Node``)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def token(self) -> str | None: ...
    @property
    def registry(self) -> TaskRegistry: ...
    @property
    def front(self) -> Front: ...
    @property
    def backends(self) -> _backends.Backends: ...
    @property
    def images(self) -> _images.Images: ...


def create_app(parts: Parts) -> QuartTrio:
    # root_path given: flask finds none for "rolloutd", a namespace package
    app = QuartTrio("rolloutd", root_path=os.path.dirname(os.path.abspath(__file__)))
    settings = parts.settings
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config["BODY_TIMEOUT"] = BODY_TIMEOUT_S
    app.config["RESPONSE_TIMEOUT"] = None
    _document(app, parts.registry)
    _guard(app, parts.token)
    _answer_errors(app)
    _rollouts.register(app, parts.front, max_timeout_s=settings.max_timeout_s)
    _backends.register(app, parts.backends)
    _images.register(app, parts.images)
    _operations.register(app, parts)
    _federation.register(app, parts.front)
    _batches.register(app, parts.front, max_timeout_s=settings.max_timeout_s)
    _ui.register(app)
    return app


def _document(app: QuartTrio, registry: TaskRegistry) -> None:
    """The OpenAPI document at /openapi.json, with the registered task kinds' schemas."""
    task_schema, task_definitions = registry.task_schemas(REF_TEMPLATE)

    class Document(OpenAPIDocument):
        def schema(self) -> dict[str, Any]:
            doc = super().schema()
            doc["components"]["schemas"].update(task_definitions, Task=task_schema)
            return doc

    QuartSchema(
        app,
        openapi_path="/openapi.json",
        swagger_ui_path=None,
        redoc_ui_path=None,
        scalar_ui_path=None,
        info={"title": "rolloutd", "version": "1"},
        security_schemes={"bearer": HttpSecurityScheme(scheme="bearer")},
        security=[{"bearer": []}],
        openapi_provider_class=Document,
    )


def _guard(app: QuartTrio, token: str | None) -> None:
    """A bearer token, when configured, guards every route but /healthz and the dashboard's
    static files (``/ui/``: the page asks for the token and sends it with its data calls)."""

    @app.before_request
    async def _auth() -> Response | None:
        if token is None or request.path == "/healthz" or _ui.is_public(request.path):
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            resp = error(401, "unauthorized", "a valid bearer token is required")
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        return None

    @app.after_request
    async def _finish_body(resp: Response) -> Response:
        # Routes that answer without reading the body (OPTIONS, 405, 401, ...) must still
        # consume it, or a keep-alive connection would wedge on the next request.
        if resp.status_code != 413:
            await discard_body()
        return resp


def _answer_errors(app: QuartTrio) -> None:
    @app.errorhandler(RequestError)
    async def _request_error(exc: RequestError) -> Response:
        answer = answer_for(exc)
        if answer is None:
            return _bug(exc)
        status, etype = answer
        return error(status, etype, str(exc), retry_after_s=exc.retry_after_s)

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 400
        resp = error(status, HTTP_TYPES.get(status, "http_error"), exc.description or exc.name)
        if "Allow" in dict(exc.get_headers()):  # 405 names the methods the route has
            resp.headers["Allow"] = dict(exc.get_headers())["Allow"]
        if status == 413:
            # The rest of the body is never read: end the connection rather than leave it stuck.
            resp.headers["Connection"] = "close"
        return resp

    @app.errorhandler(Exception)
    async def _unhandled(exc: Exception) -> Response:
        return _bug(exc)


def _bug(exc: BaseException) -> Response:
    log.error("unhandled error on %s %s", request.method, request.path, exc_info=exc)
    return error(500, *INTERNAL)
