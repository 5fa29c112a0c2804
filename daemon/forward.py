"""The front node's side of federation: forward rollouts to peers, relay results and cancels.

A rollout is forwarded at most once (the peer sees ``X-Rolloutd-Forwarded`` and never forwards
again), and always with an idempotency key, so the front can retry a submit without making a
second copy. When a peer dies, its forwarded rollouts that had not finished become explicit
``failed`` trajectories on the front (never silently re-run elsewhere: there are never two live
copies of one rollout); if the peer comes back, the front cancels those orphans on it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from rolloutd.daemon.errors import DaemonError
from rolloutd.daemon.trajectory import ErrorInfo, Status, Trajectory
from rolloutd.federation import Federation, ForwardedJobs, Member, MemberState, forward_headers

log = logging.getLogger(__name__)

#: Connect quickly (a dead peer should not stall a submit); reads last as long as a rollout.
TIMEOUT = httpx.Timeout(connect=3.0, read=None, write=30.0, pool=10.0)
POLL_INTERVAL_S = 1.0


class PeerUnavailable(DaemonError):
    """A peer that holds a forwarded rollout could not be reached."""


@dataclass(frozen=True)
class PeerAnswer:
    """A peer's answer to a forwarded request, relayed to the client as it is."""

    status: int
    body: Any


