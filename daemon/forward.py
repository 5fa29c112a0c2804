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
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rolloutd.daemon.errors import DaemonError
from rolloutd.daemon.jobs import MAX_FILTER_IDS, new_id
from rolloutd.daemon.service import SampleId
from rolloutd.daemon.streams import PATH as STREAM_PATH
from rolloutd.daemon.streams import stream_request
from rolloutd.daemon.trajectory import ErrorInfo, Status, Trajectory
from rolloutd.federation import (
    MAX_FORWARDED_IDS,
    Federation,
    ForwardedJobs,
    Member,
    MemberState,
    forward_headers,
    ids_headers,
    took_at,
)

log = logging.getLogger(__name__)

#: Connect quickly (a dead peer should not stall a submit); reads last as long as a rollout.
TIMEOUT = httpx.Timeout(connect=3.0, read=None, write=30.0, pool=10.0)
POLL_INTERVAL_S = 1.0
PREFETCH_PATH = "/v1/federation/prefetch"
#: While a peer's stream is open, the results it has not delivered are swept for (a safety
#: net: no run has yet found one it missed), first after SWEEP_S, then twice as long after
#: each sweep, at most SWEEP_MAX_S apart. A sweep asks the peer's listing for the statuses
#: of up to PROBE_MAX of them in one request (``GET /v1/rollouts?ids=``), and looks up the
#: whole trajectory only of those it shows finished or does not hold, SWEEP_MAX at most; a
#: peer without that filter (an older version) gets the lookups of the SWEEP_MAX that waited
#: longest. The requests of every relay to one peer share SWEEP_RATE a second. So the net
#: costs about one small request per relay and sweep however long its rollouts run (their
#: trajectories so far can be megabytes), and however many streams are open.
SWEEP_S = 5.0
SWEEP_MAX_S = 60.0
SWEEP_MAX = 16
SWEEP_RATE = 20.0
PROBE_MAX = MAX_FILTER_IDS
#: A lookup or cancel relayed to a peer: a partitioned peer answers 503 rather than hang.
LOOKUP_TIMEOUT = httpx.Timeout(connect=3.0, read=10.0, write=10.0, pool=10.0)
#: Connections to peers outlive the gap between two bursts: a trainer's batches come a
#: training step apart, often more than httpx's default 5 s of idling, and each new
#: connection costs the front and the peer a TCP handshake and a new HTTP connection. Kept
#: 60 s (a peer's server keeps them 75 s, so this side closes first), up to 64 of them; 100
#: at once as httpx's default (a relayed stream holds one while it runs).
POOL = httpx.Limits(max_connections=100, max_keepalive_connections=64, keepalive_expiry=60.0)
#: Submits forwarded to one peer (without ``wait``) go in one request, ``POST SUBMITS_PATH``:
#: the first at once, and those the front takes in while a request to that peer is open wait
#: for it to end and then go together (at most MAX_SUBMITS a request). A burst of single
#: submits thus costs the front and the peer a request per round trip, not one per submit: an
#: HTTP request is most of what a forward costs either side (a front took 2.9 ms of CPU per
#: forwarded submit against 1.3 ms per submit it kept, a throwaway probe of 2026-11-29). A peer
#: without the route (an older version: 404, 405) is sent one request per submit, as before.
SUBMITS_PATH = "/v1/federation/submit"
MAX_SUBMITS = 64


class ForwardedSubmit(BaseModel):
    """One client's submit as a front forwards it: the body it got, and the samples' ids it chose."""

    model_config = ConfigDict(extra="forbid")

    ids: list[SampleId] = Field(min_length=1, max_length=MAX_FORWARDED_IDS)
    request: dict[str, Any] = Field(description="The client's POST /v1/rollouts body.")


