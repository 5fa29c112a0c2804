"""HTTP API v1: quart-trio routes and their request/response models. No business logic.

Every error is JSON ``{"error": {"type": ..., "message": ...}}`` with a 4xx status (503
while unavailable or draining); a 500 would be a bug. A bearer token, when configured, guards
every route but ``/healthz``. The OpenAPI document (``/openapi.json``) lists, per route, every
status it can answer, and request schemas as strict as the checks behind them (bounds that
come from the settings included); ``tests/hostile/test_schemathesis.py`` holds it to that.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, TypeVar, Union, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    ValidationError,
    create_model,
)
from quart import Response, request
from quart_schema import (
    HttpSecurityScheme,
    OpenAPIProvider,
    QuartSchema,
    document_querystring,
    document_request,
    document_response,
    hide,
    security_scheme,
)
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException
from werkzeug.routing import BaseConverter

from daemon.jobs import Job
from daemon.llm import BackendSpec, ReloadRequest
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
    model_config = ConfigDict(extra="forbid")

    type: str = Field(description="Machine-readable: not_found, invalid_request, queue_full, ...")
    message: str


class ErrorResponse(BaseModel):
    """The body of every error answer."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorBody


class TrajectoryLines(Trajectory):
    """NDJSON: one Trajectory per line."""

    media_type: ClassVar[str] = NDJSON


class SubmitQuery(BaseModel):
    wait: bool = Field(False, description="Answer with the finished trajectories (as the body's `wait`).")


class StreamQuery(BaseModel):
    ids: str = Field(pattern=r"[^,]", description="Rollout ids, comma-separated.")


class BackendsResponse(BaseModel):
    backends: list[dict[str, Any]]
    policy_version: int


class BackendAdded(BaseModel):
    id: str


class BackendRemoved(BaseModel):
    id: str
    removed: bool


class PausedResponse(BaseModel):
    paused: bool


class HealthResponse(BaseModel):
    ok: bool


class ReadyResponse(BaseModel):
    ready: bool


class MembersResponse(BaseModel):
    members: list[dict[str, Any]]


class StatusResponse(BaseModel):
    """Stages, backends, sandboxes, federation."""

    model_config = ConfigDict(extra="allow")


class ReloadResponse(BaseModel):
    model_config = ConfigDict(extra="allow")


class _IdConverter(BaseConverter):
    """A path segment naming a resource, other than the fixed segments beside it
    (``/v1/backends/pause`` is never backend ``pause``)."""

    reserved: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.regex = rf"(?!(?:{'|'.join(cls.reserved)})$)[^/]+"


class _BackendId(_IdConverter):
    reserved = ("pause", "resume")


class _RolloutId(_IdConverter):
    reserved = ("stream",)


def _backend_id(value: str | None) -> str | None:
    if value in _BackendId.reserved:
        raise ValueError(f"{value!r} is a fixed path segment under /v1/backends")
    return value


def _registration(spec: Any) -> type[RootModel[Any]]:
    """POST /v1/backends: a backend spec (``daemon.llm.BackendSpec``, one model per kind, see
    docs/llm.md) plus the ``id`` the pool gives it."""
    backend_id = Annotated[
        str | None,
        Field(min_length=1, pattern=r"^[^/]+$", json_schema_extra={"not": {"enum": list(_BackendId.reserved)}},
              description="The backend's id in the pool (default: generated)."),
        AfterValidator(_backend_id),
    ]
    union, *_ = get_args(spec)
    kinds = tuple(create_model(m.__name__, __base__=m, id=(backend_id, None)) for m in get_args(union))
    return RootModel[Annotated[Union[kinds], Field(discriminator="kind")]]  # type: ignore[misc,return-value,valid-type]  # noqa: UP007


BackendRegistration = _registration(BackendSpec)


class PolicyVersion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0)


class _ReloadFailed(ServiceError):
    status, type = 422, "reload_failed"


_F = TypeVar("_F", bound=Callable[..., Any])
_M = TypeVar("_M", bound=BaseModel)


