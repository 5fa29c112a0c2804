"""Work stealing between federated daemons: one with free slots takes queued rollouts from a
busier peer, exactly once, under their ids.

A daemon with free slots and nothing queued asks the peer that reported the most unstarted
rollouts (gossip: ``queued`` plus ``waiting``) for work: ``POST /v1/federation/steal
{node_id, max, images}``, where ``images`` lists the image refs the thief
holds unpacked. That peer (the victim) withdraws up to ``max``, and at most half, of its
unstarted jobs, those that would start last there, and of those with an image only the ones
whose image the thief holds: queued ones first, then ones through INIT that wait for a RUN
worker (a daemon's INIT runs ahead of RUN, so at the
end of a burst the work a busy daemon still holds is mostly of that kind). It tears down the
sandboxes of the latter, records them all as forwarded to the thief, and hands them over:
``POST /v1/federation/adopt {origin, rollouts}``; the thief queues them under the same ids
and runs their INIT again. No agent step of a handed-over rollout has run anywhere before.

The thief asks at most every ``steal_interval_s``, and only when it may get something:
between asks it sleeps until it has room (a job left, or started) and then until some
peer's capacity report changes (gossip tells; a heartbeat with the same report is not
news). A peer that gave nothing is asked again only once its report differs. So a daemon
that is idle, or busy, or whose peers are idle costs nothing here (a poll every 0.2 s cost
an idle daemon about 2 ms of CPU a second).

The victim keeps answering for them: its job for each ends with the thief's trajectory
(relayed as a forwarded rollout's is), so a wait, a stream, a batch and the journal there see
one rollout, and the front that forwarded it (if any) keeps asking the victim. The hand-over
follows the forwarding rules (daemon/forward.py): refused, or provably never sent -> queued
again on the victim; sent and never answered -> failed/peer_lost; the thief lost later ->
failed/peer_lost. A job is handed over at most once (a taken-over job is not stolen again),
so it runs in one place.

Placement uses the same hand-over for a batch's groups (``place``): the sampler's groups are
accepted on the daemon that holds the batch, and one that placement sends to a peer (as it
would a client's submit, an image's homes first) is handed over at once, whether or not
work stealing is on. The groups placed on one peer in one scheduling step go in one
request. Either way, the results of every rollout handed over to one peer come back
through one relay (a stream of the peer's), begun again with the new ones a quarter second
after more are handed over, so a batch of hundreds of groups holds one connection per peer,
not one per group.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import httpx
import trio
from pydantic import BaseModel, ConfigDict, Field

from rolloutd.daemon.forward import NeverSent
from rolloutd.daemon.journal import JournalError
from rolloutd.daemon.service import QueuedSample
from rolloutd.daemon.trajectory import Status, Trajectory
from rolloutd.federation import MemberState

if TYPE_CHECKING:
    from rolloutd.daemon.config import Settings
    from rolloutd.daemon.forward import Forwarder
    from rolloutd.daemon.jobs import Job
    from rolloutd.daemon.journal import Journal
    from rolloutd.daemon.pipeline import Pipeline
    from rolloutd.daemon.service import RolloutService
    from rolloutd.federation import Capacity, Member

log = logging.getLogger(__name__)

STEAL_PATH = "/v1/federation/steal"
ADOPT_PATH = "/v1/federation/adopt"
#: The most rollouts one hand-over moves.
MAX_STEAL = 256
#: The most image refs a thief lists as held in one ask (the most recently resolved first).
MAX_HELD_IMAGES = 1024
#: A steal asks, and waits for the hand-over it causes; an adopt only queues.
STEAL_TIMEOUT = httpx.Timeout(connect=2.0, read=20.0, write=10.0, pool=5.0)
ADOPT_TIMEOUT = httpx.Timeout(connect=2.0, read=10.0, write=10.0, pool=5.0)
#: Bound on cancelling, at shutdown, what a thief still runs for us.
CANCEL_TIMEOUT_S = 2.0
#: A peer's relay begins again with the rollouts handed over since it began this long after
#: the first of them (the old stream delivers meanwhile): a batch that hands a group to a
#: peer every few milliseconds costs that peer a new stream a quarter second, not one a group.
RELAY_MERGE_S = 0.25


class StealRequest(BaseModel):
    """A peer with free slots asks for queued work (``POST /v1/federation/steal``)."""

    model_config = ConfigDict(extra="forbid")

    node_id: str = Field(min_length=1, max_length=200, description="The asking member.")
    max: int = Field(ge=1, le=MAX_STEAL, description="The most rollouts it takes.")
    images: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(
        default_factory=list, max_length=MAX_HELD_IMAGES, description=(
            "Image refs the asking member holds unpacked: a rollout whose task names an "
            "image is handed to it only when the image is one of these."))


class AdoptRequest(BaseModel):
    """Queued rollouts handed over by peer ``origin`` (``POST /v1/federation/adopt``)."""

    model_config = ConfigDict(extra="forbid")

    origin: str = Field(min_length=1, max_length=200)
    rollouts: list[QueuedSample] = Field(max_length=MAX_STEAL)


class Stealer:
    """Both sides of work stealing for one daemon, and the hand-over of the batch groups
    placement sends to peers (``place``). ``follow`` wires jobs taken over here to the
    journal and metrics (the node's); ``run`` holds the thief loop and the tasks that send
    placed groups and relay handed-over jobs' results."""

    def __init__(self, *, node_id: str, settings: Settings, pipeline: Pipeline,
                 service: RolloutService, forwarder: Forwarder, journal: Journal,
                 follow: Callable[[list[Job]], None],
                 held_images: Callable[[], list[str]] = list) -> None:
        self.node_id = node_id
        self.settings = settings
        self.pipeline = pipeline
        self.service = service
        self.forwarder = forwarder
        self.journal = journal
        self._follow = follow
        self._held_images = held_images  # the image refs this node holds, for its asks
        self._nursery: trio.Nursery | None = None
        self._outbox: dict[str, tuple[Member, list[Job], int]] = {}  # placed, not yet sent
        self._away: dict[str, dict[str, Job]] = {}  # node id -> jobs it runs for us
        self._more: dict[str, trio.Event] = {}  # node id -> set when more were handed to it
        self.taken_over = 0  # rollouts peers handed to us
        self.handed_over = 0  # rollouts we handed to peers that asked (stealing)
        self.placed = 0  # samples of batch groups placement handed to peers
        self.taken_back = 0  # handed over, refused or never sent, queued here again
        self.lost = 0  # handed over, then the thief was lost
        self.asks = 0  # steal asks this daemon sent
        self._dry: dict[str, Capacity] = {}  # node id -> what it reported when it gave nothing

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                if not self.settings.work_stealing:
                    await trio.sleep_forever()
                while True:
                    await self._wait_for_chance()
                    await self._steal()
                    await trio.sleep(self.settings.steal_interval_s)
        finally:
            self._nursery = None

    @property
    def running(self) -> bool:
        """Whether ``run`` runs (hand-overs need its nursery)."""
        return self._nursery is not None

    def statistics(self) -> dict[str, Any]:
        return {"work_stealing": self.settings.work_stealing, "taken_over": self.taken_over,
                "handed_over": self.handed_over, "batch_placed": self.placed,
                "taken_back": self.taken_back, "handed_over_lost": self.lost,
                "steal_asks": self.asks}

    # ---- the thief ----------------------------------------------------------------------

    def _room(self) -> int:
        """Rollouts this daemon could start now: free slots, when nothing is queued here."""
        if self.service.draining or not self.pipeline.has_room():
            return 0
        return min(self.pipeline.free_capacity(), MAX_STEAL)

    async def _wait_for_chance(self) -> None:
        """Return once this daemon has room and a peer may have work for it. It sleeps
        meanwhile: a daemon with no room wakes when a job leaves or starts, one with room
        when what a peer reports changes (not at every heartbeat), so an idle or busy
        daemon with nothing to take costs nothing here."""
        while True:
            if not self.pipeline.has_room():
                await self.pipeline.wait_for_room()
            elif self._room() > 0 and self._victims():
                return
            else:
                await self.forwarder.federation.wait_for_news()

    def _victims(self) -> list[Member]:
        """The peers to ask, busiest first: alive, not draining, with unstarted rollouts,
        and not ones that gave nothing at the capacity they report now. Such a peer is asked
        again once its report changes: the ask would find what its last answer found, and
        the peers asked are the busiest ones, whose CPU each ask takes."""
        def unstarted(m: Member) -> int:
            return m.capacity["queued"] + m.capacity["waiting"]

        alive = [m for m in self.forwarder.federation.peers() if m.state is MemberState.ALIVE]
        for node_id in self._dry.keys() - {m.node_id for m in alive}:
            del self._dry[node_id]  # it left or died: a member that returns reports anew
        peers = [m for m in alive if unstarted(m) > 0 and not m.capacity["draining"]
                 and self._dry.get(m.node_id) != m.capacity]
        return sorted(peers, key=lambda m: -unstarted(m))[:2]

    async def _steal(self) -> None:
        room = self._room()
        if room <= 0:
            return
        ask: dict[str, Any] = {"node_id": self.node_id}
        held = self._held_images()[:MAX_HELD_IMAGES]
        if held:  # only then: a victim of an older version refuses the field (422)
            ask["images"] = held
        for victim in self._victims():
            self.asks += 1
            try:
                resp = await self.forwarder.client.post(
                    victim.url + STEAL_PATH, json={**ask, "max": room}, timeout=STEAL_TIMEOUT)
                moved = len(resp.json().get("moved", [])) if resp.status_code == 200 else 0
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
                log.debug("steal from %s failed: %r", victim.node_id, exc)
                moved = 0
            if moved:
                self._dry.pop(victim.node_id, None)
            else:
                self._dry[victim.node_id] = victim.capacity
            room = self._room()
            if moved or room <= 0:
                return

    async def adopt(self, req: AdoptRequest) -> dict[str, Any]:
        """Queue rollouts a peer hands over; the answer says which were taken, and this
        node's federation version after it took them (``took_at``: the peer's placement
        counts them against this node until a capacity report of a later heartbeat does).
        They are in the journal before the peer hears so (as a client's rollouts are)."""
        jobs, accepted, refused = self.service.adopt(req.rollouts, origin=req.origin)
        if jobs:
            self._follow(jobs)
            try:
                await self.journal.sync()
            except JournalError as exc:
                for job in jobs:
                    self.pipeline.cancel(job)
                return {"accepted": [], "refused": {s.id: str(exc) for s in req.rollouts}}
        self.taken_over += len(jobs)
        if jobs:
            log.info("took over %d queued rollouts from %s", len(jobs), req.origin)
        return {"accepted": accepted, "refused": refused,
                "took_at": list(self.forwarder.federation.version)}

    # ---- the victim ---------------------------------------------------------------------

    async def give(self, req: StealRequest) -> dict[str, Any]:
        """A peer asks for work: hand over up to ``req.max`` queued rollouts, at most half
        the queue, the ones that would start last here, of those it may take (``_stealable``:
        a task's image only to a thief that holds it). Answers with the ids moved."""
        thief = self.forwarder.federation.member(req.node_id)
        if (not self.settings.work_stealing or self.service.draining or thief is None
                or thief.node_id == self.node_id or thief.state is not MemberState.ALIVE):
            return {"moved": []}
        n = min(req.max, math.ceil(_unstarted(self.pipeline) / 2))
        if n <= 0:
            return {"moved": []}
        held = frozenset(req.images)
        # Shielded (bounded by the sandbox release and ADOPT_TIMEOUT, twice): a thief that
        # stops waiting for this answer must not leave the withdrawn rollouts neither queued
        # here nor handed over.
        with trio.CancelScope(shield=True):
            jobs = await self.pipeline.hand_over(n, lambda job: _stealable(job, thief.node_id, held))
            moved, _ = await self._hand_over(thief, jobs) if jobs else ([], None)
        return {"moved": moved}

    # ---- placement of a batch's groups ---------------------------------------------------

    def place(self, member: Member, jobs: list[Job], debit: int) -> None:
        """Hand ``jobs`` (a batch's group, queued here in this step) over to ``member``, the
        peer placement chose for them (debiting ``debit`` samples from its headroom): soon,
        in one request with the other groups placed there in this step."""
        jobs = self.pipeline.withdraw(jobs)
        queued = self._outbox.get(member.node_id)
        if queued is None:
            assert self._nursery is not None
            self._outbox[member.node_id] = (member, jobs, debit)
            self._nursery.start_soon(self._send_placed, member.node_id)
        else:
            self._outbox[member.node_id] = (queued[0], queued[1] + jobs, queued[2] + debit)

    async def _send_placed(self, node_id: str) -> None:
        taken = 0
        # Shielded, as ``give`` is (bounded: ADOPT_TIMEOUT, twice, per request): withdrawn
        # jobs are handed over or queued here again, also when the daemon stops meanwhile.
        with trio.CancelScope(shield=True):
            await trio.lowlevel.checkpoint()  # the groups placed in the step that started this
            member, jobs, debit = self._outbox.pop(node_id)
            for i in range(0, len(jobs), MAX_STEAL):
                chunk = jobs[i:i + MAX_STEAL]
                moved, at = await self._hand_over(member, chunk, placed=True)
                taken += len(moved)
                if moved:
                    self.forwarder.federation.forwarded(node_id, at, taken=True, n=len(moved))
        self.forwarder.federation.forwarded(node_id, None, taken=False, n=max(0, debit - taken))

    # ---- the hand-over, and the results' way back ------------------------------------------

    async def _hand_over(self, thief: Member, jobs: list[Job], *,
                         placed: bool = False) -> tuple[list[str], tuple[int, int] | None]:
        """Send ``jobs`` (withdrawn from the pipeline) to ``thief``; the ids it took, and its
        version when it took them (None: an older peer's answer, or nothing taken)."""
        fwd = self.forwarder
        try:
            samples = [QueuedSample.of(job) for job in jobs]
        except Exception:
            self.pipeline.take_back(jobs)  # a job we cannot describe stays here
            raise
        body = AdoptRequest(origin=self.node_id, rollouts=samples).model_dump(mode="json")
        try:
            resp = await fwd.post(thief.url + ADOPT_PATH, body, limits=ADOPT_TIMEOUT)
            answer = resp.json() if resp.status_code == 200 else {}
            accepted = set(answer.get("accepted", []))
            at = _version(answer.get("took_at"))
        except NeverSent:
            self._take_back(jobs)
            return [], None
        except (httpx.HTTPError, ValueError, AttributeError, TypeError) as exc:
            # It may have taken them: they are lost, never run here as well.
            log.warning("handing %d rollouts to %s went unanswered (%r): they are lost",
                        len(jobs), thief.node_id, exc)
            for job in jobs:
                fwd.live.add(job.id, thief.node_id)
                fwd.live.fail(job.id)  # an orphan there: cancelled if it comes back
                self._end(job, fwd.lose(job.id, thief.node_id, f"handed over to peer {thief.node_id}, "
                                        "which never answered (it was not re-run elsewhere)"))
            self.lost += len(jobs)
            return [], None
        moved = [job for job in jobs if job.id in accepted]
        self._take_back([job for job in jobs if job.id not in accepted])
        for job in moved:
            # Only now is the thief asked about them: before it took them, it would answer
            # 404 (which means "never reached it": peer_lost).
            fwd.live.add(job.id, thief.node_id)
            fwd.remember(job.id, thief.node_id)
            job.moved_to = job.trajectory.node_id = thief.node_id
            job.on_cancel = lambda job=job: self._cancel_remote(job)
            if job.cancel_requested:
                self._cancel_remote(job)
        if moved:
            if placed:
                self.placed += len(moved)
            else:
                self.handed_over += len(moved)
            log.info("handed %d queued rollouts over to %s (%s)", len(moved), thief.node_id,
                     "placed" if placed else "it asked")
            self._watch(thief.node_id, moved)
        return [job.id for job in moved], at

    def _take_back(self, jobs: list[Job]) -> None:
        if jobs:
            self.pipeline.take_back(jobs)
            self.taken_back += len(jobs)

    def _watch(self, node_id: str, jobs: list[Job]) -> None:
        """Relay the results of ``jobs``, just handed over to ``node_id``, with the others
        it runs for us."""
        waiting = self._away.get(node_id)
        if waiting is None:
            waiting = self._away[node_id] = {}
            assert self._nursery is not None
            self._nursery.start_soon(self._relay, node_id, waiting)
        waiting.update((job.id, job) for job in jobs)
        more = self._more.get(node_id)
        if more is not None:
            more.set()

    async def _relay(self, node_id: str, waiting: dict[str, Job]) -> None:
        """End each job handed over to ``node_id`` with its trajectory there, as it finishes:
        one relay for all of them, begun again (with those not yet delivered) ``RELAY_MERGE_S``
        after more are handed over; a result that finished meanwhile comes at once in the new
        one."""
        try:
            while waiting:
                more = self._more[node_id] = trio.Event()
                send, recv = trio.open_memory_channel[str](len(waiting))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.forwarder.relay, node_id, list(waiting), send)
                    nursery.start_soon(_cancel_when, more, nursery.cancel_scope)
                    async with recv:
                        async for line in recv:
                            self._deliver(waiting, Trajectory.model_validate_json(line))
                    nursery.cancel_scope.cancel()  # every one delivered
        finally:
            self._more.pop(node_id, None)
            if self._away.get(node_id) is waiting:
                del self._away[node_id]
            if waiting:  # this daemon stops: the thief need not run them any more
                with trio.move_on_after(CANCEL_TIMEOUT_S, shield=True):
                    async with trio.open_nursery() as nursery:
                        for job_id in waiting:
                            nursery.start_soon(self._delete, node_id, job_id)

    def _deliver(self, waiting: dict[str, Job], traj: Trajectory) -> None:
        job = waiting.pop(traj.id, None)
        if job is not None:
            self._end(job, traj)
            if traj.status is Status.failed and traj.error and traj.error.type == "peer_lost":
                self.lost += 1

    def _end(self, job: Job, traj: Trajectory) -> None:
        """Finish a handed-over job here with ``traj`` (the thief's, or peer_lost)."""
        if job.done.is_set():
            return
        job.trajectory = traj.model_copy(update={"id": job.id})
        status = traj.status if traj.status.terminal else Status.failed
        job.finish(status, error=traj.error, usable=traj.usable)
        timing = job.trajectory.timing
        timing.queue_s = max(0.0, timing.total_s - timing.init_s - timing.run_s - timing.eval_s)

    def _cancel_remote(self, job: Job) -> None:
        if self._nursery is not None and job.moved_to is not None:
            self._nursery.start_soon(self._delete, job.moved_to, job.id)

    async def _delete(self, node_id: str, job_id: str) -> None:
        try:
            await self.forwarder.cancel(job_id)
        except Exception as exc:
            log.debug("could not cancel %s on %s: %r", job_id, node_id, exc)


