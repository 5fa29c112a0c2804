"""What a client's requests reach behind the HTTP layer: rollouts and batches, here or on a peer.

The front accepts work (journaled before the client hears of it), forwards a submit to a peer
when placement says so, answers for a rollout wherever it is (this process, the journal, the
peer it was forwarded to), streams trajectories as they finish (relaying a peer's), and
answers for batches (the sampler's, else the journal's record). It returns data, never HTTP:
the API layer shapes the answers and maps errors (``rolloutd.daemon.errors``) to status codes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from rolloutd.daemon.batch import Batch, BatchRequest
from rolloutd.daemon.errors import BadRequest, NotFound, RequestError, ServiceUnavailable
from rolloutd.daemon.forward import Forwarder, PeerAnswer, PeerTrajectory, PeerUnavailable
from rolloutd.daemon.images import PrefetchRequest, task_images
from rolloutd.daemon.jobs import Job, RolloutFilter
from rolloutd.daemon.journal import Journal, JournalError
from rolloutd.daemon.sampling import Sampler
from rolloutd.daemon.service import RolloutRequest, RolloutService, Submitted
from rolloutd.daemon.trajectory import Trajectory
from rolloutd.federation import forwarded_ids, forwarded_origin, is_forwarded, took_at_headers

if TYPE_CHECKING:
    from rolloutd.daemon.llm.chat import ChatRenderer
    from rolloutd.daemon.steal import AdoptRequest, Stealer, StealRequest
    from rolloutd.federation import Federation

log = logging.getLogger(__name__)

#: How long a client should wait before retrying when the journal or a peer failed.
RETRY_AFTER_S = 5


@dataclass(frozen=True)
class Cancelled:
    """A cancel's outcome: the resource as it stands, and whether it had already ended."""

    body: dict[str, Any]
    ended: bool