class ForwardedSubmits(BaseModel):
    """The body of ``POST /v1/federation/submit``: submits forwarded by peer ``origin``, each
    answered as a forwarded ``POST /v1/rollouts`` of it would be (``{"answers": [{"status",
    "body"}, ...]}``, in order)."""

    model_config = ConfigDict(extra="forbid")

    origin: str = Field(min_length=1, max_length=200)
    submits: list[ForwardedSubmit] = Field(min_length=1, max_length=MAX_SUBMITS)

    @model_validator(mode="after")
    def _distinct_ids(self) -> ForwardedSubmits:
        ids = [i for s in self.submits for i in s.ids]
        if len(set(ids)) != len(ids):
            raise ValueError("a rollout id is given twice")
        return self


class PeerUnavailable(DaemonError):
    """A peer could not be reached (or refused a forward it provably did not take)."""


class NeverSent(PeerUnavailable):
    """The request provably never reached the peer (no connection was made)."""


@dataclass(frozen=True)
class PeerAnswer:
    """A peer's answer to a forwarded request, relayed to the client as it is."""

    status: int
    body: Any
    took_at: tuple[int, int] | None = None  # the peer's version when it took them (202)
    raw: bytes | None = None  # ``body`` as JSON text (as the peer sent it), when known


@dataclass(eq=False)
class _Outgoing:
    """A submit waiting in a peer's outbox (see SUBMITS_PATH), then its outcome."""

    body: dict[str, Any]
    ids: list[str]
    sent: bool = False  # it left in a request (it may have reached the peer)
    done: trio.Event = field(default_factory=trio.Event)
    answer: PeerAnswer | None = None
    refused: PeerUnavailable | None = None  # the peer provably does not hold it
    alone: bool = False  # send it the old way (no SUBMITS_PATH there, or too large together)


@dataclass(frozen=True, slots=True)
class PeerTrajectory:
    """A forwarded rollout's trajectory as the peer that holds it answered a lookup (or the
    ``lost`` record this front decided): ``body`` parsed, for its status; ``text`` as it came,
    for relaying without serializing it again."""

    body: dict[str, Any]
    text: str

    @property
    def terminal(self) -> bool:
        return Status(self.body["status"]).terminal

    @classmethod
    def of(cls, trajectory: Trajectory) -> PeerTrajectory:
        return cls(trajectory.model_dump(mode="json"), trajectory.model_dump_json())