async def _cancel_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    await trio.sleep(RELAY_MERGE_S)
    scope.cancel()


def _version(raw: Any) -> tuple[int, int] | None:
    """A ``took_at`` of an adopt's answer ([incarnation, heartbeat]), or None."""
    if (isinstance(raw, list) and len(raw) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in raw)):
        return raw[0], raw[1]
    return None


def _unstarted(pipeline: Pipeline) -> int:
    """Rollouts a peer may take from ``pipeline``: queued, or through INIT and waiting for a
    RUN worker (what capacity reports call ``queued`` and ``waiting``)."""
    return len(pipeline.intake) + pipeline.waiting


def _stealable(job: Job, thief: str, held: frozenset[str] = frozenset()) -> bool:
    """A job is handed over once: not one taken over here, nor a replay (it carries the
    replayed trajectory), nor one back to the member that forwarded it here (that member
    answers for it by asking us: it would end up asking itself). A job whose task names an
    image goes only to a thief that holds that image (``held``): one that would have to
    unpack it first (seconds to minutes, and space in its cache) is no faster than the
    victim's next free worker, and the image's homes are where placement sends such tasks."""
    image = job.request.task.get("image")
    return (job.adopted_from is None and job.moved_to is None and job.request.replay_of is None
            and job.forwarded_from != thief and (not image or image in held))