class Front:
    """Rollouts and batches as clients see them. ``intake`` submits a request to the service
    with the journal and metrics attached (the node wires it); ``forwarder`` and
    ``federation`` are set when federation starts."""

    def __init__(
        self,
        service: RolloutService,
        sampler: Sampler,
        journal: Journal,
        *,
        intake: Callable[..., Submitted],
        renderer: Callable[[], Callable[[], Awaitable[ChatRenderer]] | None] = lambda: None,
        prefetch: Callable[[list[dict[str, Any]]], None] = lambda tasks: None,
    ) -> None:
        self.service = service
        self.sampler = sampler
        self.journal = journal
        self._intake = intake
        self._renderer = renderer
        self._prefetch = prefetch
        self.federation: Federation | None = None
        self.forwarder: Forwarder | None = None
        self.stealer: Stealer | None = None
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery that relays peers' trajectories into streams."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    @property
    def max_group_size(self) -> int:
        return self.service.max_group_size

    # ---- rollouts ---------------------------------------------------------------------

    async def accept(self, req: RolloutRequest, *, replay_of: Trajectory | None = None,
                     ids: list[str] | None = None) -> Submitted:
        """Submit for a client: the jobs are in the journal before the client hears their ids,
        so an accepted id is never forgotten (after a crash it answers ``lost``). ``ids``: the
        ids a forwarding peer chose."""
        extra: dict[str, Any] = {}
        if replay_of is not None:
            extra["replay_of"] = replay_of
        if ids is not None:
            extra["ids"] = ids
        sub = self._intake(req, **extra)
        try:
            await self.journal.sync()
        except JournalError as exc:
            self.service.withdraw(sub, req.idempotency_key)
            raise ServiceUnavailable(
                f"{exc}; the rollouts were not accepted", retry_after_s=RETRY_AFTER_S
            ) from None
        return sub

    async def submit(
        self, body: dict[str, Any], req: RolloutRequest, *, wait: bool, headers: Mapping[str, str]
    ) -> Submitted | PeerAnswer:
        """A client's submit (``req`` is ``body`` parsed): forwarded to a peer when placement
        says so (the peer's answer), else accepted here; with ``wait``, once every sample ended."""
        forwarded = await self._maybe_forward(body, req, wait=wait, headers=headers)
        if forwarded is not None:
            return forwarded
        ids = origin = None
        if is_forwarded(headers):
            try:
                ids = forwarded_ids(headers)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            origin = forwarded_origin(headers)
        sub = await self.accept(req, ids=ids)
        if origin is not None and not sub.replayed:
            for job in sub.jobs:
                job.forwarded_from = origin
        if wait:
            await self.service.wait(sub.jobs)
        return sub

    async def accept_forwarded(self, origin: str, items: list[tuple[RolloutRequest, list[str]]]
                               ) -> list[Submitted | RequestError]:
        """Submits that peer ``origin`` forwarded in one request (``POST /v1/federation/submit``),
        each a request and the ids that peer chose: each accepted as a forwarded ``POST
        /v1/rollouts`` is (never forwarded again), or its error; one journal sync for them all."""
        results: list[Submitted | RequestError] = []
        for req, ids in items:
            try:
                results.append(self._intake(req, ids=ids))
            except RequestError as exc:
                results.append(exc)
        taken = [(sub, req) for sub, (req, _) in zip(results, items, strict=True)
                 if isinstance(sub, Submitted)]
        if not taken:
            return results
        try:
            await self.journal.sync()
        except JournalError as exc:
            for sub, req in taken:
                self.service.withdraw(sub, req.idempotency_key)
            refused = ServiceUnavailable(f"{exc}; the rollouts were not accepted", retry_after_s=RETRY_AFTER_S)
            return [refused if isinstance(r, Submitted) else r for r in results]
        for sub, _ in taken:
            if not sub.replayed:
                for job in sub.jobs:
                    job.forwarded_from = origin
        return results

    def submit_group(self, req: RolloutRequest, *, batch_id: str | None = None) -> Submitted:
        """A batch's group (the sampler's intake): accepted here, and placed as a client's
        submit is (its image's homes first). When placement picks a peer, the group is
        handed over to it at once under the same ids (daemon/steal.py): this node answers
        for its samples, and the batch judges and streams them here."""
        member = None
        if (self.stealer is not None and self.stealer.running and self.forwarder is not None
                and not self.service.draining):
            member = self.forwarder.place(req.n, next(iter(task_images([req.task])), None))
        if member is None:
            return self._intake(req, batch_id=batch_id)
        try:
            sub = self._intake(req, batch_id=batch_id, prefetch=False)  # its image: the peer's
        except BaseException:
            assert self.federation is not None
            self.federation.forwarded(member.node_id, None, taken=False, n=req.n)
            raise
        assert self.stealer is not None
        self.stealer.place(member, sub.jobs, req.n)
        return sub

    def accepted_headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        """Headers for the 202 of a submit with ``headers``: to a forwarded one, this node's
        federation version now, after it took the rollouts (the front's placement counts them
        against this node until a capacity report of a later heartbeat does)."""
        if self.federation is None or not is_forwarded(headers):
            return {}
        return took_at_headers(self.federation.version)

    async def _maybe_forward(
        self, body: dict[str, Any], req: RolloutRequest, *, wait: bool, headers: Mapping[str, str]
    ) -> PeerAnswer | None:
        if self.forwarder is None or self.service.draining or is_forwarded(headers):
            return None
        image = next(iter(task_images([req.task])), None)
        member = self.forwarder.place(req.n, image)
        if member is None:
            return None
        try:
            return await self.forwarder.submit(member, body, req.n, wait=wait)
        except PeerUnavailable as exc:  # it provably never took them
            log.warning("forwarding to %s failed (%s); running here", member.node_id, exc)
            return None

    async def find(self, job_id: str) -> Job | Trajectory:
        """A live or recent job, else its journal record (a finished or ``lost`` trajectory)."""
        try:
            return self.service.get(job_id)
        except NotFound:
            traj = await self.journal.lookup(job_id)
            if traj is None:
                raise
            return traj

    async def rollout(self, job_id: str) -> str:
        """A rollout's trajectory so far, as JSON: here, in the journal, or on the peer it went
        to (a rollout handed over to a peer is asked there until it ended)."""
        job = self.service.store.get(job_id)
        if job is not None and (job.moved_to is None or job.done.is_set()):
            return job.trajectory.model_dump_json()
        if self.forwarder is not None and self.forwarder.knows(job_id):
            looked_up: PeerTrajectory = await self._from_peer(self.forwarder.get(job_id))
            return looked_up.text
        found = await self.find(job_id)
        traj = found.trajectory if isinstance(found, Job) else found
        return traj.model_dump_json()

    async def replay(self, job_id: str) -> Submitted:
        """Replay finished rollout ``job_id`` here (daemon/replay.py): a new rollout."""
        req, original = self.service.replay_request(job_id)
        return await self.accept(req, replay_of=original)

    async def token_pieces(self, job_id: str) -> dict[str, Any]:
        """The text of each token of rollout ``job_id``, decoded by the served tokenizer."""
        found = await self.find(job_id)
        traj = found.trajectory if isinstance(found, Job) else found
        factory = self._renderer()
        if factory is None:
            raise ServiceUnavailable("this daemon has no tokenizer (no LLM backend is configured)")
        renderer = await factory()
        ids = list(traj.token_ids)
        pieces = await trio.to_thread.run_sync(renderer.token_pieces, ids)
        return {"id": traj.id, "pieces": pieces}

    def list_rollouts(self, match: RolloutFilter, *, limit: int, offset: int) -> dict[str, Any]:
        """The rollouts this daemon holds (its result store: live ones and finished ones
        within ``result_ttl_s``/``max_results``) that ``match`` selects, newest first; neither
        the journal's older records nor rollouts forwarded to peers."""
        jobs, total = self.service.store.select(match, limit=limit, offset=offset)
        return {"rollouts": [job.listing().model_dump(mode="json") for job in jobs], "total": total}

    async def cancel(self, job_id: str) -> Cancelled | PeerAnswer:
        """Cancel a rollout (its sandbox is torn down, its LLM request aborted)."""
        if self.forwarder is not None and self.forwarder.knows(job_id):
            answer: PeerAnswer = await self._from_peer(self.forwarder.cancel(job_id))
            return answer
        found = await self.find(job_id)
        if isinstance(found, Job):
            self.service.pipeline.cancel(found)
            ended = found.done.is_set()
        else:
            ended = True
        return Cancelled({"id": found.id, "status": found.status.value}, ended=ended)

    async def open_stream(self, ids: list[str]) -> trio.MemoryReceiveChannel[str]:
        """A channel that receives each rollout's trajectory (a JSON line) once, as it finishes.

        Exactly ``len(ids)`` items arrive. Unknown ids raise NotFound before anything starts.
        Rollouts forwarded to peers are relayed by tasks in the front's nursery; they stop when
        the receiver is closed.
        """
        local: list[Job] = []
        old: list[str] = []
        remote: dict[str, list[str]] = {}
        for job_id in ids:
            node_id = self.forwarder.node_of(job_id) if self.forwarder is not None else None
            if node_id is not None:
                remote.setdefault(node_id, []).append(job_id)
            elif self.forwarder is not None and self.forwarder.knows(job_id):
                old.append((await self.forwarder.get(job_id)).text)
            else:
                found = await self.find(job_id)
                if isinstance(found, Job):
                    local.append(found)
                else:
                    old.append(found.model_dump_json())
        send, recv = trio.open_memory_channel[str](max(1, len(ids)))
        for line in old:
            send.send_nowait(line)

        def deliver(job: Job) -> None:
            try:
                send.send_nowait(job.trajectory.model_dump_json())
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        for job in local:
            job.add_listener(deliver)
        if remote:
            assert self.forwarder is not None and self._nursery is not None
            for node_id, peer_ids in remote.items():
                self._nursery.start_soon(self.forwarder.relay, node_id, peer_ids, send.clone())
        return recv

    async def _from_peer(self, call: Any) -> Any:
        try:
            return await call
        except PeerUnavailable as exc:
            raise ServiceUnavailable(str(exc), retry_after_s=RETRY_AFTER_S) from None

    # ---- batches ----------------------------------------------------------------------

    async def create_batch(self, req: BatchRequest) -> Batch:
        """Create a batch for a client: like a rollout, it is in the journal before the client
        hears its id (after a crash it answers with state ``lost``)."""
        batch = self.sampler.create(req)
        self.journal.record_batch(batch.status())
        self.journal.follow_batch(batch)
        try:
            await self.journal.sync()
        except JournalError as exc:
            self.sampler.cancel(batch.id, reason=str(exc))
            raise ServiceUnavailable(
                f"{exc}; the batch was not accepted", retry_after_s=RETRY_AFTER_S
            ) from None
        return batch

    async def batch(self, batch_id: str) -> dict[str, Any]:
        """A batch's progress: one this process runs (or ran), else its journal record."""
        try:
            return self.sampler.get(batch_id).status()
        except NotFound:
            status = await self.journal.lookup_batch(batch_id)
            if status is None:
                raise
            return status

    async def cancel_batch(self, batch_id: str) -> Cancelled:
        """Stop a batch (its running groups are cancelled)."""
        try:
            batch = self.sampler.cancel(batch_id)
        except NotFound:
            return Cancelled(await self.batch(batch_id), ended=True)
        return Cancelled(batch.status(), ended=batch.done.is_set())

    def batch_groups(self, batch_id: str, *, start: int = 0) -> AsyncGenerator[dict[str, Any]]:
        """A batch's kept groups as lines (dicts), from index ``start``, as they are kept.
        Raises NotFound now, not when iterated; close the generator (aclosing)."""
        batch = self.sampler.get(batch_id)
        return self._group_lines(batch, start)

    async def _group_lines(self, batch: Batch, start: int) -> AsyncGenerator[dict[str, Any]]:
        async with aclosing(self.sampler.groups(batch, start=start)) as groups:
            async for group in groups:
                yield group.line()

    # ---- federation -------------------------------------------------------------------

    def members(self) -> list[dict[str, Any]]:
        """The federation's member table (empty without federation)."""
        return self.federation.members() if self.federation is not None else []

    async def steal(self, req: StealRequest) -> dict[str, Any]:
        """A peer with free slots asks for queued rollouts (work stealing)."""
        return await self._stealing().give(req)

    async def adopt(self, req: AdoptRequest) -> dict[str, Any]:
        """A peer hands over queued rollouts (work stealing)."""
        return await self._stealing().adopt(req)

    def _stealing(self) -> Stealer:
        if self.stealer is None:
            raise NotFound("federation is not enabled on this daemon")
        return self.stealer

    def prefetch_ahead(self, tasks: list[dict[str, Any]]) -> None:
        """Fetch the images of coming tasks (a batch's next groups) where they will run: here
        without federation; with it, on each image's homes (this node, if it is one; a
        peer, asked with ``POST /v1/federation/prefetch``), where placement sends them."""
        if self.federation is None or self.forwarder is None or self._nursery is None:
            self._prefetch(tasks)
            return
        here: list[dict[str, Any]] = []
        for image in task_images(tasks):
            for node_id in self.federation.image_homes(image):
                if node_id == self.federation.node_id:
                    here.append({"image": image})
                else:
                    self._nursery.start_soon(self.forwarder.prefetch, node_id, [image])
        self._prefetch(here)

    async def prefetch(self, req: PrefetchRequest) -> dict[str, Any]:
        """A peer asks this node, a home of ``req.images``, to fetch them ahead."""
        if self.federation is None:
            raise NotFound("federation is not enabled on this daemon")
        self._prefetch([{"image": image} for image in req.images])
        await trio.lowlevel.checkpoint()
        return {"prefetching": len(req.images)}

    async def gossip(self, read_payload: Callable[[], Awaitable[Any]]) -> dict[str, Any]:
        """Answer a peer's gossip, read by ``read_payload`` once federation is known to be on
        here (NotFound otherwise)."""
        if self.federation is None:
            raise NotFound("federation is not enabled on this daemon")
        payload = await read_payload()
        try:
            return self.federation.handle_gossip(payload)
        except ValueError as exc:
            raise BadRequest(f"bad gossip payload: {exc}") from None
