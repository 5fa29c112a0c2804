"""Routes for dynamic-sampling batches (``/v1/batches``).

    POST   /v1/batches                 create a batch; 202 with its progress
    GET    /v1/batches/{id}            progress: tried, kept, filtered (and why), in flight, cancelled
    GET    /v1/batches/{id}/groups     NDJSON, one kept group per line as it is kept; ends with the batch
    DELETE /v1/batches/{id}            cancel; running groups are cancelled

A batch created with ``cancel_on_disconnect: true`` (the default) is cancelled when the last
client streaming its groups goes away before the batch ends (``Sampler.groups``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, Field
from quart_schema import document_querystring, document_request, document_response
from quart_trio import QuartTrio

from rolloutd.daemon.api._http import (
    BODY_ERRORS,
    NDJSON,
    documented,
    errors,
    json_body,
    ndjson,
    parse,
    query,
)
from rolloutd.daemon.batch import Batch, BatchRequest
from rolloutd.daemon.front import Cancelled
from rolloutd.daemon.trajectory import Trajectory


class Batches(Protocol):
    """What these routes call (``rolloutd.daemon.front.Front``)."""

    @property
    def max_group_size(self) -> int: ...
    async def create_batch(self, req: BatchRequest) -> Batch: ...
    async def batch(self, batch_id: str) -> dict[str, Any]: ...
    async def cancel_batch(self, batch_id: str) -> Cancelled: ...
    def batch_groups(self, batch_id: str, *, start: int = 0) -> AsyncGenerator[dict[str, Any]]: ...


class GroupSummary(BaseModel):
    group_id: str
    prompt_index: int
    state: str = Field(description="running | kept | filtered | cancelled | carried")
    reason: str | None = Field(
        None, description="all_equal | low_std | missing_metric | infrastructure | stale"
    )
    detail: str | None = None
    rewards: list[float | None]
    carried_from: str | None = Field(
        None, description="The batch of the same stream that started this group, if not this one."
    )


class LengthStats(BaseModel):
    groups: int
    mean_duration_s: float | None = Field(
        description="Mean over groups of the slowest sample's time from submission to its end."
    )
    mean_tokens: float | None = Field(description="Mean sampled tokens per sample.")


class Lengths(BaseModel):
    kept: LengthStats
    offered: LengthStats = Field(description="Every group this batch judged (kept or filtered).")


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
    cancelled: int = Field(description="Groups stopped unjudged (see cancelled_reasons).")
    cancelled_reasons: dict[str, int] = Field(
        description="batch_full (no stream, or carry_over false) | batch_ended (exhausted or "
        "cancelled) | not_adopted (carried, but no batch of the stream came within carry_ttl_s) "
        "| the daemon stopped"
    )
    stream: str | None
    carried_in: int = Field(description="Groups adopted from the stream's previous batch.")
    carried_out: int = Field(description="Groups passed on to the stream's next batch.")
    carried_to: str | None = Field(description="The batch that adopted them (null until then).")
    lengths: Lengths = Field(description="Kept versus offered groups' durations and lengths.")
    wasted_sample_s: float = Field(
        description="Sample-seconds (INIT+RUN+EVAL) of the groups cancelled unjudged."
    )
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
    carried_from: str | None = Field(
        None, description="Started by this stream batch (its prompts[prompt_index]), not this one."
    )
    rollouts: list[Trajectory]


class KeptGroupLines(KeptGroup):
    """NDJSON: one KeptGroup per line."""

    media_type: ClassVar[str] = NDJSON


class GroupsQuery(BaseModel):
    start: int = Field(0, ge=0, description="Index of the first kept group to send (to reconnect).")


def register(app: QuartTrio, batches: Batches, *, max_timeout_s: float) -> None:
    batch_request = documented(
        BatchRequest,
        maxima={"group_size": batches.max_group_size, "timeout_s": max_timeout_s},
        task="prompts",
    )

    @app.post("/v1/batches")
    @document_request(batch_request)
    @document_response(BatchStatus, 202)
    @errors(*BODY_ERRORS, 429, 503)
    async def create_batch() -> Any:
        """Dynamic sampling: run groups until `keep` pass the filter; 202 with the progress."""
        req = parse(BatchRequest, await json_body())
        batch = await batches.create_batch(req)
        return batch.status(), 202, {"Location": f"/v1/batches/{batch.id}"}

    @app.get("/v1/batches/<batch_id>")
    @document_response(BatchStatus, 200)
    @errors(404)
    async def get_batch(batch_id: str) -> Any:
        """Progress: groups tried, kept, filtered (with reasons), in flight, cancelled."""
        return await batches.batch(batch_id)

    @app.get("/v1/batches/<batch_id>/groups")
    @document_querystring(GroupsQuery)
    @document_response(KeptGroupLines, 200)
    @errors(400, 404)
    async def batch_groups(batch_id: str) -> Any:
        """NDJSON: one kept group per line (see KeptGroup), from index `start`; ends with the batch."""
        groups = batches.batch_groups(batch_id, start=query(GroupsQuery).start)

        async def lines() -> AsyncGenerator[str]:
            async with aclosing(groups):
                async for line in groups:
                    yield json.dumps(line)

        return ndjson(lines())

    @app.delete("/v1/batches/<batch_id>")
    @document_response(BatchStatus, 200)
    @document_response(BatchStatus, 202)
    @errors(404)
    async def cancel_batch(batch_id: str) -> Any:
        """Cancel: running groups are cancelled (sandboxes released, LLM requests aborted)."""
        result = await batches.cancel_batch(batch_id)
        return result.body, 200 if result.ended else 202