#: What each status means on every route that can answer it (the body is an ErrorResponse).
#: 400: no body, not JSON, too deep, a bad query; 401: no or a wrong bearer token;
#: 404: unknown id; 405: a fixed path segment given as an id (DELETE /v1/backends/pause);
#: 409: an idempotency key reused with another body; 413: body too large;
#: 422: the body fails validation; 429: queue full, retry after ``Retry-After``;
#: 503: draining, no backend pool, or a peer unreachable.
def errors(*statuses: int, public: bool = False) -> Callable[[_F], _F]:
    """Document the error answers of a route (401 too unless ``public``)."""

    def decorate(func: _F) -> _F:
        for status in sorted({*statuses, *(() if public else (401,))}):
            func = document_response(ErrorResponse, status)(func)
        if public:
            func = security_scheme([])(func)
        return func

    return decorate


#: Error answers of every route that reads a JSON body.
BODY_ERRORS = (400, 413, 422)


class _OpenAPI(OpenAPIProvider):
    """quart-schema's document, corrected to say what the routes do: a JSON body is required,
    required query parameters are marked so, and a response model's ``media_type`` (NDJSON
    streams) replaces JSON."""

    def build_request_body(self, model: Any, source: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        body, definitions = super().build_request_body(model, source)
        task = getattr(model, "task_field", None)  # see documented()
        if isinstance(task, str):
            properties = body["content"]["application/json"]["schema"]["properties"]
            if properties[task].get("type") == "array":
                properties[task]["items"] = TASK_REF
            else:
                properties[task] = {**TASK_REF, "description": properties[task].get("description", "")}
        return {**body, "required": True}, definitions

    def build_path_parameter(self, name: str, converter: BaseConverter) -> dict[str, Any]:
        param = super().build_path_parameter(name, converter)
        if isinstance(converter, _IdConverter):
            param["schema"] = {"type": "string", "pattern": "^[^/]+$",
                               "not": {"enum": list(converter.reserved)}}
        return param

    def build_querystring_parameters(self, model: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        parameters, definitions = super().build_querystring_parameters(model)
        for param in parameters:
            param["required"] = model.model_fields[param["name"]].is_required()
        return parameters, definitions

    def build_response_object(self, model: Any, headers_model: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        obj, definitions = super().build_response_object(model, headers_model)
        media_type = getattr(model, "media_type", None)
        if isinstance(media_type, str):
            obj["content"] = {media_type: obj["content"].pop("application/json"), **obj["content"]}
        return obj, definitions


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


def _number(text: str) -> float | int:
    value = float(text)
    if not math.isfinite(value):
        raise _Unprocessable(f"the number {text[:40]} is not finite (JSON numbers must be)")
    return int(value) if value.is_integer() else value


def _no_constant(name: str) -> Any:
    raise _Unprocessable(f"{name} is not a JSON number (numbers must be finite)")


async def json_body() -> Any:
    """The request's JSON body. NaN, Infinity and numbers too large for a float (which
    Python's json would accept) are refused here (422), so they never reach a model. JSON
    has one number type (``2.0`` is ``2``, also to JSON Schema): integral numbers are ints."""
    raw = await request.get_data(cache=False)
    if not raw:
        raise ServiceError("the request has no JSON body")
    try:
        data = json.loads(raw, parse_float=_number, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ServiceError(f"the body is not valid JSON: {str(exc)[:200]}") from None
    if _depth(data, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise ServiceError(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels")
    return data


def query(model: type[BaseModel]) -> Any:
    """The query string, checked against ``model`` (400 when it does not fit)."""
    try:
        return model.model_validate(request.args.to_dict())
    except ValidationError as exc:
        details = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:20])
        raise ServiceError(f"bad query string: {details}") from None


#: Where the OpenAPI document keeps its schemas (quart-schema's layout).
REF_TEMPLATE = "#/components/schemas/{model}"
#: The schema of a task: one of the registered kinds' models (see ``TaskRegistry.task_schemas``).
TASK_REF = {"$ref": REF_TEMPLATE.format(model="Task")}


def documented(model: type[_M], *, maxima: dict[str, float], task: str) -> type[_M]:
    """``model`` whose JSON schema also states what the service checks beyond the model:
    the maxima that come from the settings (checked with messages naming the setting), and
    the task's shape per kind (field ``task``, or the items of field ``task`` when it is a
    list). Requests are still parsed with ``model`` itself."""

    def extra(schema: dict[str, Any]) -> None:
        for name, maximum in maxima.items():
            field = schema["properties"][name]
            for branch in field.get("anyOf", [field]):
                if branch.get("type") in ("integer", "number"):
                    branch["maximum"] = maximum

    config = ConfigDict(**{**model.model_config, "json_schema_extra": extra})  # type: ignore[typeddict-item]
    namespace = {"__doc__": model.__doc__, "model_config": config, "task_field": task,
                 "__annotations__": {"task_field": ClassVar[str]}}
    return type(model.__name__, (model,), namespace)


def parse(model: type[BaseModel], data: Any) -> Any:
    """``data`` (a JSON body) as ``model``, with JSON's types exactly: no string is read as a
    number or a boolean, and no number as a boolean (pydantic would, outside strict mode)."""
    try:
        return model.model_validate(data, strict=True)
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
    app.url_map.converters.update(backend_id=_BackendId, rollout_id=_RolloutId)
    app.config["MAX_CONTENT_LENGTH"] = node.settings.max_body_bytes
    app.config["BODY_TIMEOUT"] = 60
    app.config["RESPONSE_TIMEOUT"] = None
    task_schema, task_definitions = node.service.registry.task_schemas(REF_TEMPLATE)

    class OpenAPI(_OpenAPI):
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
        openapi_provider_class=OpenAPI,
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
        if "Allow" in dict(exc.get_headers()):  # 405 names the methods the route has
            resp.headers["Allow"] = dict(exc.get_headers())["Allow"]
        if status == 413:
            # The rest of the body is never read: end the connection rather than leave it stuck.
            resp.headers["Connection"] = "close"
        return resp

    @app.errorhandler(Exception)
    async def _bug(exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.path, exc_info=exc)
        return error(500, "internal", "internal error; see the daemon log")

    # ---- rollouts --------------------------------------------------------------------

    settings = node.settings
    max_n = node.service.max_group_size
    submit_request = documented(
        RolloutRequest, maxima={"n": max_n, "timeout_s": settings.max_timeout_s}, task="task"
    )

    @app.post("/v1/rollouts")
    @document_request(submit_request)
    @document_querystring(SubmitQuery)
    @document_response(SubmitResponse, 202)
    @document_response(WaitResponse, 200)
    @errors(*BODY_ERRORS, 409, 429, 503)
    async def submit() -> Any:
        """Submit one task x n samples; 202 with ids, or 200 with the trajectories if `wait`."""
        data = await json_body()
        req = parse(RolloutRequest, data)
        wait = query(SubmitQuery).wait or req.wait  # the query is checked either way
        forwarded = await node.maybe_forward(data, wait=wait, headers=dict(request.headers))
        if forwarded is not None:
            return forwarded[1], forwarded[0]
        sub = await node.accept(req)
        if not wait:
            body = SubmitResponse(group_id=sub.group_id, ids=[j.id for j in sub.jobs], replayed=sub.replayed)
            return body.model_dump(), 202
        await service.wait(sub.jobs)
        return {"group_id": sub.group_id, "rollouts": [_dump(j) for j in sub.jobs]}, 200

    @app.get("/v1/rollouts/stream")
    @document_querystring(StreamQuery)
    @document_response(TrajectoryLines, 200)
    @errors(400, 404, 503)
    async def stream() -> Any:
        """NDJSON: one trajectory per line, in the order they finish. `ids` is comma-separated."""
        ids = list(dict.fromkeys(i for i in query(StreamQuery).ids.split(",") if i))
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

    @app.get("/v1/rollouts/<rollout_id:job_id>")
    @document_response(Trajectory, 200)
    @errors(400, 404, 503)  # 400: `stream` is no rollout id (GET /v1/rollouts/stream wants ?ids)
    async def get_rollout(job_id: str) -> Any:
        """The trajectory so far (``status`` says whether it is finished)."""
        return await node.rollout_json(job_id)

    @app.delete("/v1/rollouts/<rollout_id:job_id>")
    @document_response(CancelResponse, 200)
    @document_response(CancelResponse, 202)
    @errors(404, 405, 503)  # 405: `stream` is no rollout id
    async def cancel_rollout(job_id: str) -> Any:
        """Cancel: the sandbox is torn down and the LLM request aborted."""
        return await node.cancel_json(job_id)

    # ---- backends ------------------------------------------------------------------

    def _pool() -> Any:
        if node.pool is None:
            raise ServiceUnavailable("this daemon has no LLM backend pool")
        return node.pool

    @app.get("/v1/backends")
    @document_response(BackendsResponse, 200)
    @errors(503)
    async def list_backends() -> Any:
        """The LLM backend pool."""
        return {"backends": _pool().describe(), "policy_version": _pool().policy_version}

    @app.post("/v1/backends")
    @document_request(BackendRegistration)
    @document_response(BackendAdded, 201)
    @errors(*BODY_ERRORS, 503)
    async def add_backend() -> Any:
        """Register a backend (a trainer re-registers after a weight sync)."""
        data = await json_body()
        parse(BackendRegistration, data)
        backend_id = await node.add_backend({k: v for k, v in data.items() if v is not None})
        return {"id": backend_id}, 201

    @app.delete("/v1/backends/<backend_id:backend_id>")
    @document_response(BackendRemoved, 200)
    @errors(404, 405, 503)  # 405: `pause` and `resume` are no backend ids
    async def remove_backend(backend_id: str) -> Any:
        pool = _pool()
        if not any(b["id"] == backend_id for b in pool.describe()):
            raise NotFound(f"no backend with id {backend_id!r}")
        await pool.remove(backend_id)
        return {"id": backend_id, "removed": True}

    @app.post("/v1/backends/pause")
    @document_response(PausedResponse, 200)
    @errors(503)
    async def pause_backends() -> Any:
        """Stop sending new LLM requests (before a weight sync)."""
        await _pool().pause()
        return {"paused": True}

    @app.post("/v1/backends/resume")
    @document_response(PausedResponse, 200)
    @errors(503)
    async def resume_backends() -> Any:
        _pool().resume()
        return {"paused": False}

    @app.post("/v1/backends/<backend_id:backend_id>/reload")
    @document_request(ReloadRequest)
    @document_response(ReloadResponse, 200)
    @errors(*BODY_ERRORS, 404, 503)
    async def reload_backend(backend_id: str) -> Any:
        """Weight sync: pause, load the weights into this backend, drop its cache, set the
        policy version, resume."""
        from daemon.llm.base import BackendUnavailable, LLMError

        body = parse(ReloadRequest, await json_body())
        pool = _pool()
        if not any(b["id"] == backend_id for b in pool.describe()):
            raise NotFound(f"no backend with id {backend_id!r}")
        try:
            return await pool.reload(backend_id, body)
        except BackendUnavailable as exc:
            raise ServiceUnavailable(f"reload failed: {exc}") from None
        except LLMError as exc:
            raise _ReloadFailed(str(exc)) from None

    @app.put("/v1/policy_version")
    @document_request(PolicyVersion)
    @document_response(PolicyVersion, 200)
    @errors(*BODY_ERRORS, 503)
    async def put_policy_version() -> Any:
        """Every later turn is stamped with this version."""
        body = parse(PolicyVersion, await json_body())
        _pool().set_policy_version(body.version)
        return {"version": body.version}

    # ---- operations -----------------------------------------------------------------

    @app.get("/v1/status")
    @document_response(StatusResponse, 200)
    @errors()
    async def status() -> Any:
        """Stages, backends, sandboxes, federation."""
        return node.status()

    @app.get("/healthz")
    @document_response(HealthResponse, 200)
    @errors(public=True)
    async def healthz() -> Any:
        """Liveness; needs no token."""
        return {"ok": True}

    @app.get("/readyz")
    @document_response(ReadyResponse, 200)
    @errors(503)
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
    @document_response(MembersResponse, 200)
    @errors()
    async def members() -> Any:
        """The federation's member table."""
        if node.federation is None:
            return {"members": []}
        return {"members": node.federation.members()}

    from daemon.batch_api import register_batch_routes

    register_batch_routes(app, node)
    return app
