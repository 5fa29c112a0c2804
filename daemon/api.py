"""HTTP API v1: quart-trio routes and their request/response models. No business logic.

Every error is JSON ``{"error": {"type": ..., "message": ...}}`` with a 4xx status; a 500
would be a bug. A bearer token, when configured, guards every route but ``/healthz``.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from quart import Response, request
from quart_schema import (
    HttpSecurityScheme,
    QuartSchema,
    document_request,
    document_response,
    hide,
)
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from daemon.jobs import Job
from daemon.service import NotFound, RolloutRequest, ServiceError, ServiceUnavailable
from daemon.trajectory import Trajectory

if TYPE_CHECKING:
    from daemon.node import Node

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
MAX_STREAM_IDS = 10_000
MAX_JSON_DEPTH = 64


class SubmitResponse(BaseModel):
    group_id: str
    ids: list[str]
    replayed: bool = False


class WaitResponse(BaseModel):
    group_id: str
    rollouts: list[Trajectory]


class CancelResponse(BaseModel):
    id: str
    status: str


class ErrorBody(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


class BackendSpec(BaseModel):
    """A backend to register; each kind takes its own fields (see docs/llm.md)."""

    model_config = ConfigDict(extra="allow")

    kind: str = Field(description="vllm | model-server | transformers | scripted (test double)")
    url: str | None = None
    model: str | None = None
    id: str | None = None


class PolicyVersion(BaseModel):
    version: int = Field(ge=0)


class ReloadRequest(BaseModel):
    """Weight sync from a directory of safetensors (see docs/training.md)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, description="A directory of *.safetensors (or one file), readable by the backend.")
    version: int | None = Field(None, ge=0, description="The new policy version (default: current + 1).")
    partial: bool = Field(False, description="The files hold only some parameters; the others are kept.")


class _ReloadFailed(ServiceError):
    status, type = 422, "reload_failed"


def error(status: int, etype: str, message: str, *, retry_after_s: float | None = None) -> Response:
    body = json.dumps({"error": {"type": etype, "message": message}})
    resp = Response(body, status=status, mimetype="application/json")
    if retry_after_s is not None:
        resp.headers["Retry-After"] = str(int(max(1, retry_after_s)))
    return resp


