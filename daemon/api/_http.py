"""What every route of the HTTP API shares: reading bodies and queries, error answers, and
the OpenAPI document's corrections. No route lives here (see the resource modules).

Every error is JSON ``{"error": {"type": ..., "message": ...}}`` (``ErrorResponse``) with a 4xx
status (503 while unavailable or draining); a 500 would be a bug. The OpenAPI document
(``/openapi.json``) lists, per route, every status it can answer, and request schemas as
strict as the checks behind them (bounds that come from the settings included);
``tests/hostile/test_schemathesis.py`` holds it to that.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from quart import Response, request
from quart_schema import OpenAPIProvider, document_response, security_scheme
from werkzeug.routing import BaseConverter

from rolloutd.daemon.errors import BadRequest, InvalidRequest

NDJSON = "application/x-ndjson"
MAX_JSON_DEPTH = 64

_F = TypeVar("_F", bound=Callable[..., Any])
_M = TypeVar("_M", bound=BaseModel)


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str = Field(description="Machine-readable: not_found, invalid_request, queue_full, ...")
    message: str


class ErrorResponse(BaseModel):
    """The body of every error answer."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorBody


class IdConverter(BaseConverter):
    """A path segment naming a resource, other than the fixed segments beside it
    (``/v1/backends/pause`` is never backend ``pause``)."""

    reserved: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.regex = rf"(?!(?:{'|'.join(cls.reserved)})$)[^/]+"


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


class OpenAPIDocument(OpenAPIProvider):
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
        if isinstance(converter, IdConverter):
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


#: ``error.type`` and message of the answer to a bug (500): the details go to the daemon log.
INTERNAL = ("internal", "internal error; see the daemon log")


def error_body(etype: str, message: str) -> dict[str, Any]:
    """The body of every error answer (``ErrorResponse``)."""
    return {"error": {"type": etype, "message": message}}


def error(status: int, etype: str, message: str, *, retry_after_s: float | None = None) -> Response:
    body = json.dumps(error_body(etype, message))
    resp = Response(body, status=status, mimetype="application/json")
    if retry_after_s is not None:
        resp.headers["Retry-After"] = str(int(max(1, retry_after_s)))
    return resp


async def discard_body() -> None:
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
        raise InvalidRequest(f"the number {text[:40]} is not finite (JSON numbers must be)")
    return int(value) if value.is_integer() else value


def _no_constant(name: str) -> Any:
    raise InvalidRequest(f"{name} is not a JSON number (numbers must be finite)")


async def json_body() -> Any:
    """The request's JSON body. NaN, Infinity and numbers too large for a float (which
    Python's json would accept) are refused here (422), so they never reach a model. JSON
    has one number type (``2.0`` is ``2``, also to JSON Schema): integral numbers are ints."""
    raw = await request.get_data(cache=False)
    if not raw:
        raise BadRequest("the request has no JSON body")
    try:
        data = json.loads(raw, parse_float=_number, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"the body is not valid JSON: {str(exc)[:200]}") from None
    if _depth(data, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise BadRequest(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels")
    return data


def query(model: type[BaseModel]) -> Any:
    """The query string, checked against ``model`` (400 when it does not fit)."""
    try:
        return model.model_validate(request.args.to_dict())
    except ValidationError as exc:
        details = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:20])
        raise BadRequest(f"bad query string: {details}") from None


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
        raise InvalidRequest(details) from None


def json_text(text: str | bytes, status: int = 200,
              headers: Mapping[str, str] | None = None) -> Response:
    """An answer whose JSON is serialized already: a trajectory from ``model_dump_json`` (pydantic's
    serializer, several times faster than a dict through the JSON provider: 8 against 53 ms for
    four trajectories of 32,000 tokens), or a peer's answer relayed as it came. A hot route's
    small answer too: quart-schema converts each dict a route returns, and each dict of
    headers, through a new pydantic ``TypeAdapter`` (about 30 us each here), and a ``Response``
    it passes through as it is."""
    return Response(text, status=status, headers=dict(headers or {}), mimetype="application/json")


def ndjson(lines: AsyncGenerator[str]) -> Response:
    """A streamed answer: each JSON text from ``lines`` on a line of its own."""

    async def body() -> AsyncIterator[bytes]:
        async with aclosing(lines) as texts:
            async for text in texts:
                yield (text + "\n").encode()

    return Response(body(), mimetype=NDJSON)
