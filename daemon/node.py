"""The root of a daemon: opens the nursery tree, wires the parts, and drains on SIGTERM.

    Node.run
    └─ Journal             job records in sqlite; outlives every other part
       ├─ SandboxSupervisor   every live sandbox; orphans of earlier boots swept at start
       ├─ BackendPool         LLM backends: health checks, routing, pause/resume
       ├─ Pipeline            INIT / RUN / EVAL worker pools
       ├─ Sampler             dynamic-sampling batches
       ├─ signal watcher      SIGTERM / SIGINT -> drain
       ├─ HTTP server         hypercorn serving the quart-trio app
       └─ Federation          gossip with peers and the forwarder (when seeds are configured)

Drain: readiness turns 503 and intake stops; queued jobs end ``cancelled``; in-flight jobs
get ``drain_timeout_s`` to finish, then are cancelled; sandboxes are torn down; exit 0.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve

from daemon._sdnotify import Notifier
from daemon.config import Settings
from daemon.forward import Forwarder, PeerUnavailable
from daemon.jobs import Job, new_id
from daemon.journal import Journal, JournalError
from daemon.logs import redact
from daemon.metrics import Metrics
from daemon.pipeline import Pipeline, Services
from daemon.sampling import Batch, BatchRequest, Sampler
from daemon.service import (
    InvalidBackend,
    NotFound,
    RolloutRequest,
    RolloutService,
    ServiceUnavailable,
    Submitted,
)
from daemon.tasks.registry import TaskRegistry
from daemon.trajectory import Trajectory
from federation import Federation, Member, is_forwarded, slurm_seeds

if TYPE_CHECKING:
    from daemon.llm.chat import ChatRenderer
    from daemon.llm.pool import BackendPool
    from sandbox import SandboxSupervisor

log = logging.getLogger(__name__)

#: After the drain deadline, how long cancelled jobs get to unwind before we stop waiting.
CANCEL_GRACE_S = 10.0
#: hypercorn closes a connection that stays idle this long, and its idle timer runs from
#: accept until a request's headers are complete: so it also bounds a slowloris client that
#: trickles its headers (tests/hostile/test_api_abuse.py). No read timeout: a ``wait=true``
#: request or a stream legitimately sends nothing for as long as its rollouts take.
KEEP_ALIVE_TIMEOUT_S = 75.0


class Node:
    """One daemon. Construct it, then ``await nursery.start(node.run)``."""

    def __init__(
        self,
        settings: Settings,
        *,
        services: Services | None = None,
        registry: TaskRegistry | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.settings = settings
        self.notifier = notifier or Notifier()  # systemd readiness (Type=notify); no-op without
        self.token = settings.read_token()
        redact(self.token)
        self.boot_id = new_id("boot")
        self.started_at = time.time()
        self.node_id = settings.node_id or f"{socket.gethostname()}:{settings.port}"
        self._build_services = services is None
        self.services = services or Services()
        self.registry = registry or TaskRegistry.default()
        self.pipeline = Pipeline(settings, self.services)
        self.service = RolloutService(settings, self.pipeline, self.registry)
        self.metrics = Metrics(self.status)
        self.sampler = Sampler(self.service, submit=self.submit)
        self.journal = Journal(
            settings.state_dir / "journal.sqlite3", boot_id=self.boot_id, ttl_s=settings.result_ttl_s
        )
        self.federation: Federation | None = None
        self.forwarder: Forwarder | None = None
        self._nursery: trio.Nursery | None = None
        self.urls: list[str] = []
        self.ready = False
        self.draining = False
        self._stop = trio.Event()
        self._http_done = trio.Event()
        self._renderer: ChatRenderer | None = None
        self._renderer_lock = trio.Lock()

    # ---- parts ----------------------------------------------------------------------

    @property
    def pool(self) -> BackendPool | None:
        return self.services.pool

    @property
    def supervisor(self) -> SandboxSupervisor | None:
        return self.services.supervisor

    # ---- operations the API calls ------------------------------------------------------

    def submit(self, req: RolloutRequest) -> Submitted:
        sub = self.service.submit(req)
        if not sub.replayed:
            self.journal.record_submitted(sub.jobs)
            for job in sub.jobs:
                job.add_listener(self.metrics.observe_job)
                job.add_listener(self.journal.record_finished)
        return sub

    async def accept(self, req: RolloutRequest) -> Submitted:
        """Submit for a client: the jobs are in the journal before the client hears their ids,
        so an accepted id is never forgotten (after a crash it answers ``lost``)."""
        sub = self.submit(req)
        try:
            await self.journal.sync()
        except JournalError as exc:
            self.service.withdraw(sub, req.idempotency_key)
            raise ServiceUnavailable(f"{exc}; the rollouts were not accepted", retry_after_s=5) from None
        return sub

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
            raise ServiceUnavailable(f"{exc}; the batch was not accepted", retry_after_s=5) from None
        return batch

    async def batch_status(self, batch_id: str) -> dict[str, Any]:
        """GET /v1/batches/{id}: a batch this process runs (or ran), else its journal record."""
        try:
            return self.sampler.get(batch_id).status()
        except NotFound:
            status = await self.journal.lookup_batch(batch_id)
            if status is None:
                raise
            return status

    async def cancel_batch(self, batch_id: str) -> tuple[dict[str, Any], int]:
        """DELETE /v1/batches/{id}: 202 while it stops, 200 when it had already ended."""
        try:
            batch = self.sampler.cancel(batch_id)
        except NotFound:
            return await self.batch_status(batch_id), 200
        return batch.status(), 200 if batch.done.is_set() else 202

    async def maybe_forward(
        self, body: dict[str, Any], *, wait: bool, headers: Mapping[str, str]
    ) -> tuple[int, Any] | None:
        """Forward a submit to a peer when placement says so; None means run it here."""
        if self.forwarder is None or self.draining or is_forwarded(headers):
            return None
        member = self.forwarder.place()
        if member is None:
            return None
        try:
            return await self.forwarder.submit(member, body, wait=wait)
        except PeerUnavailable as exc:
            log.warning("forwarding to %s failed (%s); running here", member.node_id, exc)
            return None

    def lookup(self, job_id: str) -> Job:
        """A job this process holds (raises NotFound otherwise)."""
        return self.service.get(job_id)

    async def find(self, job_id: str) -> Job | Trajectory:
        """A live or recent job, else its journal record (a finished or ``lost`` trajectory)."""
        try:
            return self.service.get(job_id)
        except NotFound:
            traj = await self.journal.lookup(job_id)
            if traj is None:
                raise
            return traj

    async def cancel(self, job_id: str) -> Job | Trajectory:
        found = await self.find(job_id)
        if isinstance(found, Job):
            self.pipeline.cancel(found)
        return found

    async def rollout_json(self, job_id: str) -> dict[str, Any]:
        """GET /v1/rollouts/{id}: here, in the journal, or on the peer it was forwarded to."""
        if self.forwarder is not None and self.forwarder.knows(job_id):
            return await self._from_peer(self.forwarder.get(job_id))
        found = await self.find(job_id)
        return found.trajectory.model_dump(mode="json") if isinstance(found, Job) else found.model_dump(mode="json")

    async def cancel_json(self, job_id: str) -> tuple[dict[str, Any], int]:
        """DELETE /v1/rollouts/{id}: 202 while it stops, 200 when it was already finished."""
        if self.forwarder is not None and self.forwarder.knows(job_id):
            status, body = await self._from_peer(self.forwarder.cancel(job_id))
            return body, status
        found = await self.cancel(job_id)
        if isinstance(found, Trajectory):
            return {"id": found.id, "status": found.status.value}, 200
        return {"id": found.id, "status": found.status.value}, 200 if found.done.is_set() else 202

    async def open_stream(self, ids: list[str]) -> trio.MemoryReceiveChannel[str]:
        """A channel that receives each rollout's trajectory (a JSON line) once, as it finishes.

        Exactly ``len(ids)`` items arrive. Unknown ids raise NotFound before anything starts.
        Rollouts forwarded to peers are relayed by tasks in this node's nursery; they stop when
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
                old.append(json.dumps(await self.forwarder.get(job_id)))
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

    async def _from_peer(self, call: Awaitable[Any]) -> Any:
        try:
            return await call
        except PeerUnavailable as exc:
            raise ServiceUnavailable(str(exc), retry_after_s=5) from None

    async def add_backend(self, spec: dict[str, Any]) -> str:
        """Register an LLM backend. Building one may load a tokenizer, so it runs in a thread."""
        from daemon.llm.pool import make_backend

        if self.pool is None:
            raise ServiceUnavailable("this daemon has no LLM backend pool")
        backend_id = spec.pop("id", None)
        renderer = await self.renderer()
        try:
            backend = make_backend(spec, renderer=renderer)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidBackend(f"bad backend spec: {exc}") from None
        return self.pool.add(backend, backend_id=backend_id)

    def status(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "boot_id": self.boot_id,
            "uptime_s": round(time.time() - self.started_at, 3),
            "ready": self.ready,
            "draining": self.draining,
            "urls": self.urls,
            "pipeline": self.pipeline.statistics(),
            "rollouts": {"submitted": self.service.submitted_total, **self.service.store.counts()},
            "sandboxes": self.supervisor.statistics() if self.supervisor else None,
            "backends": (
                {"policy_version": self.pool.policy_version, "backends": self.pool.describe()}
                if self.pool
                else None
            ),
            "federation": (
                {"members": self.federation.members(), **(self.forwarder.statistics() if self.forwarder else {})}
                if self.federation
                else None
            ),
        }

    def capacity(self) -> dict[str, Any]:
        """What federation peers are told about this node."""
        healthy = sum(1 for b in self.pool.describe() if b.get("healthy")) if self.pool else 0
        return {
            "free_slots": self.pipeline.free_capacity(),
            "queued": len(self.pipeline.intake),
            "in_flight": self.pipeline.live,
            "healthy_backends": healthy,
            "draining": self.draining,
        }

    def metrics_text(self) -> tuple[bytes, str]:
        return self.metrics.render()

    def request_stop(self) -> None:
        """Begin the drain (what SIGTERM does)."""
        self._stop.set()

    async def renderer(self) -> ChatRenderer:
        """The chat renderer for the served model, loaded once (off the event loop): the
        ``tokenizer`` setting's directory, or the embedded SmolLM2 tokenizer."""
        async with self._renderer_lock:
            if self._renderer is None:
                self._renderer = await trio.to_thread.run_sync(self._load_renderer)
            return self._renderer

    def _load_renderer(self) -> ChatRenderer:
        from daemon.llm.chat import ChatRenderer, load_embedded_tokenizer

        s = self.settings
        if s.tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(s.tokenizer, local_files_only=True)
        else:
            tok = load_embedded_tokenizer()
        return ChatRenderer.for_tokenizer(
            tok, s.chat_family, reasoning=s.reasoning, context_length=s.context_length
        )

    # ---- lifetime --------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        settings = self.settings
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        # The journal outlives every other part, so the last job outcomes are recorded.
        async with trio.open_nursery() as outer:
            await outer.start(self.journal.run)
            await self._run_parts(task_status)
            outer.cancel_scope.cancel()
        log.info("rolloutd %s stopped", self.node_id)

    async def _run_parts(self, task_status: trio.TaskStatus[Node]) -> None:
        settings = self.settings
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self._build_services:
                await self._start_services(nursery)
            if self.services.renderer is None:
                self.services.renderer = self.renderer
            await nursery.start(self.pipeline.run)
            await nursery.start(self.sampler.run)
            nursery.start_soon(self._watch_signals, name="signals")
            http_stop = trio.Event()
            self.urls = await nursery.start(self._serve_http, http_stop.wait)
            if settings.seeds or settings.slurm_seeds:
                await self._start_federation(nursery)
            self.ready = True
            log.info("rolloutd %s ready on %s", self.node_id, ", ".join(self.urls))
            self.notifier.notify("READY=1", f"STATUS=ready on {', '.join(self.urls)}")
            task_status.started(self)

            await self._stop.wait()
            await self._drain()
            http_stop.set()
            # Give hypercorn a moment to finish open responses, then end everything else
            # (the supervisor tears down any sandbox still alive, shielded and bounded).
            with trio.move_on_after(3):
                await self._http_done.wait()
            nursery.cancel_scope.cancel()

    async def _drain(self) -> None:
        log.info("draining: %d jobs live, up to %.1fs", self.pipeline.live, self.settings.drain_timeout_s)
        self.ready = False
        self.notifier.notify("STOPPING=1", f"STATUS=draining {self.pipeline.live} rollouts")
        self.draining = True
        self.service.draining = True
        self.pipeline.stop_intake()
        self.pipeline.cancel_queued()
        with trio.move_on_after(self.settings.drain_timeout_s):
            await self.pipeline.wait_idle()
        if self.pipeline.live:
            log.warning("drain deadline reached: cancelling %d jobs", self.pipeline.live)
            self.pipeline.cancel_all()
            with trio.move_on_after(CANCEL_GRACE_S):
                await self.pipeline.wait_idle()

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("received %s", signal.Signals(signum).name)
                self.request_stop()

    async def _serve_http(
        self, shutdown: Any, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        from daemon.api import create_app

        config = HyperConfig()
        host = self.settings.host
        config.bind = [f"[{host}]:{self.settings.port}" if ":" in host else f"{host}:{self.settings.port}"]
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        config.graceful_timeout = 2.0
        config.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
        app = create_app(self)
        try:
            await serve(app, config, shutdown_trigger=shutdown, task_status=task_status)  # type: ignore[arg-type]
        finally:
            self._http_done.set()

    async def _start_services(self, nursery: trio.Nursery) -> None:
        from daemon.llm.pool import BackendPool, make_backend
        from sandbox import SandboxSupervisor

        s = self.settings
        supervisor = SandboxSupervisor(
            default_backend=s.sandbox_backend,
            state_dir=s.state_dir / "sandboxes",
            boot_id=self.boot_id,
            pool_size=s.sandbox_pool_size,
            pool_spec=self.pipeline.sandbox_defaults(),
            **self._sandbox_options(),
        )
        await nursery.start(supervisor.run)
        self.services.supervisor = supervisor
        pool = BackendPool(health_interval_s=s.health_interval_s, request_timeout_s=s.llm_request_timeout_s)
        await nursery.start(pool.run)
        self.services.pool = pool
        if s.embedded_model or s.backends:
            renderer = await self.renderer()
            if s.embedded_model:
                pool.add(make_backend({"kind": "transformers"}, renderer=renderer), backend_id="embedded")
            for spec in s.backends:
                spec = dict(spec)
                backend_id = spec.pop("id", None)  # before make_backend: specs forbid unknown keys
                pool.add(make_backend(spec, renderer=renderer), backend_id=backend_id)
        if s.spawn_vllm:
            await self._spawn_vllm(nursery, pool)

    async def _spawn_vllm(self, nursery: trio.Nursery, pool: BackendPool) -> None:
        """One supervised ``vllm serve`` child per GPU, each registered as a backend."""
        from daemon.llm.spawn import ServerSpec, supervise_server, vllm_serve_argv

        s = self.settings
        assert s.spawn_vllm is not None
        for gpu in range(s.spawn_vllm_gpus):
            spec = ServerSpec(
                backend_id=f"vllm-gpu{gpu}",
                argv=vllm_serve_argv(s.spawn_vllm),
                port=s.spawn_vllm_port + gpu,
                env={"CUDA_VISIBLE_DEVICES": str(gpu)},
            )
            # start_soon: loading a model takes minutes; each registers itself when healthy.
            nursery.start_soon(supervise_server, spec, pool, name=spec.backend_id)

    def _sandbox_options(self) -> dict[str, Any]:
        s = self.settings
        options: dict[str, Any] = {"spares": s.sandbox_spares}
        if s.sandbox_backend == "apptainer":
            options["apptainer"] = s.apptainer_binary
            options["image_cache_dir"] = str(s.image_cache_dir or s.cache_dir / "images")
        return options

    async def _start_federation(self, nursery: trio.Nursery) -> None:
        seeds = list(self.settings.seeds)
        if self.settings.slurm_seeds:
            seeds += await slurm_seeds(self.settings.port)
        url = self.settings.url or self.urls[0]

        async def on_dead(member: Member) -> None:
            assert self.forwarder is not None
            await self.forwarder.on_dead(member)

        async def on_rejoin(member: Member) -> None:
            assert self.forwarder is not None
            await self.forwarder.on_rejoin(member)

        gossip = self.settings.gossip
        self.federation = Federation(
            self.node_id,
            url,
            seeds=[s for s in seeds if s.rstrip("/") != url.rstrip("/")],
            capacity=self.capacity,  # type: ignore[arg-type]
            token=self.token,
            gossip_interval_s=gossip.gossip_interval_s,
            fanout=gossip.fanout,
            suspect_after_s=gossip.suspect_after_s,
            dead_after_s=gossip.dead_after_s,
            request_timeout_s=gossip.request_timeout_s,
            on_dead=on_dead,
            on_rejoin=on_rejoin,
        )
        self.forwarder = Forwarder(self.federation, self.token)
        await nursery.start(self.forwarder.run)
        await nursery.start(self.federation.run)


async def run(settings: Settings) -> None:
    """trio.run entry point: serve until SIGTERM/SIGINT, then drain and return."""
    node = Node(settings, notifier=Notifier.from_environ())
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