async def _discard_body() -> None:
    """Read and drop an unread request body before answering early (401, 405, ...).

    Without this a keep-alive connection would still hold the body, and the client's next
    request on it would never be answered.
    """
    try:
        await request.get_data(cache=False)
    except Exception:  # too large or broken: the connection is closed anyway
        pass


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a decoded JSON value, giving up past ``limit``."""
    stack = [(value, 1)]
    deepest = 0
    while stack:
        item, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, d + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, d + 1) for v in item)
    return deepest


async def json_body() -> Any:
    raw = await request.get_data(cache=False)
    if not raw:
        raise ServiceError("the request has no JSON body")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ServiceError(f"the body is not valid JSON: {str(exc)[:200]}") from None
    if _depth(data, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise ServiceError(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels")
    return data


def parse(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        details = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:20]
        )
        raise _Unprocessable(details) from None


class _Unprocessable(ServiceError):
    status, type = 422, "invalid_request"


def _dump(job: Job) -> dict[str, Any]:
    return job.trajectory.model_dump(mode="json")


def create_app(node: Node) -> QuartTrio:
    app = QuartTrio("rolloutd")
    app.config["MAX_CONTENT_LENGTH"] = node.settings.max_body_bytes
    app.config["BODY_TIMEOUT"] = 60
    app.config["RESPONSE_TIMEOUT"] = None
    QuartSchema(
        app,
        openapi_path="/openapi.json",
        swagger_ui_path=None,
        redoc_ui_path=None,
        scalar_ui_path=None,
        info={"title": "rolloutd", "version": "1"},
        security_schemes={"bearer": HttpSecurityScheme(scheme="bearer")},
        security=[{"bearer": []}],
    )
    token = node.token
    service = node.service

    @app.before_request
    async def _auth() -> Response | None:
        if token is None or request.path == "/healthz":
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
            await _discard_body()
        return resp

    @app.errorhandler(ServiceError)
    async def _service_error(exc: ServiceError) -> Response:
        return error(exc.status, exc.type, str(exc), retry_after_s=exc.retry_after_s)

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 400
        etype = {
            404: "not_found", 405: "method_not_allowed", 413: "body_too_large",
            408: "request_timeout", 400: "bad_request",
        }.get(status, "http_error")
        resp = error(status, etype, exc.description or exc.name)
        if status == 413:
            # The rest of the body is never read: end the connection rather than leave it stuck.
            resp.headers["Connection"] = "close"
        return resp

    @app.errorhandler(Exception)
    async def _bug(exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.path, exc_info=exc)
        return error(500, "internal", "internal error; see the daemon log")

    # ---- rollouts --------------------------------------------------------------------

    @app.post("/v1/rollouts")
    @document_request(RolloutRequest)
    @document_response(SubmitResponse, 202)
    @document_response(WaitResponse, 200)
    @document_response(ErrorResponse, 422)
    async def submit() -> Any:
        """Submit one task x n samples; 202 with ids, or 200 with the trajectories if `wait`."""
        data = await json_body()
        req = parse(RolloutRequest, data)
        wait = req.wait or request.args.get("wait", "").lower() in {"1", "true", "yes"}
        forwarded = await node.maybe_forward(data, wait=wait, headers=dict(request.headers))
        if forwarded is not None:
            return forwarded[1], forwarded[0]
        sub = node.submit(req)
        if not wait:
            body = SubmitResponse(group_id=sub.group_id, ids=[j.id for j in sub.jobs], replayed=sub.replayed)
            return body.model_dump(), 202
        await service.wait(sub.jobs)
        return {"group_id": sub.group_id, "rollouts": [_dump(j) for j in sub.jobs]}, 200

    @app.get("/v1/rollouts/stream")
    @document_response(ErrorResponse, 404)
    async def stream() -> Any:
        """NDJSON: one trajectory per line, in the order they finish. `ids` is comma-separated."""
        ids = list(dict.fromkeys(i for i in request.args.get("ids", "").split(",") if i))
        if not ids:
            raise ServiceError("give the rollout ids as ?ids=a,b,c")
        if len(ids) > MAX_STREAM_IDS:
            raise ServiceError(f"at most {MAX_STREAM_IDS} ids per stream")
        recv = await node.open_stream(ids)

        async def lines() -> AsyncIterator[bytes]:
            with recv:
                for _ in ids:
                    yield (await recv.receive() + "\n").encode()

        return Response(lines(), mimetype=NDJSON)

    @app.get("/v1/rollouts/<job_id>")
    @document_response(Trajectory, 200)
    @document_response(ErrorResponse, 404)
    async def get_rollout(job_id: str) -> Any:
        """The trajectory so far (``status`` says whether it is finished)."""
        return await node.rollout_json(job_id)

    @app.delete("/v1/rollouts/<job_id>")
    @document_response(CancelResponse, 202)
    async def cancel_rollout(job_id: str) -> Any:
        """Cancel: the sandbox is torn down and the LLM request aborted."""
        return await node.cancel_json(job_id)

    # ---- backends ------------------------------------------------------------------

    def _pool() -> Any:
        if node.pool is None:
            raise ServiceUnavailable("this daemon has no LLM backend pool")
        return node.pool

    @app.get("/v1/backends")
    async def list_backends() -> Any:
        """The LLM backend pool."""
        return {"backends": _pool().describe(), "policy_version": _pool().policy_version}

    @app.post("/v1/backends")
    @document_request(BackendSpec)
    async def add_backend() -> Any:
        """Register a backend (a trainer re-registers after a weight sync)."""
        data = await json_body()
        parse(BackendSpec, data)
        backend_id = await node.add_backend({k: v for k, v in data.items() if v is not None})
        return {"id": backend_id}, 201

    @app.delete("/v1/backends/<backend_id>")
    async def remove_backend(backend_id: str) -> Any:
        pool = _pool()
        if not any(b["id"] == backend_id for b in pool.describe()):
            raise NotFound(f"no backend with id {backend_id!r}")
        await pool.remove(backend_id)
        return {"id": backend_id, "removed": True}

    @app.post("/v1/backends/pause")
    async def pause_backends() -> Any:
        """Stop sending new LLM requests (before a weight sync)."""
        await _pool().pause()
        return {"paused": True}

    @app.post("/v1/backends/resume")
    async def resume_backends() -> Any:
        _pool().resume()
        return {"paused": False}

    @app.post("/v1/backends/<backend_id>/reload")
    @document_request(ReloadRequest)
    @document_response(ErrorResponse, 422)
    async def reload_backend(backend_id: str) -> Any:
        """Weight sync: pause, load the weights into this backend, drop its cache, set the
        policy version, resume."""
        from daemon.llm.base import BackendUnavailable, LLMError
        from daemon.llm.reload import reload_in_pool

        body = parse(ReloadRequest, await json_body())
        pool = _pool()
        if not any(b["id"] == backend_id for b in pool.describe()):
            raise NotFound(f"no backend with id {backend_id!r}")
        try:
            return await reload_in_pool(pool, backend_id, body.path, version=body.version, partial=body.partial)
        except BackendUnavailable as exc:
            raise ServiceUnavailable(f"reload failed: {exc}") from None
        except LLMError as exc:
            raise _ReloadFailed(str(exc)) from None

    @app.put("/v1/policy_version")
    @document_request(PolicyVersion)
    async def put_policy_version() -> Any:
        """Every later turn is stamped with this version."""
        body = parse(PolicyVersion, await json_body())
        _pool().set_policy_version(body.version)
        return {"version": body.version}

    # ---- operations -----------------------------------------------------------------

    @app.get("/v1/status")
    async def status() -> Any:
        """Stages, backends, sandboxes, federation."""
        return node.status()

    @app.get("/healthz")
    async def healthz() -> Any:
        return {"ok": True}

    @app.get("/readyz")
    async def readyz() -> Any:
        if not node.ready:
            return error(503, "not_ready", "draining" if node.draining else "starting")
        return {"ready": True}

    @app.get("/metrics")
    @hide
    async def metrics() -> Any:
        body, content_type = node.metrics_text()
        return Response(body, mimetype=content_type.split(";")[0], content_type=content_type)

    @app.post("/v1/federation/gossip")
    @hide
    async def gossip() -> Any:
        if node.federation is None:
            raise NotFound("federation is not enabled on this daemon")
        try:
            return node.federation.handle_gossip(await json_body())
        except ValueError as exc:
            raise ServiceError(f"bad gossip payload: {exc}") from None

    @app.get("/v1/federation/members")
    async def members() -> Any:
        """The federation's member table."""
        if node.federation is None:
            return {"members": []}
        return {"members": node.federation.members()}

    from daemon.batch_api import register_batch_routes

    register_batch_routes(app, node)
    return app
