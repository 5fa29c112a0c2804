"""Routes for operating a daemon: status, liveness, readiness, Prometheus metrics.

    GET /v1/status      stages, backends, sandboxes, images, tools, the last hour, federation
    GET /healthz        liveness (no token needed)
    GET /readyz         503 while starting or draining
    GET /metrics        Prometheus text (not in the OpenAPI document)
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field
from quart import Response
from quart_schema import document_response, hide
from quart_trio import QuartTrio

from rolloutd.daemon.api._http import error, errors
from rolloutd.daemon.metrics import HistoryView, ToolRow


class Operations(Protocol):
    """What these routes read (``rolloutd.daemon.node.Node``)."""

    @property
    def ready(self) -> bool: ...
    @property
    def draining(self) -> bool: ...
    def status(self) -> dict[str, Any]: ...
    def metrics_text(self) -> tuple[bytes, str]: ...


class HealthResponse(BaseModel):
    ok: bool


class ReadyResponse(BaseModel):
    ready: bool


class StatusResponse(BaseModel):
    """Stages, backends, sandboxes, images, tools, the last hour, federation."""

    model_config = ConfigDict(extra="allow")

    tools: list[ToolRow] = Field(description="Each tool's calls (of finished rollouts) and latency, "
                                 "most called first.")
    history: HistoryView = Field(description="Finished rollouts and their mean reward per minute, "
                                 "the last hour.")


def register(app: QuartTrio, node: Operations) -> None:
    @app.get("/v1/status")
    @document_response(StatusResponse, 200)
    @errors()
    async def status() -> Any:
        """Stages, backends, sandboxes, images, tools, the last hour, federation."""
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