class Forwarder:
    def __init__(self, federation: Federation, token: str | None, *, max_known: int = 100_000) -> None:
        self.federation = federation
        self.token = token
        self.live = ForwardedJobs()
        self._where: OrderedDict[str, str] = OrderedDict()  # job id -> node id, bounded
        self._max_known = max_known
        self._lost: dict[str, Trajectory] = {}
        self._open: dict[str, set[trio.CancelScope]] = {}  # node id -> open forward requests
        self._sweep_at: dict[str, float] = {}  # node id -> when its next sweep lookup may go
        self._http: httpx.AsyncClient | None = None
        self._nursery: trio.Nursery | None = None
        self._outbox: dict[str, list[_Outgoing]] = {}  # node id -> submits not yet sent
        self._sending: set[str] = set()  # node ids whose outbox a task sends
        self._alone: set[str] = set()  # node ids without SUBMITS_PATH (older versions)
        self.forwarded_total = 0
        self.probes = 0  # sweeps' listing requests to peers (statuses of undelivered ids)
        self.lookups = 0  # relays' lookups of one trajectory each (sweeps, and polls once a stream broke)
        self.submit_requests = 0  # the outboxes' requests (each one forwarded submit or more)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=POOL,
                                     headers=forward_headers(self.token)) as http:
            self._http = http
            try:
                async with trio.open_nursery() as nursery:  # the outboxes' senders
                    self._nursery = nursery
                    task_status.started()
                    await trio.sleep_forever()
            finally:
                self._nursery = None
                self._http = None

    # ---- placement and submit -------------------------------------------------------

    def place(self, n: int = 1, image: str | None = None) -> Member | None:
        """The peer to forward a new request of ``n`` samples (of a task with ``image``) to,
        or None to run it here."""
        return self.federation.place(n=n, image=image)

    async def submit(self, member: Member, body: dict[str, Any], n: int, *, wait: bool) -> PeerAnswer:
        """Forward one POST /v1/rollouts of ``n`` samples (to the peer place() chose); returns
        the peer's answer, and tells the federation what became of the placement.

        The front chooses the samples' ids and records them as forwarded before it sends, so
        whatever happens next it answers for them. Raises PeerUnavailable only when the peer
        provably did not take the request (no connection was made, or it answered 429/503):
        the caller may then run the rollouts here. A request that was sent but never answered
        is retried once with the same idempotency key (and ids); if that fails too, its
        samples are ``failed`` with ``peer_lost`` and never run anywhere else. So are they
        when the peer is declared dead while the request (a ``wait``) is open.
        """
        taken, at = False, None
        try:
            if wait or member.node_id in self._alone or self._nursery is None:
                answer = await self._submit(member, body, n, wait=wait)
            else:
                answer = await self._submit_in_outbox(member, body, n)
            # 202: the peer holds them now (its reports after ``at`` count them; a lost
            # request's may run there too); a 200 (wait) has ended; the rest were refused
            taken, at = answer.status == 202, answer.took_at
            return answer
        finally:
            self.federation.forwarded(member.node_id, at, taken=taken, n=n)

    def _prepare(self, node_id: str, body: dict[str, Any], n: int) -> tuple[dict[str, Any], list[str]]:
        """A forward's body (with an idempotency key and a group id, so that a retry makes no
        second copy) and its samples' ids, recorded as held by ``node_id`` before it is sent."""
        body = dict(body)
        body.setdefault("idempotency_key", f"fwd-{uuid.uuid4().hex}")
        body.setdefault("group_id", new_id("g"))
        ids = [new_id("r") for _ in range(n)]
        for job_id in ids:
            self.live.add(job_id, node_id)
            self.remember(job_id, node_id)
        return body, ids

    async def _submit(self, member: Member, body: dict[str, Any], n: int, *, wait: bool) -> PeerAnswer:
        node_id = member.node_id
        body, ids = self._prepare(node_id, body, n)
        url = f"{member.url}/v1/rollouts" + ("?wait=true" if wait else "")
        resp: httpx.Response | None = None
        with trio.CancelScope() as scope:  # on_dead cancels it: the peer will never answer
            self._open.setdefault(node_id, set()).add(scope)
            try:
                resp = await self.post(url, body, headers=ids_headers(ids, self.federation.node_id))
            except NeverSent as exc:
                self.forget(ids)
                raise PeerUnavailable(f"{node_id}: {exc}") from None
            except httpx.HTTPError as exc:
                log.warning("forwarding %d rollouts to %s went unanswered (%s): they are lost",
                            len(ids), node_id, exc)
                self._lose_held(node_id, ids, f"peer {node_id} took the request and never "
                                "answered it (it was not re-run elsewhere)")
            finally:
                self._open[node_id].discard(scope)
        if resp is None:  # lost (unanswered, or the peer died while we waited)
            if scope.cancelled_caught:
                log.warning("peer %s died with %d forwarded rollouts open", node_id, len(ids))
            return self._unanswered(body, ids, wait=wait)
        raw: bytes | None = resp.content
        try:
            data = resp.json()
        except ValueError:
            data = {"error": {"type": "bad_peer_answer", "message": resp.text[:500]}}
            raw = None
        # relayed as it came: parsing and serializing again a wait's trajectories is most of
        # what relaying them costs (ids are the peer's: _settle made them ours)
        return self._settle(node_id, ids, resp.status_code, data, took_at(resp.headers), raw)

    def _unanswered(self, body: dict[str, Any], ids: list[str], *, wait: bool) -> PeerAnswer:
        """The answer for a forward the peer may hold and never answered (its samples were
        declared lost: the peer died, or the request and its retry went unanswered)."""
        if wait:
            rollouts = [self._lost[i].model_dump(mode="json") for i in ids if i in self._lost]
            return PeerAnswer(200, {"group_id": body["group_id"], "rollouts": rollouts})
        return PeerAnswer(202, {"group_id": body["group_id"], "ids": ids})  # may run there

    def _settle(self, node_id: str, ids: list[str], status: int, data: Any,
                at: tuple[int, int] | None, raw: bytes | None) -> PeerAnswer:
        """What the peer's answer (``status``, ``data``) to a forward of ``ids`` makes of them.
        Raises PeerUnavailable for a refusal (429, 503): it holds none of them."""
        if status in (429, 503):
            self.forget(ids)
            raise PeerUnavailable(f"{node_id} refused the rollouts (HTTP {status})")
        if status in (200, 202):
            ids = self._reconcile(ids, data, node_id, live=status == 202)
            if status == 200:
                for job_id in ids:
                    self.live.discard(job_id)
            self.forwarded_total += len(ids)
        else:
            self.forget(ids)
        return PeerAnswer(status, data, at, raw=raw)

    # ---- the outboxes: forwarded submits to one peer, together -------------------------

    async def _submit_in_outbox(self, member: Member, body: dict[str, Any], n: int) -> PeerAnswer:
        """Forward a submit (no ``wait``) through ``member``'s outbox (see SUBMITS_PATH), with
        the guarantees of ``submit``. One the caller stops waiting for before it was sent
        never leaves."""
        node_id = member.node_id
        assert self._nursery is not None
        body, ids = self._prepare(node_id, body, n)
        out = _Outgoing(body, ids)
        box = self._outbox.setdefault(node_id, [])
        box.append(out)
        if node_id not in self._sending:
            self._sending.add(node_id)
            self._nursery.start_soon(self._send_outbox, member)
        try:
            await out.done.wait()
        except BaseException:
            if not out.sent and out in box:
                box.remove(out)
                self.forget(ids)
            raise
        if out.alone:
            self.forget(ids)
            return await self._submit(member, body, n, wait=False)
        if out.refused is not None:
            raise out.refused
        assert out.answer is not None
        return out.answer

    async def _send_outbox(self, member: Member) -> None:
        """Send ``member``'s outbox, MAX_SUBMITS a request, until it is empty. Whatever is
        left when this is cancelled (the forwarder stops) is settled: lost if it was sent,
        refused if it never left."""
        node_id = member.node_id
        box = self._outbox[node_id]
        batch: list[_Outgoing] = []
        try:
            while box:
                batch = box[:MAX_SUBMITS]
                del box[:len(batch)]
                for out in batch:
                    out.sent = True
                await self._send_submits(member, batch)
                batch = []
        finally:
            self._sending.discard(node_id)
            self._lose_all(node_id, [out for out in batch if not out.done.is_set()],
                           "the front stopped while it waited for the peer's answer")
            self._refuse_all(box, PeerUnavailable(f"{node_id}: the front stopped before sending"))
            box.clear()

    async def _send_submits(self, member: Member, batch: list[_Outgoing]) -> None:
        node_id = member.node_id
        payload = {"origin": self.federation.node_id,
                   "submits": [{"ids": out.ids, "request": out.body} for out in batch]}
        resp: httpx.Response | None = None
        self.submit_requests += 1
        with trio.CancelScope() as scope:  # on_dead cancels it: the peer will never answer
            self._open.setdefault(node_id, set()).add(scope)
            try:
                resp = await self.post(member.url + SUBMITS_PATH, payload)
            except NeverSent as exc:
                self._refuse_all(batch, PeerUnavailable(f"{node_id}: {exc}"))
                return
            except httpx.HTTPError as exc:
                log.warning("forwarding %d submits to %s went unanswered (%s): they are lost",
                            len(batch), node_id, exc)
                self._lose_all(node_id, batch, f"peer {node_id} took the request and never "
                               "answered it (it was not re-run elsewhere)")
                return
            finally:
                self._open[node_id].discard(scope)
        if resp is None:  # the peer died while we waited (on_dead declared them lost)
            log.warning("peer %s died with %d forwarded rollouts open", node_id,
                        sum(len(out.ids) for out in batch))
            self._lose_all(node_id, batch, f"peer {node_id} was lost while it held this rollout")
            return
        if resp.status_code in (404, 405):  # an older version: one request per submit
            log.info("peer %s has no %s: forwarding to it one submit a request", node_id, SUBMITS_PATH)
            self._alone.add(node_id)
            for out in batch:
                out.alone = True
                out.done.set()
            return
        if resp.status_code == 413:  # together past the peer's max_body_bytes: each fits alone
            for out in batch:
                out.alone = True
                out.done.set()
            return
        if resp.status_code in (429, 503):  # refused as a whole: it holds none of them
            self._refuse_all(batch, PeerUnavailable(f"{node_id} refused the rollouts (HTTP {resp.status_code})"))
            return
        try:
            data = resp.json()
        except ValueError:
            data = None
        if 400 <= resp.status_code < 500:  # the request refused as a whole: it took none
            body = data if isinstance(data, dict) else {
                "error": {"type": "bad_peer_answer", "message": resp.text[:500]}}
            for out in batch:
                out.answer = self._settle(node_id, out.ids, resp.status_code, body, None, None)
                out.done.set()
            return
        if resp.status_code != 200:  # a 500 (a bug of the peer's, maybe half-way), or no answer of ours
            self._lose_all(node_id, batch, f"peer {node_id} answered HTTP {resp.status_code} "
                           f"(it may hold the rollout; it was not re-run elsewhere): {resp.text[:200]}")
            return
        answers = data.get("answers") if isinstance(data, dict) else None
        if not (isinstance(answers, list) and len(answers) == len(batch) and all(
                isinstance(a, dict) and type(a.get("status")) is int and isinstance(a.get("body"), dict)
                for a in answers)):
            self._lose_all(node_id, batch, f"peer {node_id} answered the request with something "
                           f"other than its answers (it was not re-run elsewhere): {resp.text[:200]}")
            return
        at = took_at(resp.headers)
        for out, answer in zip(batch, answers, strict=True):
            raw = json.dumps(answer["body"], separators=(",", ":")).encode()
            try:
                out.answer = self._settle(node_id, out.ids, answer["status"], answer["body"], at, raw)
            except PeerUnavailable as exc:
                out.refused = exc
            out.done.set()

    def _refuse_all(self, batch: list[_Outgoing], refused: PeerUnavailable) -> None:
        for out in batch:
            self.forget(out.ids)
            out.refused = refused
            out.done.set()

    def _lose_all(self, node_id: str, batch: list[_Outgoing], message: str) -> None:
        for out in batch:
            self._lose_held(node_id, out.ids, message)
            out.answer = self._unanswered(out.body, out.ids, wait=False)
            out.done.set()

    async def post(self, url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None,
                   limits: httpx.Timeout | None = None) -> httpx.Response:
        """POST to a peer, retried once when the first try may have been sent (the body must
        make a retry harmless: an idempotency key, ids); ``limits``: its httpx timeouts. Raises NeverSent when no try reached
        the peer for sure, httpx.HTTPError when one may have."""
        http = self._client()
        extra: dict[str, Any] = {"headers": headers}
        if limits is not None:
            extra["timeout"] = limits
        try:
            return await http.post(url, json=body, **extra)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise NeverSent(str(exc) or type(exc).__name__) from None
        except httpx.HTTPError:
            pass
        try:
            return await http.post(url, json=body, **extra)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            # The first try may have arrived: the peer may hold them, so they are not ours.
            raise httpx.TransportError(f"retry could not connect: {exc}") from None

    def _reconcile(self, ids: list[str], data: Any, node_id: str, *, live: bool) -> list[str]:
        """The ids the peer answered with. They differ from ours only when the client's own
        idempotency key matched an earlier request there: then the earlier ids stand."""
        try:
            theirs = data.get("ids") or [t["id"] for t in data.get("rollouts", [])]
        except (AttributeError, KeyError, TypeError):
            return ids
        if not theirs or theirs == ids or not all(isinstance(i, str) for i in theirs):
            return ids
        self.forget(ids)
        for job_id in theirs:
            self.remember(job_id, node_id)
            if live and job_id not in self.live:
                self.live.add(job_id, node_id)
        return list(theirs)

    def forget(self, ids: list[str]) -> None:
        """Drop ids that are not (or no longer) the peer's: it provably does not hold them."""
        for job_id in ids:
            self.live.discard(job_id)
            self._where.pop(job_id, None)

    def _lose_held(self, node_id: str, ids: list[str], message: str) -> None:
        """Declare ``ids``, which ``node_id`` may hold, lost (not already lost)."""
        for job_id in ids:
            if job_id not in self._lost:
                self.live.fail(job_id)
                self.lose(job_id, node_id, message)

    def lose(self, job_id: str, node_id: str, message: str) -> Trajectory:
        """Record rollout ``job_id`` as failed/peer_lost (held by ``node_id``); returns it."""
        traj = self._lost[job_id] = Trajectory(
            id=job_id,
            node_id=node_id,
            status=Status.failed,
            usable=False,
            error=ErrorInfo(stage="forward", type="peer_lost", message=message),
        )
        return traj

    async def prefetch(self, node_id: str, images: list[str]) -> None:
        """Ask peer ``node_id`` to fetch ``images`` ahead (it is their home): best effort, an
        error is logged and forgotten (the peer fetches an image when it needs it anyway)."""
        try:
            member = self._member(node_id)
            resp = await self._client().post(member.url + PREFETCH_PATH, json={"images": images},
                                             timeout=LOOKUP_TIMEOUT)
            resp.raise_for_status()
        except (httpx.HTTPError, PeerUnavailable) as exc:
            log.info("asking %s to prefetch %s failed: %r", node_id, images, exc)

    # ---- lookups --------------------------------------------------------------------

    def knows(self, job_id: str) -> bool:
        return job_id in self._where or job_id in self._lost

    async def get(self, job_id: str) -> PeerTrajectory:
        if job_id in self._lost:
            return PeerTrajectory.of(self._lost[job_id])
        member = self._member_of(job_id)
        try:
            resp = await self._client().get(f"{member.url}/v1/rollouts/{job_id}", timeout=LOOKUP_TIMEOUT)
        except httpx.HTTPError as exc:
            raise PeerUnavailable(f"{member.node_id} holds {job_id} and did not answer: {exc}") from None
        if job_id in self._lost:
            # Declared lost while the answer was on its way (a partition that healed): the
            # first terminal answer stands, and a peer's late result is not it.
            return PeerTrajectory.of(self._lost[job_id])
        if resp.status_code == 404 and job_id in self.live:
            # The peer answers (it is up) and does not know the rollout: it never took it.
            self.live.fail(job_id)
            self.lose(job_id, member.node_id, f"peer {member.node_id} does not know this rollout: "
                       "the forwarded request never reached it (it was not re-run elsewhere)")
            return PeerTrajectory.of(self._lost[job_id])
        try:
            data: dict[str, Any] = resp.json()
        except ValueError:
            data = {"error": {"message": resp.text[:300]}}
        if not resp.is_success:
            # An error of the peer's (a 503 from a peer that asks a third one, a 404 for a
            # rollout it no longer holds) is no trajectory: the client hears a 503 and asks again.
            raise PeerUnavailable(f"{member.node_id} holds {job_id} and answered {resp.status_code}: "
                                  f"{_error_message(data)}")
        found = PeerTrajectory(data, resp.text)
        if found.terminal:
            self.live.discard(job_id)
        return found

    async def cancel(self, job_id: str) -> PeerAnswer:
        if job_id in self._lost:
            return PeerAnswer(200, {"id": job_id, "status": self._lost[job_id].status.value})
        member = self._member_of(job_id)
        try:
            resp = await self._client().delete(f"{member.url}/v1/rollouts/{job_id}", timeout=LOOKUP_TIMEOUT)
        except httpx.HTTPError as exc:
            raise PeerUnavailable(f"{member.node_id} holds {job_id} and did not answer: {exc}") from None
        if job_id in self._lost:
            return PeerAnswer(200, {"id": job_id, "status": self._lost[job_id].status.value})
        return PeerAnswer(resp.status_code, resp.json())

    async def relay(self, node_id: str, ids: Sequence[str], send: trio.MemorySendChannel[str]) -> None:
        """Push the trajectories of ``ids`` (all on one peer) into ``send`` as they finish.

        The peer's stream delivers them; meanwhile, after ``SWEEP_S`` and then at doubling
        intervals (at most ``SWEEP_MAX_S``), a sweep asks the peer which of them it shows
        finished (``_unsettled``) and looks those up one by one, paced per peer
        (``SWEEP_RATE``), so a result the stream misses (a relay chain through a peer that
        handed the rollout on) still arrives. Once the stream breaks off, every
        ``POLL_INTERVAL_S`` those declared lost are delivered, and the peer's listing is asked
        which of the others it shows finished (up to PROBE_MAX, looked up unpaced): one
        request a second however many are left, where each of them was looked up before (a
        network blip under a batch of thousands made thousands of lookups a second, each
        answered with a trajectory so far)."""
        todo = list(ids)
        gone = False
        broke = trio.Event()
        interval = SWEEP_S

        async def stream() -> None:
            nonlocal gone
            try:
                with trio.CancelScope() as scope:  # on_dead ends it: then poll (lost records)
                    self._open.setdefault(node_id, set()).add(scope)
                    try:
                        await self._stream(node_id, todo, send)
                    finally:
                        self._open[node_id].discard(scope)
            except (httpx.HTTPError, PeerUnavailable, ValueError, KeyError):
                pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                gone = True  # the consumer went away
            broke.set()

        async with send, trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            while todo and not gone:
                if broke.is_set():
                    await trio.sleep(POLL_INTERVAL_S)
                else:
                    with trio.move_on_after(interval):
                        await broke.wait()
                    interval = min(2 * interval, SWEEP_MAX_S)
                # Those the peer shows finished: while the stream is open a paced sweep of a
                # few; once it broke, every one (and those declared lost, without asking).
                if broke.is_set():
                    due = [i for i in todo if i in self._lost]
                    due += await self._unsettled(node_id, [i for i in todo if i not in self._lost],
                                                 most=PROBE_MAX)
                else:
                    due = await self._unsettled(node_id, todo)
                for job_id in due:
                    if not broke.is_set():
                        await self._sweep_turn(node_id)
                    if job_id not in todo:  # the stream delivered it meanwhile
                        continue
                    try:
                        self.lookups += 1
                        found = await self.get(job_id)
                    except PeerUnavailable:
                        continue
                    if found.terminal and job_id in todo:
                        todo.remove(job_id)
                        try:
                            send.send_nowait(found.text)
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            gone = True
                            break
            nursery.cancel_scope.cancel()

    async def _unsettled(self, node_id: str, todo: list[str], *, most: int = SWEEP_MAX) -> list[str]:
        """Of ``todo`` (ids of rollouts on ``node_id`` not yet relayed), those worth a lookup:
        the ones the peer's listing shows finished, or does not hold (handed on, expired into
        its journal, or never taken: the lookup tells), at most ``most``. Without an answer
        from the listing (an older peer, an error), the ``most`` that waited longest."""
        if not todo:
            return []
        asked = todo[:PROBE_MAX]
        await self._sweep_turn(node_id)
        try:
            resp = await self._client().get(
                f"{self._member(node_id).url}/v1/rollouts",
                params={"ids": ",".join(asked), "limit": len(asked)}, timeout=LOOKUP_TIMEOUT)
            self.probes += 1
            resp.raise_for_status()
            held = {row["id"]: row["status"] for row in resp.json()["rollouts"]}
        except (httpx.HTTPError, PeerUnavailable, ValueError, KeyError, TypeError):
            return todo[:most]
        return [job_id for job_id in asked
                if job_id not in held or _finished(held[job_id])][:most]

    async def _sweep_turn(self, node_id: str) -> None:
        """Wait for the next of ``SWEEP_RATE`` sweep lookups a second to ``node_id``."""
        now = trio.current_time()
        at = max(now, self._sweep_at.get(node_id, now))
        self._sweep_at[node_id] = at + 1 / SWEEP_RATE
        await trio.sleep_until(at)

    async def _stream(self, node_id: str, todo: list[str], send: trio.MemorySendChannel[str]) -> None:
        member = self._member(node_id)
        method, request = stream_request(todo)  # POSTed past a few hundred: a URL holds no more
        async with self._client().stream(method, member.url + STREAM_PATH, **request) as resp:
            async for line in resp.aiter_lines():
                if line.strip():
                    job_id = line_id(line)
                    if job_id not in todo:  # a lookup delivered it already
                        continue
                    if job_id in self._lost:  # declared lost first: that answer stands
                        line = self._lost[job_id].model_dump_json()
                    self.live.discard(job_id)
                    todo.remove(job_id)
                    send.send_nowait(line)

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
            self.lose(job_id, member.node_id, f"peer {member.node_id} was lost ({member.state.value}) "
                       "while it held this rollout (it was not re-run elsewhere)")
        for scope in self._open.get(member.node_id, ()):
            scope.cancel()
        await trio.lowlevel.checkpoint()

    async def on_rejoin(self, member: Member) -> None:
        """A peer we declared dead is back: cancel what it may still run for us. It may be
        back as a newer version (a restart): its submits go through the outbox again."""
        self._alone.discard(member.node_id)
        for job_id in self.live.take_orphans(member.node_id):
            try:
                await self._client().delete(f"{member.url}/v1/rollouts/{job_id}")
            except httpx.HTTPError:
                log.warning("could not cancel orphan %s on %s", job_id, member.node_id)

    def statistics(self) -> dict[str, Any]:
        return {"forwarded_total": self.forwarded_total, "lost": len(self._lost),
                "submit_requests": self.submit_requests, "relay_probes": self.probes,
                "relay_lookups": self.lookups, **self.live.statistics()}

    # ---- internals -------------------------------------------------------------------

    @property
    def client(self) -> httpx.AsyncClient:
        """The HTTP client to peers (auth and forwarded headers set); PeerUnavailable when the
        forwarder is not running."""
        return self._client()

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise PeerUnavailable("the forwarder is not running")
        return self._http

    def remember(self, job_id: str, node_id: str) -> None:
        """Note that ``node_id`` holds rollout ``job_id`` (lookups go there; bounded)."""
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
            raise PeerUnavailable(f"no peer is known to hold {job_id} any more")
        return self._member(node_id)


def _finished(status: Any) -> bool:
    """Whether a listing's ``status`` is terminal (a status this version does not know counts
    as finished: the lookup then tells)."""
    try:
        return Status(status).terminal
    except ValueError:
        return True


def line_id(line: str) -> str:
    """The ``id`` of a trajectory line of a peer's stream. The peer writes it first
    (``{"id":"<id>",...``: ``model_dump_json``), so it is read without parsing the rest: a
    long rollout's trajectory is megabytes of tokens and logprobs, and the front relays every
    one. A line of any other form is parsed (ValueError, KeyError when it is no trajectory)."""
    if line.startswith('{"id":"'):
        end = line.find('"', 7)
        if end > 7 and "\\" not in line[7:end]:
            return line[7:end]
    job_id = json.loads(line)["id"]
    if not isinstance(job_id, str):
        raise ValueError(f"a trajectory's id is a string, not {job_id!r}")
    return job_id


def _error_message(body: Any) -> str:
    """The message of an error body (``{"error": {"message": ...}}``), else the body itself."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return json.dumps(body)[:300]
