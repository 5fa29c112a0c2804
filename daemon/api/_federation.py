"""Routes between federated daemons (``/v1/federation``).

    POST /v1/federation/gossip     a peer's view of the members, answered with ours (hidden)
    POST /v1/federation/steal      a peer with free slots asks for queued rollouts (hidden)
    POST /v1/federation/adopt      a peer hands over queued rollouts (hidden)
    POST /v1/federation/prefetch   a peer asks this home of some images to fetch them (hidden)
    GET  /v1/federation/members    the member table (empty without federation)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from pydantic import BaseModel
from quart_schema import document_response, hide
from quart_trio import QuartTrio

from rolloutd.daemon.api._http import BODY_ERRORS, errors, json_body, parse
from rolloutd.daemon.images import PrefetchRequest
from rolloutd.daemon.steal import AdoptRequest, StealRequest


class Peers(Protocol):
    """What these routes call (``rolloutd.daemon.front.Front``)."""

    def members(self) -> list[dict[str, Any]]: ...
    async def gossip(self, read_payload: Callable[[], Awaitable[Any]]) -> dict[str, Any]: ...
    async def steal(self, req: StealRequest) -> dict[str, Any]: ...
    async def adopt(self, req: AdoptRequest) -> dict[str, Any]: ...
    async def prefetch(self, req: PrefetchRequest) -> dict[str, Any]: ...


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

    @app.get("/v1/federation/members")
    @document_response(MembersResponse, 200)
    @errors()
    async def members() -> Any:
        """The federation's member table."""
        return {"members": peers.members()}
