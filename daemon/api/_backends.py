"""Routes for the LLM backend pool and weight sync (``/v1/backends``, ``/v1/policy_version``).

    GET    /v1/backends                 the pool and the policy version
    POST   /v1/backends                 register a backend (a spec per kind, see docs/llm.md)
    DELETE /v1/backends/{id}            remove one
    POST   /v1/backends/pause|resume    stop / restart sending new LLM requests
    POST   /v1/backends/{id}/reload     weight sync from a directory of safetensors
    PUT    /v1/policy_version           stamp later turns with this version
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, RootModel
from quart_schema import document_request, document_response
from quart_trio import QuartTrio

from rolloutd.daemon.api._http import BODY_ERRORS, IdConverter, errors, json_body, parse
from rolloutd.daemon.llm import RESERVED_IDS, BackendSpec, ReloadRequest


class Backends(Protocol):
    """What these routes call (``rolloutd.daemon.backends.Backends``)."""

    def describe(self) -> dict[str, Any]: ...
    async def add(self, spec: dict[str, Any]) -> str: ...
    async def remove(self, backend_id: str) -> None: ...
    async def pause(self) -> None: ...
    def resume(self) -> None: ...
    def set_policy_version(self, version: int) -> None: ...
    async def reload(self, backend_id: str, req: ReloadRequest) -> dict[str, Any]: ...


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


class ReloadResponse(BaseModel):
    model_config = ConfigDict(extra="allow")


class BackendId(IdConverter):
    """A backend id: never one of the fixed segments beside it (``/v1/backends/pause``)."""

    reserved = RESERVED_IDS


#: POST /v1/backends: a backend spec, one model per kind (``rolloutd.daemon.llm.BackendSpec``, whose
#: ``id`` names it in the pool; see docs/llm.md).
BackendRegistration = RootModel[BackendSpec]



class PolicyVersion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0)


def register(app: QuartTrio, backends: Backends) -> None:
    app.url_map.converters["backend_id"] = BackendId

    @app.get("/v1/backends")
    @document_response(BackendsResponse, 200)
    @errors(503)
    async def list_backends() -> Any:
        """The LLM backend pool."""
        return backends.describe()

    @app.post("/v1/backends")
    @document_request(BackendRegistration)
    @document_response(BackendAdded, 201)
    @errors(*BODY_ERRORS, 503)
    async def add_backend() -> Any:
        """Register a backend (a trainer re-registers after a weight sync)."""
        data = await json_body()
        parse(BackendRegistration, data)
        backend_id = await backends.add({k: v for k, v in data.items() if v is not None})
        return {"id": backend_id}, 201

    @app.delete("/v1/backends/<backend_id:backend_id>")
    @document_response(BackendRemoved, 200)
    @errors(404, 405, 503)  # 405: `pause` and `resume` are no backend ids
    async def remove_backend(backend_id: str) -> Any:
        await backends.remove(backend_id)
        return {"id": backend_id, "removed": True}

    @app.post("/v1/backends/pause")
    @document_response(PausedResponse, 200)
    @errors(503)
    async def pause_backends() -> Any:
        """Stop sending new LLM requests (before a weight sync)."""
        await backends.pause()
        return {"paused": True}

    @app.post("/v1/backends/resume")
    @document_response(PausedResponse, 200)
    @errors(503)
    async def resume_backends() -> Any:
        backends.resume()
        return {"paused": False}

    @app.post("/v1/backends/<backend_id:backend_id>/reload")
    @document_request(ReloadRequest)
    @document_response(ReloadResponse, 200)
    @errors(*BODY_ERRORS, 404, 503)
    async def reload_backend(backend_id: str) -> Any:
        """Weight sync: pause, load the weights into this backend, drop its cache, set the
        policy version, resume."""
        return await backends.reload(backend_id, parse(ReloadRequest, await json_body()))

    @app.put("/v1/policy_version")
    @document_request(PolicyVersion)
    @document_response(PolicyVersion, 200)
    @errors(*BODY_ERRORS, 503)
    async def put_policy_version() -> Any:
        """Every later turn is stamped with this version."""
        body = parse(PolicyVersion, await json_body())
        backends.set_policy_version(body.version)
        return {"version": body.version}
