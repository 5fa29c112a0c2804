"""HTTP routes for dynamic-sampling batches (``/v1/batches``). No business logic.

    POST   /v1/batches                 create a batch; 202 with its progress
    GET    /v1/batches/{id}            progress: tried, kept, filtered (and why), in flight, cancelled
    GET    /v1/batches/{id}/groups     NDJSON, one kept group per line as it is kept; ends with the batch
    DELETE /v1/batches/{id}            cancel; running groups are cancelled

A batch created with ``cancel_on_disconnect: true`` (the default) is cancelled when the last
client streaming its groups goes away before the batch ends (``Sampler.groups``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, Field
from quart import Response
from quart_schema import document_querystring, document_request, document_response

from daemon.api import BODY_ERRORS, NDJSON, documented, errors, json_body, parse, query
from daemon.sampling import BatchRequest
from daemon.trajectory import Trajectory

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from daemon.node import Node


class GroupSummary(BaseModel):
    group_id: str
    prompt_index: int
    state: str = Field(description="running | kept | filtered | cancelled")
    reason: str | None = Field(
        None, description="all_equal | low_std | missing_metric | infrastructure | stale"
    )
    detail: str | None = None
    rewards: list[float | None]


class BatchStatus(BaseModel):
    id: str
    state: str = Field(description="running | completed | exhausted | cancelled | lost (an earlier "
                      "daemon process died while it ran; answered from the journal)")
    stop_reason: str | None = Field(
        None,
        description="kept | prompts_exhausted | max_gen_groups | draining | why it was cancelled",
    )
    prompts: int
    group_size: int
    keep: int
    max_in_flight_groups: int
    max_gen_groups: int
    cancel_on_disconnect: bool
    tried: int = Field(description="Groups started.")
    kept: int
    filtered: int
    filtered_reasons: dict[str, int]
    in_flight: int
    cancelled: int = Field(description="Groups stopped unjudged when the batch ended.")
    elapsed_s: float
    created_at: float
    filtered_groups: list[GroupSummary]


class KeptGroup(BaseModel):
    """One line of GET /v1/batches/{id}/groups."""

    group_id: str
    prompt_index: int
    task: dict[str, Any] | None = Field(
        description="The prompt; null in a line sent once the batch has ended with no stream of "
        "its groups open (it is then released: prompts[prompt_index] of the request).",
    )
    rewards: list[float | None]
    rollouts: list[Trajectory]


class KeptGroupLines(KeptGroup):
    """NDJSON: one KeptGroup per line."""

    media_type: ClassVar[str] = NDJSON


class GroupsQuery(BaseModel):
    start: int = Field(0, ge=0, description="Index of the first kept group to send (to reconnect).")


def register_batch_routes(app: QuartTrio, node: Node) -> None:
    sampler = node.sampler
    settings = node.settings
    batch_request = documented(
        BatchRequest,
        maxima={"group_size": node.service.max_group_size,
                "timeout_s": settings.max_timeout_s},
        task="prompts",
    )

    @app.post("/v1/batches")
    @document_request(batch_request)
    @document_response(BatchStatus, 202)
    @errors(*BODY_ERRORS, 429, 503)
    async def create_batch() -> Any:
        """Dynamic sampling: run groups until `keep` pass the filter; 202 with the progress."""
        req = parse(BatchRequest, await json_body())
        batch = await node.create_batch(req)
        return batch.status(), 202, {"Location": f"/v1/batches/{batch.id}"}

    @app.get("/v1/batches/<batch_id>")
    @document_response(BatchStatus, 200)
    @errors(404)
    async def get_batch(batch_id: str) -> Any:
        """Progress: groups tried, kept, filtered (with reasons), in flight, cancelled."""
        return await node.batch_status(batch_id)

    @app.get("/v1/batches/<batch_id>/groups")
    @document_querystring(GroupsQuery)
    @document_response(KeptGroupLines, 200)
    @errors(400, 404)
    async def batch_groups(batch_id: str) -> Any:
        """NDJSON: one kept group per line (see KeptGroup), from index `start`; ends with the batch."""
        batch = sampler.get(batch_id)
        start = query(GroupsQuery).start

        async def lines() -> AsyncIterator[bytes]:
            async with aclosing(sampler.groups(batch, start=start)) as groups:
                async for group in groups:
                    yield (json.dumps(group.line()) + "\n").encode()

        return Response(lines(), mimetype=NDJSON)

    @app.delete("/v1/batches/<batch_id>")
    @document_response(BatchStatus, 200)
    @document_response(BatchStatus, 202)
    @errors(404)
    async def cancel_batch(batch_id: str) -> Any:
        """Cancel: running groups are cancelled (sandboxes released, LLM requests aborted)."""
        return await node.cancel_batch(batch_id)
