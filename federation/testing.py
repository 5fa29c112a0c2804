"""Test helpers: an in-process network of Federation members (no sockets).

`InProcessNetwork` is an httpx transport factory that hands each gossip POST straight to
the addressed member's `handle_gossip`, checking the bearer token as the daemon's route
does. It works under pytest-trio's autojump_clock (nothing touches a socket), so tests can
assert gossip, suspicion and death timings exactly, and benchmarks can simulate hundreds of
members in one process.

    net = InProcessNetwork()
    fed = Federation("a", "http://a:1", seeds=[...], capacity=cap, transport=net.transport("http://a:1"))
    net.add(fed)
    net.kill("http://a:1")       # requests to it now fail to connect
"""

from __future__ import annotations

import json

import httpx
import trio

from ._exceptions import GossipPayloadError
from ._federation import Federation
from ._wire import GOSSIP_PATH, check_token, normalize_url

__all__ = ["InProcessNetwork"]


class InProcessNetwork:
    """Routes gossip between Federation members of one trio run (a labelled test double)."""

    def __init__(self, *, latency_s: float = 0.0) -> None:
        self.latency_s = latency_s
        self._members: dict[str, tuple[Federation, str | None]] = {}
        self._down: set[str] = set()
        self._cut: set[frozenset[str]] = set()
        self.requests = 0

    def add(self, fed: Federation, *, token: str | None = None) -> None:
        """Serve `fed` at its URL; its route requires `token` when one is given."""
        self._members[fed.url] = (fed, token)
        self._down.discard(fed.url)

    def kill(self, url: str) -> None:
        """The member at `url` stops answering (connection refused)."""
        self._down.add(normalize_url(url))

    def cut(self, a: str, b: str) -> None:
        """Drop traffic between two members, both ways."""
        self._cut.add(frozenset((normalize_url(a), normalize_url(b))))

    def transport(self, source_url: str) -> httpx.AsyncBaseTransport:
        """The transport for the member at `source_url` (the source of its requests)."""
        return _Transport(self, normalize_url(source_url))

    async def _handle(self, source: str, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        if self.latency_s:
            await trio.sleep(self.latency_s)
        else:
            await trio.lowlevel.checkpoint()
        target = f"{request.url.scheme}://{request.url.netloc.decode()}"
        entry = self._members.get(target)
        if (
            entry is None
            or target in self._down
            or source in self._down
            or frozenset((source, target)) in self._cut
        ):
            raise httpx.ConnectError(f"{target} is unreachable from {source}", request=request)
        fed, token = entry
        if request.url.path != GOSSIP_PATH or request.method != "POST":
            return _json(404, {"error": {"type": "NotFound", "message": request.url.path}})
        if not check_token(request.headers.get("authorization"), token):
            return _json(401, {"error": {"type": "Unauthorized", "message": "bad token"}})
        try:
            body = fed.handle_gossip(json.loads(await request.aread()))
        except (GossipPayloadError, ValueError) as exc:
            return _json(400, {"error": {"type": "GossipPayloadError", "message": str(exc)}})
        return _json(200, body)


class _Transport(httpx.AsyncBaseTransport):
    def __init__(self, network: InProcessNetwork, source: str) -> None:
        self._network = network
        self._source = source

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._network._handle(self._source, request)


def _json(status: int, body: object) -> httpx.Response:
    return httpx.Response(status, json=body)
