"""Routes between federated daemons (``/v1/federation``).

    POST /v1/federation/gossip     a peer's view of the members, answered with ours (hidden)
    POST /v1/federation/steal      a peer with free slots asks for queued rollouts (hidden)
    POST /v1/federation/adopt      a peer hands over queued rollouts (hidden)
    POST /v1/federation/prefetch   a peer asks this home of some images to fetch them (hidden)
    POST /v1/federation/submit     a front forwards several clients' submits at once (hidden)
    GET  /v1/federation/members    the member table (empty without federation)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from pydantic import BaseModel
from quart import request
from quart_schema import document_response, hide
from quart_trio import QuartTrio

from rolloutd.daemon.api._errors import answer_for
from rolloutd.daemon.api._http import (
    BODY_ERRORS,
    INTERNAL,
    error_body,
    errors,
    json_body,
    json_text,
    parse,
)
from rolloutd.daemon.api._rollouts import SubmitResponse
from rolloutd.daemon.errors import RequestError
from rolloutd.daemon.forward import ForwardedSubmits
from rolloutd.daemon.images import PrefetchRequest
from rolloutd.daemon.service import RolloutRequest, Submitted
from rolloutd.daemon.steal import AdoptRequest, StealRequest

log = logging.getLogger(__name__)


class Peers(Protocol):
    """What these routes call (``rolloutd.daemon.front.Front``)."""

    def members(self) -> list[dict[str, Any]]: ...
    async def gossip(self, read_payload: Callable[[], Awaitable[Any]]) -> dict[str, Any]: ...
    async def steal(self, req: StealRequest) -> dict[str, Any]: ...
    async def adopt(self, req: AdoptRequest) -> dict[str, Any]: ...
    async def prefetch(self, req: PrefetchRequest) -> dict[str, Any]: ...
    async def accept_forwarded(self, origin: str, items: list[tuple[RolloutRequest, list[str]]]
                               ) -> list[Submitted | RequestError]: ...
    def accepted_headers(self, headers: Mapping[str, str]) -> dict[str, str]: ...


class MembersResponse(BaseModel):
    members: list[dict[str, Any]]


def register(app: QuartTrio, peers: Peers) -> None:
    @app.post("/v1/federation/gossip")
    @hide
    async def gossip() -> Any:
        return await peers.gossip(json_body)

    @app.post("/v1/federation/steal")
    @hide
    @errors(*BODY_ERRORS, 404)
    async def steal() -> Any:
        return await peers.steal(parse(StealRequest, await json_body()))

    @app.post("/v1/federation/adopt")
    @hide
    @errors(*BODY_ERRORS, 404)
    async def adopt() -> Any:
        return await peers.adopt(parse(AdoptRequest, await json_body()))

    @app.post("/v1/federation/prefetch")
    @hide
    @errors(*BODY_ERRORS, 404)
    async def prefetch() -> Any:
        return await peers.prefetch(parse(PrefetchRequest, await json_body())), 202

    @app.post("/v1/federation/submit")
    @hide
    @errors(*BODY_ERRORS)
    async def submit_forwarded() -> Any:
        forwarded = parse(ForwardedSubmits, await json_body())
        answers: list[tuple[int, dict[str, Any]] | None] = []
        items: list[tuple[RolloutRequest, list[str]]] = []
        for submit in forwarded.submits:  # each one checked as its own POST /v1/rollouts body
            try:
                items.append((parse(RolloutRequest, submit.request), submit.ids))
                answers.append(None)
            except RequestError as exc:
                answers.append(_error_answer(exc))
        results = iter(await peers.accept_forwarded(forwarded.origin, items) if items else [])
        body = [answer if answer is not None else _answer(next(results)) for answer in answers]
        return json_text(json.dumps({"answers": [{"status": s, "body": b} for s, b in body]}),
                         200, peers.accepted_headers(dict(request.headers)))

    @app.get("/v1/federation/members")
    @document_response(MembersResponse, 200)
    @errors()
    async def members() -> Any:
        """The federation's member table."""
        return {"members": peers.members()}


def _answer(result: Submitted | RequestError) -> tuple[int, dict[str, Any]]:
    """A forwarded submit's answer, as ``POST /v1/rollouts`` gives it (without ``wait``)."""
    if isinstance(result, RequestError):
        return _error_answer(result)
    return 202, SubmitResponse(group_id=result.group_id, ids=[j.id for j in result.jobs],
                               replayed=result.replayed).model_dump()


def _error_answer(exc: RequestError) -> tuple[int, dict[str, Any]]:
    answer = answer_for(exc)
    if answer is None:  # a bug, as it would be on POST /v1/rollouts
        log.error("unhandled error in a forwarded submit", exc_info=exc)
        return 500, error_body(*INTERNAL)
    status, etype = answer
    return status, error_body(etype, str(exc))
