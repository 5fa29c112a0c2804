"""Routes for rollouts (``/v1/rollouts``): submit, wait, stream, look up, cancel.

    POST   /v1/rollouts                 submit one task x n samples; 202 with ids (200 if wait)
    GET    /v1/rollouts                 list the rollouts this daemon holds (filters, pages)
    GET    /v1/rollouts/stream?ids=...  NDJSON, one trajectory per line as each finishes
    POST   /v1/rollouts/stream          the same, the ids in a JSON body (more than a URL holds)
    GET    /v1/rollouts/{id}            the trajectory so far
    DELETE /v1/rollouts/{id}            cancel; 202 while it stops, 200 if it had ended
    GET    /v1/rollouts/{id}/tokens     the text of each token (the served tokenizer's)
    POST   /v1/rollouts/{id}/replay     replay a finished rollout's model outputs: a new rollout
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import Annotated, Any, ClassVar, Protocol

import trio
from pydantic import BaseModel, Field
from quart import request
from quart_schema import document_querystring, document_request, document_response
from quart_trio import QuartTrio

from rolloutd.daemon.api._http import (
    BODY_ERRORS,
    NDJSON,
    IdConverter,
    documented,
    errors,
    json_body,
    json_text,
    ndjson,
    parse,
    query,
)
from rolloutd.daemon.errors import BadRequest
from rolloutd.daemon.forward import PeerAnswer
from rolloutd.daemon.front import Cancelled
from rolloutd.daemon.jobs import RolloutFilter, RolloutSummary
from rolloutd.daemon.service import RolloutRequest, Submitted
from rolloutd.daemon.streams import MAX_STREAM_IDS
from rolloutd.daemon.trajectory import Trajectory

#: Rollouts per page of ``GET /v1/rollouts`` (default and most).
LIST_LIMIT = 50
MAX_LIST_LIMIT = 500
#: The largest ``offset`` of a listing (far beyond any result store).
MAX_LIST_OFFSET = 10_000_000


class Rollouts(Protocol):
    """What these routes call (``rolloutd.daemon.front.Front``)."""

    @property
    def max_group_size(self) -> int: ...
    async def submit(self, body: dict[str, Any], req: RolloutRequest, *, wait: bool,
                     headers: Mapping[str, str]) -> Submitted | PeerAnswer: ...
    def accepted_headers(self, headers: Mapping[str, str]) -> dict[str, str]: ...
    async def rollout(self, job_id: str) -> str: ...
    def list_rollouts(self, match: RolloutFilter, *, limit: int, offset: int) -> dict[str, Any]: ...
    async def cancel(self, job_id: str) -> Cancelled | PeerAnswer: ...
    async def open_stream(self, ids: list[str]) -> trio.MemoryReceiveChannel[str]: ...
    async def replay(self, job_id: str) -> Submitted: ...
    async def token_pieces(self, job_id: str) -> dict[str, Any]: ...


class SubmitResponse(BaseModel):
    group_id: str
    ids: list[str]
    replayed: bool = False


class WaitResponse(BaseModel):
    group_id: str
    rollouts: list[Trajectory]


class RolloutList(BaseModel):
    rollouts: list[RolloutSummary]
    total: int = Field(description="How many rollouts match (the page is `limit` of them from `offset`).")


class ListQuery(RolloutFilter):
    """Filters of a listing (every one given must hold) and the page."""

    limit: int = Field(LIST_LIMIT, ge=1, le=MAX_LIST_LIMIT)
    offset: int = Field(0, ge=0, le=MAX_LIST_OFFSET)


class CancelResponse(BaseModel):
    id: str
    status: str


class TrajectoryLines(Trajectory):
    """NDJSON: one Trajectory per line."""

    media_type: ClassVar[str] = NDJSON


class TokenPieces(BaseModel):
    id: str
    pieces: list[str] = Field(
        description="The text of each of the trajectory's `token_ids` (same length); joined, they "
        "are the decoded sequence. A token holding part of a UTF-8 character has `\"\"` and the "
        "token completing it the whole character."
    )


class ReplayResponse(BaseModel):
    id: str = Field(description="The new rollout (its `replay.of` names the replayed one).")
    group_id: str
    replay_of: str


class SubmitQuery(BaseModel):
    wait: bool = Field(False, description="Answer with the finished trajectories (as the body's `wait`).")


class StreamQuery(BaseModel):
    ids: str = Field(pattern=r"[^,]", description="Rollout ids, comma-separated.")


class StreamRequest(BaseModel):
    """The body of ``POST /v1/rollouts/stream``."""

    ids: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        min_length=1, max_length=MAX_STREAM_IDS,
        description=f"Rollout ids (at most {MAX_STREAM_IDS}); a repeated id counts once.")


class RolloutId(IdConverter):
    reserved = ("stream",)


def register(app: QuartTrio, rollouts: Rollouts, *, max_timeout_s: float) -> None:
    app.url_map.converters["rollout_id"] = RolloutId
    submit_request = documented(
        RolloutRequest, maxima={"n": rollouts.max_group_size, "timeout_s": max_timeout_s}, task="task"
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
        headers = dict(request.headers)
        result = await rollouts.submit(data, req, wait=wait, headers=headers)
        if isinstance(result, PeerAnswer):
            if result.raw is not None:
                return json_text(result.raw, result.status)
            return result.body, result.status
        if not wait:
            body = SubmitResponse(group_id=result.group_id, ids=[j.id for j in result.jobs],
                                  replayed=result.replayed)
            return json_text(body.model_dump_json(), 202, rollouts.accepted_headers(headers))
        trajectories = ",".join(j.trajectory.model_dump_json() for j in result.jobs)
        return json_text(f'{{"group_id":{json.dumps(result.group_id)},"rollouts":[{trajectories}]}}')

    @app.get("/v1/rollouts")
    @document_querystring(ListQuery)
    @document_response(RolloutList, 200)
    @errors(400)
    async def list_rollouts() -> Any:
        """The rollouts this daemon holds, newest first: live ones and finished ones still in
        its result store (`result_ttl_s`, `max_results`); not older journal records, nor
        rollouts forwarded to peers. Filters combine; `total` counts every match."""
        q = query(ListQuery)
        return rollouts.list_rollouts(q, limit=q.limit, offset=q.offset)

    @app.get("/v1/rollouts/stream")
    @document_querystring(StreamQuery)
    @document_response(TrajectoryLines, 200)
    @errors(400, 404, 503)
    async def stream() -> Any:
        """NDJSON: one trajectory per line, in the order they finish. `ids` is comma-separated;
        for more than a URL holds (a few hundred), POST them."""
        return await stream_of(query(StreamQuery).ids.split(","))

    @app.post("/v1/rollouts/stream")
    @document_request(StreamRequest)
    @document_response(TrajectoryLines, 200)
    @errors(*BODY_ERRORS, 404, 503)
    async def stream_posted() -> Any:
        """NDJSON, as `GET /v1/rollouts/stream`, for ids given in the body: a batch of thousands
        of rollouts does not fit in a URL (proxies refuse request lines over 8 kB, httpx URLs over
        64 kB)."""
        return await stream_of(parse(StreamRequest, await json_body()).ids)

    async def stream_of(given: list[str]) -> Any:
        # at least one id: the query's pattern and the body's schema say so
        ids = list(dict.fromkeys(i for i in given if i))
        if len(ids) > MAX_STREAM_IDS:
            raise BadRequest(f"at most {MAX_STREAM_IDS} ids per stream")
        recv = await rollouts.open_stream(ids)

        async def lines() -> AsyncGenerator[str]:
            with recv:
                for _ in ids:
                    yield await recv.receive()

        return ndjson(lines())

    @app.get("/v1/rollouts/<rollout_id:job_id>")
    @document_response(Trajectory, 200)
    @errors(400, 404, 503)  # 400: `stream` is no rollout id (GET /v1/rollouts/stream wants ?ids)
    async def get_rollout(job_id: str) -> Any:
        """The trajectory so far (``status`` says whether it is finished)."""
        return json_text(await rollouts.rollout(job_id))

    @app.get("/v1/rollouts/<rollout_id:job_id>/tokens")
    @document_response(TokenPieces, 200)
    @errors(404, 503)
    async def token_pieces(job_id: str) -> Any:
        """The text of each token of the trajectory, decoded by the served model's tokenizer."""
        return await rollouts.token_pieces(job_id)

    @app.post("/v1/rollouts/<rollout_id:job_id>/replay")
    @document_response(ReplayResponse, 202)
    @errors(404, 409, 429, 503)
    async def replay(job_id: str) -> Any:
        """Replay a finished rollout: the same task in a fresh sandbox, each turn answered
        with the recorded turn's sampled tokens (no model); the new rollout's `replay` says
        whether the tool outputs equal the recorded ones. 409: not finished, no turns, or
        its task is no longer held."""
        sub = await rollouts.replay(job_id)
        body = ReplayResponse(id=sub.jobs[0].id, group_id=sub.group_id, replay_of=job_id)
        return body.model_dump(), 202

    @app.delete("/v1/rollouts/<rollout_id:job_id>")
    @document_response(CancelResponse, 200)
    @document_response(CancelResponse, 202)
    @errors(404, 405, 503)  # 405: `stream` is no rollout id
    async def cancel_rollout(job_id: str) -> Any:
        """Cancel: the sandbox is torn down and the LLM request aborted."""
        result = await rollouts.cancel(job_id)
        if isinstance(result, PeerAnswer):
            return result.body, result.status
        return result.body, 200 if result.ended else 202
