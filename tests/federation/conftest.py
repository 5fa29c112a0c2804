"""Fixtures for federation tests: capacities, in-process clusters, real loopback servers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from rolloutd.federation import (
    GOSSIP_PATH,
    MEMBERS_PATH,
    Capacity,
    Federation,
    GossipPayloadError,
    Member,
    check_token,
    forward_headers,
    is_forwarded,
)
from rolloutd.federation.testing import InProcessNetwork


@dataclass
class Cap:
    """A node's capacity, mutable by the test; called like the daemon's callback."""

    free_slots: int = 4
    queued: int = 0
    in_flight: int = 0
    waiting: int = 0
    healthy_backends: int = 1
    draining: bool = False
    slots: int = 0  # 0: not reported (a member older than the field)
    rate: float = 0.0  # 0: not measured yet (or a member older than the field)

    def __call__(self) -> Capacity:
        return Capacity(
            free_slots=self.free_slots,
            queued=self.queued,
            in_flight=self.in_flight,
            waiting=self.waiting,
            healthy_backends=self.healthy_backends,
            draining=self.draining,
            slots=self.slots,
            rate=self.rate,
        )


@dataclass
class Node:
    """One member of an in-process test cluster, with the scope that runs it."""

    fed: Federation
    cap: Cap
    scope: trio.CancelScope | None = None
    dead: list[tuple[float, Member]] = field(default_factory=list)
    rejoined: list[tuple[float, Member]] = field(default_factory=list)

    def view(self) -> dict[str, str]:
        """node id -> state, as this node sees the federation."""
        return {m["node_id"]: m["state"] for m in self.fed.members()}


class Cluster:
    """Federation members on an InProcessNetwork, each running in its own cancel scope."""

    def __init__(self, nursery: trio.Nursery, net: InProcessNetwork, **defaults: Any) -> None:
        self.nursery = nursery
        self.net = net
        self.defaults = {"gossip_interval_s": 1.0, "suspect_after_s": 3.0, "dead_after_s": 6.0}
        self.defaults.update(defaults)
        self.nodes: dict[str, Node] = {}

    async def start(
        self,
        name: str,
        *,
        seeds: list[str] | None = None,
        token: str | None = None,
        cap: Cap | None = None,
        **kw: Any,
    ) -> Node:
        url = f"http://{name}:8000"
        if seeds is None:
            seeds = [n.fed.url for n in self.nodes.values()][:1]
        node = Node(fed=None, cap=cap or Cap())  # type: ignore[arg-type]

        async def on_dead(m: Member) -> None:
            node.dead.append((trio.current_time(), m))

        async def on_rejoin(m: Member) -> None:
            node.rejoined.append((trio.current_time(), m))

        node.fed = Federation(
            name,
            url,
            seeds=seeds,
            capacity=node.cap,
            token=token,
            transport=self.net.transport(url),
            on_dead=on_dead,
            on_rejoin=on_rejoin,
            **{**self.defaults, **kw},
        )
        self.net.add(node.fed, token=token)
        node.scope = trio.CancelScope()
        await self.nursery.start(_fed_in, node.scope, node.fed)
        self.nodes[name] = node
        return node

    def stop(self, name: str) -> None:
        """Graceful stop: the member announces LEFT."""
        scope = self.nodes[name].scope
        assert scope is not None
        scope.cancel()

    def kill(self, name: str) -> None:
        """Crash: the network drops the member first, so its LEFT announcement is lost."""
        self.net.kill(self.nodes[name].fed.url)
        self.stop(name)

    def converged(self, names: list[str] | None = None) -> bool:
        names = names or list(self.nodes)
        want = dict.fromkeys(names, "alive")
        return all(
            {k: v for k, v in self.nodes[n].view().items() if k in want} == want for n in names
        )

    async def wait_converged(self, names: list[str] | None = None, step: float = 0.01) -> float:
        """Wait until every named member sees every other alive; return when it happened."""
        while not self.converged(names):
            await trio.sleep(step)
        return trio.current_time()


@asynccontextmanager
async def open_cluster(**defaults: Any) -> AsyncIterator[Cluster]:
    async with trio.open_nursery() as nursery:
        yield Cluster(nursery, InProcessNetwork(), **defaults)
        nursery.cancel_scope.cancel()


# ---- real loopback HTTP ----------------------------------------------------------------


class DaemonStub:
    """A tiny ASGI app with the federation routes of the daemon and a toy rollout route.

    POST /v1/rollouts {"id"}: runs the job here when local capacity allows or when it was
    forwarded (never forwards twice), else forwards it to fed.place()'s peer. `executed`
    counts every job this node ran. A test double for the daemon's routes (phase 2 has
    the real ones); the Federation it serves is real.
    """

    def __init__(self, token: str | None) -> None:
        self.token = token
        self.fed: Federation | None = None
        self.cap = Cap()
        self.executed: list[str] = []
        self.forwarded_to: dict[str, str] = {}
        self.client: httpx.AsyncClient | None = None

    async def __call__(
        self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Any
    ) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert scope["type"] == "http"
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = httpx.Headers([(k.decode(), v.decode()) for k, v in scope["headers"]])
        status, answer = await self._route(scope["method"], scope["path"], headers, body)
        data = json.dumps(answer).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})

    async def _route(
        self, method: str, path: str, headers: httpx.Headers, body: bytes
    ) -> tuple[int, Any]:
        assert self.fed is not None
        if not check_token(headers.get("authorization"), self.token):
            return 401, {"error": {"type": "Unauthorized", "message": "bad token"}}
        if method == "POST" and path == GOSSIP_PATH:
            try:
                return 200, self.fed.handle_gossip(json.loads(body))
            except (GossipPayloadError, ValueError) as exc:
                return 400, {"error": {"type": "GossipPayloadError", "message": str(exc)}}
        if method == "GET" and path == MEMBERS_PATH:
            return 200, {"node_id": self.fed.node_id, "members": self.fed.members()}
        if method == "POST" and path == "/v1/rollouts":
            job_id = json.loads(body)["id"]
            if not is_forwarded(headers):
                peer = self.fed.place(self.cap())
                if peer is not None:
                    assert self.client is not None
                    resp = await self.client.post(
                        peer.url + "/v1/rollouts",
                        json={"id": job_id},
                        headers=forward_headers(self.token),
                    )
                    self.forwarded_to[job_id] = peer.node_id
                    return resp.status_code, {**resp.json(), "via": self.fed.node_id}
            self.executed.append(job_id)
            return 200, {"id": job_id, "ran_on": self.fed.node_id}
        return 404, {"error": {"type": "NotFound", "message": path}}


@dataclass
class Server:
    stub: DaemonStub
    url: str
    scope: trio.CancelScope


@asynccontextmanager
async def open_servers(
    n: int, *, tokens: list[str | None], **fed_kw: Any
) -> AsyncIterator[list[Server]]:
    """n DaemonStubs served by hypercorn on 127.0.0.1 port 0, each with a running Federation
    seeded with the first server's URL."""
    servers: list[Server] = []
    async with httpx.AsyncClient(timeout=5.0) as client, trio.open_nursery() as nursery:
        for i in range(n):
            stub = DaemonStub(tokens[i])
            stub.client = client
            cfg = Config()
            cfg.bind = ["127.0.0.1:0"]
            cfg.accesslog = None
            cfg.errorlog = None
            cfg.graceful_timeout = 0.5
            scope = trio.CancelScope()
            seeds = [servers[0].url] if servers else []

            def make_fed(url: str, i: int = i, seeds: list[str] = seeds) -> Federation:
                return Federation(
                    f"node{i}", url, seeds=seeds, capacity=stub.cap, token=tokens[i], **fed_kw
                )

            url = await nursery.start(partial(_node, scope, stub, cfg, make_fed))
            servers.append(Server(stub, url, scope))
        yield servers
        nursery.cancel_scope.cancel()


async def _node(
    scope: trio.CancelScope,
    stub: DaemonStub,
    cfg: Config,
    make_fed: Callable[[str], Federation],
    *,
    task_status: trio.TaskStatus[str],
) -> None:
    """One daemon stub: hypercorn on port 0, then its Federation at the bound URL."""
    with scope:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(serve, stub, cfg))  # type: ignore[arg-type]
            stub.fed = make_fed(binds[0])
            await nursery.start(stub.fed.run)
            task_status.started(binds[0])


async def _fed_in(
    scope: trio.CancelScope, fed: Federation, *, task_status: trio.TaskStatus[None]
) -> None:
    with scope:
        await fed.run(task_status=task_status)
