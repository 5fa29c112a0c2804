"""The root of a daemon: owns the parts' lifetimes, wires them, and drains on SIGTERM.

    Node.run
    └─ Journal             job records in sqlite; outlives every other part
       ├─ SandboxSupervisor   every live sandbox; orphans of earlier boots swept at start
       ├─ BackendPool         LLM backends: health checks, routing, pause/resume
       ├─ Pipeline            INIT / RUN / EVAL worker pools
       ├─ Sampler             dynamic-sampling batches
       ├─ Front               relays of peers' trajectories into streams
       ├─ signal watcher      SIGTERM / SIGINT -> drain
       ├─ HTTP server         hypercorn serving ``rolloutd.daemon.api.create_app(node)``
       └─ Federation          gossip with peers and the forwarder (when seeds are configured)

What requests reach lives beside the parts, not here: ``rolloutd.daemon.front.Front`` (rollouts,
batches, forwarding, streams) and ``rolloutd.daemon.backends.Backends`` (the pool as the API manages
it); the node hands them to the HTTP layer (``rolloutd.daemon.api.Parts``).

Drain: readiness turns 503 and intake stops; queued jobs end ``cancelled``; in-flight jobs
get ``drain_timeout_s`` to finish, then are cancelled; sandboxes are torn down; exit 0.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve

from rolloutd.daemon._sdnotify import Notifier
from rolloutd.daemon.api import create_app
from rolloutd.daemon.backends import Backends
from rolloutd.daemon.config import Settings
from rolloutd.daemon.forward import Forwarder
from rolloutd.daemon.front import Front
from rolloutd.daemon.images import Images
from rolloutd.daemon.jobs import Job, new_id
from rolloutd.daemon.journal import Journal
from rolloutd.daemon.logs import redact
from rolloutd.daemon.metrics import Metrics
from rolloutd.daemon.pipeline import Pipeline, Services
from rolloutd.daemon.sampling import Sampler
from rolloutd.daemon.service import RolloutRequest, RolloutService, Submitted
from rolloutd.daemon.steal import Stealer
from rolloutd.daemon.tasks.registry import TaskRegistry
from rolloutd.federation import Federation, Member, slurm_seeds

if TYPE_CHECKING:
    from rolloutd.daemon.llm.pool import BackendPool
    from rolloutd.daemon.trajectory import Trajectory
    from rolloutd.sandbox import SandboxSupervisor

log = logging.getLogger(__name__)

#: After the drain deadline, how long cancelled jobs get to unwind before we stop waiting.
CANCEL_GRACE_S = 10.0
#: hypercorn closes a connection that stays idle this long, and its idle timer runs from
#: accept until a request's headers are complete: so it also bounds a slowloris client that
#: trickles its headers (tests/hostile/test_api_abuse.py). No read timeout: a ``wait=true``
#: request or a stream legitimately sends nothing for as long as its rollouts take.
KEEP_ALIVE_TIMEOUT_S = 75.0
#: The most bytes hypercorn (h11) buffers of a request's head that has not all arrived: a
#: forwarded group's ids (``X-Rolloutd-Ids``, up to MAX_FORWARDED_IDS of 18 characters) and a
#: stream's ids in its URL (up to MAX_STREAM_IDS) take 190 kB. At h11's 16 KiB, a head of
#: more than about 850 ids that came in several reads (any real network) was cut off with no
#: answer, so a forwarded group of 1,000 was lost.
MAX_REQUEST_HEAD_BYTES = 200 * 1024


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
        self.service = RolloutService(settings, self.pipeline, self.registry, node_id=self.node_id)
        self.metrics = Metrics(self.status)
        self.images = Images(settings)
        self.sampler = Sampler(self.service, submit=self._submit_group, prefetch=self._prefetch_ahead)
        self.journal = Journal(
            settings.state_dir / "journal.sqlite3", boot_id=self.boot_id, ttl_s=settings.result_ttl_s
        )
        self.front = Front(self.service, self.sampler, self.journal, intake=self.submit,
                           prefetch=self.images.prefetch,
                           renderer=lambda: self.services.renderer)
        self.backends = Backends(settings, lambda: self.services.pool)
        #: which engine serves the embedded model ("vllm" or "transformers"; None: none served)
        self.embedded_engine: str | None = None
        self.embedded_dtype: str | None = None  # the vLLM CPU engine's, once chosen
        self.urls: list[str] = []
        self.ready = False
        self.draining = False
        self._stop = trio.Event()
        self._http_done = trio.Event()

    # ---- parts ----------------------------------------------------------------------

    @property
    def pool(self) -> BackendPool | None:
        return self.services.pool

    @property
    def supervisor(self) -> SandboxSupervisor | None:
        return self.services.supervisor

    @property
    def federation(self) -> Federation | None:
        return self.front.federation

    @property
    def forwarder(self) -> Forwarder | None:
        return self.front.forwarder

    # ---- wiring -----------------------------------------------------------------------

    def submit(self, req: RolloutRequest, *, batch_id: str | None = None,
               replay_of: Trajectory | None = None, ids: list[str] | None = None,
               prefetch: bool = True) -> Submitted:
        """Submit to the service with the journal and metrics following each new job (the
        front's and the sampler's intake); ``replay_of``: a replay of that rollout; ``ids``:
        the ids a forwarding peer chose; ``prefetch``: False for jobs a peer will run."""
        sub = self.service.submit(req, batch_id=batch_id, replay_of=replay_of, ids=ids)
        if not sub.replayed:
            self.follow(sub.jobs, prefetch=prefetch)
        return sub

    def _submit_group(self, req: RolloutRequest, *, batch_id: str | None = None) -> Submitted:
        """The sampler's intake: a batch's group, which the front places (federation)."""
        return self.front.submit_group(req, batch_id=batch_id)

    def _prefetch_ahead(self, tasks: list[dict[str, Any]]) -> None:
        """The sampler's prefetch of coming groups' images, where the front will place them."""
        self.front.prefetch_ahead(tasks)

    def follow(self, jobs: list[Job], *, prefetch: bool = True) -> None:
        """Journal new jobs and observe them when they end (metrics: only the ones run here,
        not those handed over to a peer); fetch their images ahead (``prefetch``)."""
        self.journal.record_submitted(jobs)
        for job in jobs:
            job.add_listener(self._observe)
            job.add_listener(self.journal.record_finished)
        if prefetch:
            self.images.prefetch(list({id(j.request.task): j.request.task for j in jobs}.values()))

    def _observe(self, job: Job) -> None:
        if job.moved_to is None:
            self.metrics.observe_job(job)

    # ---- what operators read ------------------------------------------------------------

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
            "images": self.images.statistics(),
            "tools": self.metrics.tools.snapshot(),
            "history": self.metrics.history.snapshot(),
            "backends": (
                {"policy_version": self.pool.policy_version, "backends": self.pool.describe()}
                if self.pool
                else None
            ),
            "federation": (
                {"members": self.federation.members(),
                 **self._gossip_statistics(),
                 **(self.forwarder.statistics() if self.forwarder else {}),
                 **(self.front.stealer.statistics() if self.front.stealer else {})}
                if self.federation
                else None
            ),
        }

    def _gossip_statistics(self) -> dict[str, Any]:
        """``states``: members by state (this node included); ``placements``: where the tasks
        with an image submitted here went; ``gossip``: its counters since it started."""
        assert self.federation is not None
        counts = dataclasses.asdict(self.federation.statistics())
        return {"states": counts.pop("members"), "placements": counts.pop("placements"),
                "gossip": counts}

    def capacity(self) -> dict[str, Any]:
        """What federation peers are told about this node."""
        healthy = sum(1 for b in self.pool.describe() if b.get("healthy")) if self.pool else 0
        return {
            "free_slots": self.pipeline.free_capacity(),
            "queued": len(self.pipeline.intake),
            "in_flight": self.pipeline.live,
            "waiting": self.pipeline.waiting,
            "healthy_backends": healthy,
            "draining": self.draining,
            "slots": self.pipeline.slots,
            "rate": round(self.pipeline.throughput.rate, 4),
        }

    def metrics_text(self) -> tuple[bytes, str]:
        return self.metrics.render()

    def request_stop(self) -> None:
        """Begin the drain (what SIGTERM does)."""
        self._stop.set()

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
            if self._build_services:
                await self._start_services(nursery)
            if self.services.renderer is None:
                self.services.renderer = self.backends.renderer
            await nursery.start(self.images.run)
            await nursery.start(self.front.run)
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
        config = HyperConfig()
        host = self.settings.host
        config.bind = [f"[{host}]:{self.settings.port}" if ":" in host else f"{host}:{self.settings.port}"]
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        config.graceful_timeout = 2.0
        config.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
        config.h11_max_incomplete_size = MAX_REQUEST_HEAD_BYTES
        app = create_app(self)
        try:
            await serve(app, config, shutdown_trigger=shutdown, task_status=task_status)  # type: ignore[arg-type]
        finally:
            self._http_done.set()

    async def _start_services(self, nursery: trio.Nursery) -> None:
        from rolloutd.daemon.llm.pool import BackendPool, make_backend
        from rolloutd.sandbox import SandboxSupervisor

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
        pool = BackendPool(health_interval_s=s.health_interval_s, request_timeout_s=s.llm_request_timeout_s,
                           backend_wait_s=s.llm_backend_wait_s)
        await nursery.start(pool.run)
        self.services.pool = pool
        if s.embedded_model or s.backends:
            renderer = await self.backends.renderer()
            if s.embedded_model:
                self._start_embedded(nursery, pool)
            for spec in s.backends:
                pool.add(make_backend(spec, renderer=renderer), backend_id=spec.get("id"))
        if s.spawn_vllm:
            await self._spawn_vllm(nursery, pool)

    def _start_embedded(self, nursery: trio.Nursery, pool: BackendPool) -> None:
        """The embedded model: the vLLM CPU engine (supervised, started in the background:
        turns wait for it) or the in-process transformers backend (loads on first use)."""
        from rolloutd.daemon.llm.cpu_engine import EMBEDDED_ID, choose_engine
        from rolloutd.daemon.llm.pool import make_backend

        engine, why = choose_engine(self.settings.embedded_engine)
        self.embedded_engine = engine
        if engine == "vllm":
            nursery.start_soon(self._run_embedded_vllm, pool, name="embedded-vllm")
            return
        log.warning("embedded model: the in-process transformers backend serves it, one request "
                    "at a time (%s)", why)
        pool.add(make_backend({"kind": "transformers"}), backend_id=EMBEDDED_ID)

    @property
    def compile_cache(self) -> Path:
        """Where the servers this daemon supervises keep torch's compile cache between starts
        (``rolloutd.daemon.llm.spawn``): under ``cache_dir``, not in the node's ``/tmp``."""
        return self.settings.cache_dir / "torchinductor"

    def _engine_nice(self) -> int:
        """The embedded engine's niceness: the sandboxes' CPU weight, where they got one."""
        from rolloutd.daemon.llm.cpu_engine import nice_for_weight

        sup = self.services.supervisor
        backend = sup.statistics()["backends"].get(sup.default_backend) if sup else None
        weighted = backend is not None and backend.get("cpu_weight") is not None
        return nice_for_weight(self.settings.sandbox_cpu_weight) if weighted else 0

    async def _run_embedded_vllm(self, pool: BackendPool) -> None:
        from rolloutd.daemon.llm.cpu_engine import EMBEDDED_ID, choose_dtype, embedded_server
        from rolloutd.daemon.llm.pool import make_backend
        from rolloutd.daemon.llm.spawn import ServerFailed, supervise_server

        s = self.settings
        socket_dir = Path(tempfile.mkdtemp(prefix="rolloutd-vllm-"))  # mode 0700, a short path
        try:
            with pool.expect(EMBEDDED_ID):  # turns wait while the weights convert
                dtype, why = await trio.to_thread.run_sync(choose_dtype, s.embedded_dtype)
                self.embedded_dtype = dtype
                spec = await trio.to_thread.run_sync(functools.partial(
                    embedded_server, socket_dir, log_path=s.state_dir / "logs" / "embedded-vllm.log",
                    dtype=dtype, kv_cache_gib=s.embedded_kv_cache_gib, nice=self._engine_nice(),
                    compile_cache=self.compile_cache))
            log.info("embedded model: starting the vLLM CPU engine in %s, as %s (log %s)", dtype,
                     why, spec.log_path)
            await supervise_server(spec, pool)
        except ServerFailed as exc:
            if s.embedded_engine == "vllm":
                raise
            log.error("embedded model: the vLLM CPU engine failed (%s); the in-process transformers "
                      "backend serves it instead", exc)
            self.embedded_engine = "transformers"
            pool.add(make_backend({"kind": "transformers"}), backend_id=EMBEDDED_ID)
        finally:
            shutil.rmtree(socket_dir, ignore_errors=True)

    async def _spawn_vllm(self, nursery: trio.Nursery, pool: BackendPool) -> None:
        """One supervised ``vllm serve`` child per GPU, each registered as a backend."""
        from rolloutd.daemon.llm.spawn import ServerSpec, supervise_server, vllm_serve_argv

        s = self.settings
        assert s.spawn_vllm is not None
        for gpu in range(s.spawn_vllm_gpus):
            spec = ServerSpec(
                backend_id=f"vllm-gpu{gpu}",
                argv=vllm_serve_argv(s.spawn_vllm),
                port=s.spawn_vllm_port + gpu,
                env={"CUDA_VISIBLE_DEVICES": str(gpu)},
                warm_up=True,
                compile_cache=self.compile_cache,
            )
            # start_soon: loading a model takes minutes; each registers itself when healthy.
            nursery.start_soon(supervise_server, spec, pool, name=spec.backend_id)

    def _sandbox_options(self) -> dict[str, Any]:
        s = self.settings
        options: dict[str, Any] = {"spares": s.sandbox_spares, "images": self.images.store,
                                   "cpu_weight": s.sandbox_cpu_weight}
        if s.sandbox_backend == "bwrap" and s.bwrap_binary:
            options["bwrap"] = s.bwrap_binary
        if s.sandbox_backend == "apptainer":
            options["apptainer"] = s.apptainer_binary
        return options

    def _datagram_bind(self) -> tuple[str, int] | None:
        """Where gossip datagrams are received: the HTTP listener's host and (bound) port."""
        if not self.settings.gossip_udp or not self.urls:
            return None
        port = urlsplit(self.urls[0]).port
        return (self.settings.host, port) if port else None

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

        federation = Federation(
            self.node_id,
            url,
            seeds=[s for s in seeds if s.rstrip("/") != url.rstrip("/")],
            capacity=self.capacity,  # type: ignore[arg-type]
            token=self.token,
            **dataclasses.asdict(self.settings.gossip),
            datagram_bind=self._datagram_bind(),
            on_dead=on_dead,
            on_rejoin=on_rejoin,
        )
        forwarder = Forwarder(federation, self.token)
        stealer = Stealer(node_id=self.node_id, settings=self.settings, pipeline=self.pipeline,
                          service=self.service, forwarder=forwarder, journal=self.journal,
                          follow=self.follow, held_images=self.images.held)
        self.front.federation, self.front.forwarder = federation, forwarder
        self.front.stealer = stealer
        await nursery.start(forwarder.run)
        await nursery.start(stealer.run)
        await nursery.start(federation.run)


async def run(settings: Settings) -> None:
    """trio.run entry point: serve until SIGTERM/SIGINT, then drain and return.

    Python's cyclic collector is off while the daemon starts, and what start-up built is then
    frozen (``gc.freeze``): start-up grows the heap to about half a million objects
    (tokenizers, models of the API, the HTTP stack), and every full collection on the way
    walked all of it, about a third of the start's CPU. Frozen, those objects are never walked
    again; everything made while serving is collected as usual."""
    gc.disable()
    try:
        node = Node(settings, notifier=Notifier.from_environ())
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            freeze_start_heap()
    finally:
        gc.enable()


def freeze_start_heap() -> None:
    """Collect what start-up left unreachable (so it is not frozen with the rest), freeze
    every object left, and turn the collector back on."""
    gc.collect()
    gc.freeze()
    gc.enable()
