"""The per-rollout endpoint: authentication, routes, and errors in each API's own shape.

    GET  /v1/models                the one model (``agent.model``)
    POST /v1/chat/completions      OpenAI chat (tools, streaming)            -> _openai.py
    POST /v1/completions           OpenAI completions (text or token ids)    -> _openai.py
    POST /v1/messages              Anthropic messages (tools, streaming)     -> _anthropic.py

The same routes answer without the ``/v1`` prefix (harnesses differ on whether a base URL
carries it). Every route but ``/health`` wants the rollout's key, as ``Authorization: Bearer``
(OpenAI clients) or ``x-api-key`` (Anthropic clients): the key is made for this rollout, so it
is worthless elsewhere, and the daemon's own token never enters the sandbox.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rolloutd.daemon.harness import _anthropic, _openai
from rolloutd.daemon.harness._errors import ApiError
from rolloutd.daemon.harness._http import Request, Response
from rolloutd.daemon.harness._session import Session
from rolloutd.daemon.llm.openai_api import RequestError

Route = Callable[[Session, Mapping[str, Any], str], Awaitable[Response]]

_ROUTES: dict[str, tuple[Route, Callable[[ApiError], dict[str, Any]]]] = {
    "/v1/chat/completions": (_openai.chat_completions, _openai.error_body),
    "/v1/completions": (_openai.completions, _openai.error_body),
    "/v1/messages": (_anthropic.messages, _anthropic.error_body),
}


class Endpoint:
    """The app :func:`rolloutd.daemon.harness._http.serve_socket` serves for one rollout."""

    def __init__(self, session: Session, *, key: str, model: str) -> None:
        self.session = session
        self.key = key
        self.model = model

    def _authorized(self, headers: Mapping[str, str]) -> bool:
        given = headers.get("x-api-key") or ""
        auth = headers.get("authorization") or ""
        if auth[:7].lower() == "bearer ":
            given = given or auth[7:].strip()
        return hmac.compare_digest(given.encode(), self.key.encode())

    async def __call__(self, req: Request) -> Response:
        path = req.path if req.path.startswith("/v1/") else "/v1" + req.path
        if path == "/v1/health" and req.method == "GET":
            return Response(200, {"status": "ok"})
        route, shape = _ROUTES.get(path, (None, _openai.error_body))
        if not self._authorized(req.headers):
            return Response(401, shape(ApiError(401, "invalid API key: use the key this rollout's "
                                                     "environment gives (OPENAI_API_KEY / ANTHROPIC_API_KEY)",
                                                kind="authentication_error", code="invalid_api_key")))
        if path == "/v1/models" and req.method == "GET":
            return Response(200, {"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "rolloutd"}]})
        if route is None:
            return Response(404, shape(ApiError(404, f"no route {req.method} {req.path}",
                                                kind="not_found_error")))
        if req.method != "POST":
            return Response(405, shape(ApiError(405, f"{req.path} takes POST")))
        try:
            body = json.loads(req.body or b"null")
        except ValueError as exc:
            return Response(400, shape(ApiError(400, f"the body is not JSON: {exc}")))
        if not isinstance(body, dict):
            return Response(400, shape(ApiError(400, "the body must be a JSON object")))
        try:
            try:
                return await route(self.session, body, self.model)
            except RequestError as exc:  # a request the shared OpenAI shapes refuse
                raise ApiError(exc.status, exc.message, param=exc.param) from None
        except ApiError as exc:
            return Response(exc.status, shape(exc))