class Forwarder:
    def __init__(self, federation: Federation, token: str | None, *, max_known: int = 100_000) -> None:
        self.federation = federation
        self.token = token
        self.live = ForwardedJobs()
        self._where: OrderedDict[str, str] = OrderedDict()  # job id -> node id, bounded
        self._max_known = max_known
        self._lost: dict[str, Trajectory] = {}
        self._http: httpx.AsyncClient | None = None
        self.forwarded_total = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with httpx.AsyncClient(timeout=TIMEOUT, headers=forward_headers(self.token)) as http:
            self._http = http
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._http = None

    # ---- placement and submit -------------------------------------------------------

    def place(self) -> Member | None:
        """The peer to forward a new rollout to, or None to run it here."""
        return self.federation.place()

    async def submit(self, member: Member, body: dict[str, Any], *, wait: bool) -> PeerAnswer:
        """Forward one POST /v1/rollouts; returns the peer's answer.

        Raises PeerUnavailable when the request never reached the peer (the caller may then
        run the rollout locally without risking a second copy).
        """
        body = dict(body)
        body.setdefault("idempotency_key", f"fwd-{uuid.uuid4().hex}")
        http = self._client()
        url = f"{member.url}/v1/rollouts" + ("?wait=true" if wait else "")
        try:
            resp = await http.post(url, json=body)
        except httpx.ConnectError as exc:
            raise PeerUnavailable(f"{member.node_id}: {exc}") from None
        except httpx.HTTPError:
            # Sent but unanswered: retry once with the same idempotency key.
            try:
                resp = await http.post(url, json=body)
            except httpx.HTTPError as exc:
                raise PeerUnavailable(f"{member.node_id}: {exc}") from None
        data = resp.json()
        if resp.status_code in (200, 202):
            ids = data.get("ids") or [t["id"] for t in data.get("rollouts", [])]
            for job_id in ids:
                self._remember(job_id, member.node_id)
                if resp.status_code == 202:
                    self.live.add(job_id, member.node_id)
            self.forwarded_total += len(ids)
        return PeerAnswer(resp.status_code, data)

    # ---- lookups --------------------------------------------------------------------

    def knows(self, job_id: str) -> bool:
        return job_id in self._where or job_id in self._lost

    async def get(self, job_id: str) -> dict[str, Any]:
        if job_id in self._lost:
            return self._lost[job_id].model_dump(mode="json")
        member = self._member_of(job_id)
        try:
            resp = await self._client().get(f"{member.url}/v1/rollouts/{job_id}")
        except httpx.HTTPError as exc:
            raise PeerUnavailable(f"{member.node_id} holds {job_id} and did not answer: {exc}") from None
        data: dict[str, Any] = resp.json()
        if resp.is_success and Status(data["status"]).terminal:
            self.live.discard(job_id)
        return data

    async def cancel(self, job_id: str) -> PeerAnswer:
        if job_id in self._lost:
            return PeerAnswer(200, {"id": job_id, "status": self._lost[job_id].status.value})
        member = self._member_of(job_id)
        try:
            resp = await self._client().delete(f"{member.url}/v1/rollouts/{job_id}")
        except httpx.HTTPError as exc:
            raise PeerUnavailable(f"{member.node_id} holds {job_id} and did not answer: {exc}") from None
        return PeerAnswer(resp.status_code, resp.json())

    async def relay(self, node_id: str, ids: Sequence[str], send: trio.MemorySendChannel[str]) -> None:
        """Push the trajectories of ``ids`` (all on one peer) into ``send`` as they finish."""
        todo = list(ids)
        async with send:
            try:
                member = self._member(node_id)
                params = {"ids": ",".join(todo)}
                async with self._client().stream("GET", f"{member.url}/v1/rollouts/stream", params=params) as resp:
                    async for line in resp.aiter_lines():
                        if line.strip():
                            job_id = json.loads(line)["id"]
                            self.live.discard(job_id)
                            todo.remove(job_id)
                            send.send_nowait(line)
            except (httpx.HTTPError, PeerUnavailable, ValueError, KeyError):
                pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the consumer went away
            # The stream broke off: poll until each rollout is finished or declared lost.
            while todo:
                for job_id in list(todo):
                    try:
                        data = await self.get(job_id)
                    except PeerUnavailable:
                        continue
                    if Status(data["status"]).terminal:
                        todo.remove(job_id)
                        try:
                            send.send_nowait(json.dumps(data))
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            return
                if todo:
                    await trio.sleep(POLL_INTERVAL_S)

    def node_of(self, job_id: str) -> str | None:
        if job_id in self._lost:
            return None
        return self._where.get(job_id)

    # ---- membership callbacks ------------------------------------------------------------

    async def on_dead(self, member: Member) -> None:
        ids = self.live.fail_node(member.node_id)
        if ids:
            log.warning("peer %s is %s: %d forwarded rollouts failed", member.node_id,
                        member.state.value, len(ids))
        for job_id in ids:
            self._lost[job_id] = Trajectory(
                id=job_id,
                status=Status.failed,
                usable=False,
                error=ErrorInfo(stage="forward", type="peer_lost",
                                message=f"peer {member.node_id} died while it ran this rollout"),
            )
        await trio.lowlevel.checkpoint()

    async def on_rejoin(self, member: Member) -> None:
        """A peer we declared dead is back: cancel what it may still run for us."""
        for job_id in self.live.take_orphans(member.node_id):
            try:
                await self._client().delete(f"{member.url}/v1/rollouts/{job_id}")
            except httpx.HTTPError:
                log.warning("could not cancel orphan %s on %s", job_id, member.node_id)

    def statistics(self) -> dict[str, Any]:
        return {"forwarded_total": self.forwarded_total, "lost": len(self._lost), **self.live.statistics()}

    # ---- internals -------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise PeerUnavailable("the forwarder is not running")
        return self._http

    def _remember(self, job_id: str, node_id: str) -> None:
        self._where[job_id] = node_id
        while len(self._where) > self._max_known:
            self._where.popitem(last=False)

    def _member(self, node_id: str) -> Member:
        member = self.federation.member(node_id)
        if member is None or member.state in (MemberState.DEAD, MemberState.LEFT):
            raise PeerUnavailable(f"peer {node_id} is not available")
        return member

    def _member_of(self, job_id: str) -> Member:
        node_id = self._where.get(job_id)
        if node_id is None:
            raise KeyError(job_id)
        return self._member(node_id)
