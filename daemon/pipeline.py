"""The INIT / RUN / EVAL pipeline: three independent worker pools joined by bounded queues.

    intake (JobQueue, bounded) -> INIT x n_init -> ready (JobQueue) -> RUN x n_run
                                -> eval channel -> EVAL x n_eval -> result store

Each stage works on a job under ``trio.fail_after(job.budget.remaining())``; the budget is
paused while the job waits, so a job's ``timeout_s`` is a budget for work, not for waiting.
Between stages wait at most one job per downstream worker: when RUN is full, INIT stops
pulling from the intake, and when the intake is full the API answers 429. ``ready`` holds
the jobs through INIT that wait for a RUN worker (up to ``n_run``, plus one per INIT worker
waiting for room). It is a queue rather than a channel so that work stealing can hand such
a job over to an idle peer (``hand_over``): its sandbox is torn down here and the peer runs
its INIT again; no agent step of it has run anywhere yet.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from rolloutd.daemon.errors import DaemonError
from rolloutd.daemon.jobs import Job, JobQueue, QueueClosed, StageStats
from rolloutd.daemon.tasks.base import EvalContext, TaskFailure
from rolloutd.daemon.throughput import Throughput
from rolloutd.daemon.trajectory import ErrorInfo, Stage, Status

if TYPE_CHECKING:
    from rolloutd.daemon.config import Settings
    from rolloutd.daemon.harness import AgentSpec
    from rolloutd.daemon.llm.chat import ChatRenderer
    from rolloutd.daemon.llm.pool import BackendPool
    from rolloutd.sandbox import Sandbox, SandboxSpec, SandboxSupervisor

log = logging.getLogger(__name__)

#: How long a sandbox teardown may take before we stop waiting for it.
RELEASE_TIMEOUT_S = 15.0


class PipelineError(DaemonError):
    """A job cannot run because a part the daemon needs for it is missing."""


@dataclass
class Services:
    """The parts a stage may need; absent parts fail the jobs that need them, clearly."""

    supervisor: SandboxSupervisor | None = None
    pool: BackendPool | None = None
    renderer: Callable[[], Awaitable[ChatRenderer]] | None = None


class Pipeline:
    def __init__(self, settings: Settings, services: Services) -> None:
        self.settings = settings
        self.services = services
        self.intake = JobQueue(settings.queue_size)
        self.stats = {
            Stage.init: StageStats(Stage.init, settings.n_init),
            Stage.run: StageStats(Stage.run, settings.n_run),
            Stage.eval: StageStats(Stage.eval, settings.n_eval),
        }
        # never full: an INIT worker adds one job, then waits until at most n_run are left
        self.ready = JobQueue(settings.n_init + settings.n_run)
        self._eval_send, self._eval_recv = trio.open_memory_channel[Job](settings.n_eval)
        self._live: set[Job] = set()
        self._away: set[Job] = set()  # handed over to a peer, not finished yet
        self._nursery: trio.Nursery | None = None  # run()'s, while it runs
        self._idle = trio.Event()
        self._idle.set()
        self._room = trio.lowlevel.ParkingLot()  # wait_for_room's waiters
        self.throughput = Throughput()  # its rate while full, for federation placement

    # ---- public API -------------------------------------------------------------------

    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs, all or none; raises QueueFull or QueueClosed."""
        self.intake.put_many_nowait(jobs)
        for job in jobs:
            self._track(job)

    def cancel(self, job: Job) -> None:
        """Cancel a job in any state; what it holds is released by whoever holds it."""
        if job.done.is_set():
            return
        job.cancel()
        if self.intake.remove(job):
            self._finish(job, Status.cancelled, stage=Stage.queue, etype="cancelled",
                         message="cancelled while queued")
        elif self._nursery is not None and self.ready.remove(job):
            # through INIT, waiting for a RUN worker: released now, not when one is free
            self._nursery.start_soon(self._cancel_waiting, job)

    async def _cancel_waiting(self, job: Job) -> None:
        await self._conclude(job, Status.cancelled, stage=Stage.run, etype="cancelled",
                             message="cancelled before run")

    @property
    def waiting(self) -> int:
        """Jobs through INIT waiting for a RUN worker."""
        return len(self.ready)

    async def hand_over(self, n: int, eligible: Callable[[Job], bool]) -> list[Job]:
        """Withdraw up to ``n`` jobs that no RUN worker has started, for a peer to run: the
        queued ones that would start last, then, if that is not ``n``, those waiting in
        ``ready`` (newest first; their sandboxes are released here, and they are queued
        again as far as their status says). They no longer count here, but the pipeline
        stays busy (``wait_idle``) until each is finished (with the peer's result) or taken
        back (``take_back``)."""

        def ok(job: Job) -> bool:
            return not job.done.is_set() and not job.cancel_requested and eligible(job)

        jobs = self.intake.take_last(n, ok)
        initialized = self.ready.take_last(n - len(jobs), ok) if len(jobs) < n else []
        for job in jobs + initialized:
            self._live.discard(job)
            self._away.add(job)
        self._held_changed()
        for job in initialized:
            await self._release(job)
            job.set_stage(Status.queued)
            log.info("rollout %s withdrawn after INIT on %s, for a peer", job.id,
                     job.trajectory.node_id, extra=_ids(job, stage=Stage.init.value))
        return jobs + initialized

    def withdraw(self, jobs: list[Job]) -> list[Job]:
        """Withdraw ``jobs`` from the intake, for a peer to run (placement chose one for a
        batch's group just queued here): as ``hand_over`` does, but these jobs, and only
        those still queued (returned). Synchronous: a job queued in the same step has not
        been started by an INIT worker."""
        taken = [job for job in jobs
                 if not job.done.is_set() and not job.cancel_requested and self.intake.remove(job)]
        for job in taken:
            self._live.discard(job)
            self._away.add(job)
        if taken:
            self._held_changed()
        return taken

    def take_back(self, jobs: list[Job]) -> None:
        """Queue again handed-over jobs the peer did not take (cancelled if this daemon is
        draining, or if they were cancelled meanwhile)."""
        back = []
        for job in jobs:
            self._away.discard(job)
            if job.done.is_set():
                continue
            self._live.add(job)
            self._held_changed()
            if job.cancel_requested:
                self._finish(job, Status.cancelled, stage=Stage.queue, etype="cancelled",
                             message="cancelled while queued")
            else:
                back.append(job)
        try:
            self.intake.put_back(back)
        except QueueClosed:
            for job in back:
                job.cancel()
                self._finish(job, Status.cancelled, stage=Stage.queue, etype="cancelled",
                             message="the daemon is shutting down")

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def away(self) -> int:
        """Jobs handed over to peers and not finished yet."""
        return len(self._away)

    async def wait_idle(self) -> None:
        """Return once no job is queued or in flight."""
        await self._idle.wait()

    def has_room(self) -> bool:
        """Whether a job taken in now would start without queueing behind others: a free
        slot, and nothing queued."""
        return self.free_capacity() > 0 and not len(self.intake)

    async def wait_for_room(self) -> None:
        """Return once ``has_room()`` (at once if it is so now)."""
        while not self.has_room():
            await self._room.park()

    def statistics(self) -> dict[str, Any]:
        return {
            "queued": len(self.intake),
            "waiting": len(self.ready),
            "queue_capacity": self.intake.capacity,
            "accepting": not self.intake.closed,
            "live_jobs": len(self._live),
            "handed_over": len(self._away),
            "stages": {
                "init": self.stats[Stage.init].snapshot(len(self.intake)),
                "run": self.stats[Stage.run].snapshot(len(self.ready)),
                "eval": self.stats[Stage.eval].snapshot(
                    self._eval_recv.statistics().current_buffer_used
                ),
            },
        }

    @property
    def slots(self) -> int:
        """Its workers: INIT, RUN and EVAL together."""
        return self.settings.n_init + self.settings.n_run + self.settings.n_eval

    def free_capacity(self) -> int:
        """Jobs that could start work now without queueing behind others."""
        return max(0, self.slots - len(self._live)) if not self.intake.closed else 0

    def stop_intake(self) -> None:
        self.intake.close()

    def cancel_queued(self) -> None:
        for job in self.intake.drain_nowait():
            job.cancel()
            self._finish(job, Status.cancelled, stage=Stage.queue, etype="cancelled",
                         message="the daemon is shutting down")

    def cancel_all(self) -> None:
        self.cancel_queued()
        for job in [*self._live, *self._away]:
            self.cancel(job)

    # ---- the stages -----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for i in range(self.settings.n_init):
                    nursery.start_soon(self._init_worker, name=f"init-{i}")
                for i in range(self.settings.n_run):
                    nursery.start_soon(self._run_worker, name=f"run-{i}")
                for i in range(self.settings.n_eval):
                    nursery.start_soon(self._eval_worker, self._eval_recv.clone(), name=f"eval-{i}")
                task_status.started()
        finally:
            self._nursery = None
            # Whatever is still live when the pipeline is torn down ends cancelled.
            with trio.move_on_after(RELEASE_TIMEOUT_S, shield=True):
                for job in list(self._live):
                    await self._conclude(job, Status.cancelled, stage=_stage_of(job),
                                         etype="cancelled", message="the daemon stopped")
                for job in list(self._away):
                    self._finish(job, Status.cancelled, stage=Stage.queue, etype="cancelled",
                                 message=f"the daemon stopped while {job.moved_to} ran it")

    async def _init_worker(self) -> None:
        while True:
            try:
                job = await self.intake.get()
            except trio.EndOfChannel:
                return
            self._room_changed()  # the queue may be empty now
            if await self._stage(job, Stage.init, self._do_init):
                self.ready.put_back([job])
                await self.ready.wait_at_most(self.settings.n_run)

    async def _run_worker(self) -> None:
        while True:
            job = await self.ready.get()
            if await self._stage(job, Stage.run, self._do_run):
                await self._eval_send.send(job)

    async def _eval_worker(self, recv: trio.MemoryReceiveChannel[Job]) -> None:
        async with recv:
            async for job in recv:
                if await self._stage(job, Stage.eval, self._do_eval):
                    await self._conclude(job, Status.completed)

    async def _stage(self, job: Job, stage: Stage, work: Callable[[Job], Awaitable[None]]) -> bool:
        """Run one stage of a job; True if the job goes on to the next stage."""
        if job.done.is_set():
            await self._release(job)
            return False
        if job.cancel_requested:
            await self._conclude(job, Status.cancelled, stage=stage, etype="cancelled",
                                 message=f"cancelled before {stage.value}")
            return False
        stats = self.stats[stage]
        if stage is Stage.run:  # its first agent step: from here on it is never moved
            log.info("rollout %s started on %s", job.id, job.trajectory.node_id,
                     extra=_ids(job, stage=stage.value))
        job.set_stage(Status(stage.value))
        stats.in_flight += 1
        start = trio.current_time()
        setattr(job.trajectory.timing, f"{stage.value}_start_s", round(start - job.submitted_at, 6))
        job.budget.resume()
        outcome: tuple[Status, str, str] | None = None
        try:
            with trio.CancelScope() as scope:
                job.stage_scope = scope
                with trio.fail_after(max(job.budget.remaining(), 1e-9)):
                    await work(job)
            if scope.cancelled_caught:
                outcome = (Status.cancelled, "cancelled", f"cancelled during {stage.value}")
        except trio.TooSlowError:
            outcome = (Status.timed_out, "timeout",
                       f"timeout_s={job.budget.total_s:g} spent during {stage.value}")
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await self._conclude(job, Status.cancelled, stage=stage, etype="cancelled",
                                     message="the daemon stopped")
            raise
        except Exception as exc:
            exc = _leaf(exc)  # NoBackend raised inside the toolbox's nursery, not "ExceptionGroup"
            log.warning("job %s failed in %s: %r", job.id, stage.value, exc,
                        exc_info=log.isEnabledFor(logging.DEBUG),
                        extra=_ids(job, stage=stage.value, error_type=type(exc).__name__))
            etype = type(exc).__name__
            if isinstance(exc, TaskFailure):  # the handler names it and keeps what it found
                etype = exc.error_type
                job.trajectory.reward_info = dict(exc.info)
            outcome = (Status.failed, etype, str(exc) or repr(exc))
        finally:
            job.budget.pause()
            job.stage_scope = None
            duration = trio.current_time() - start
            setattr(job.trajectory.timing, f"{stage.value}_s", duration)
            stats.in_flight -= 1
            stats.record(duration, ok=outcome is None)
        if outcome is None:
            return True
        status, etype, message = outcome
        if stage is Stage.run and job.trajectory.finish_reason is None:
            job.trajectory.finish_reason = status.value
        usable = False
        if status is Status.timed_out and stage is Stage.run:
            # A trajectory cut by its deadline is consistent up to its last turn: a trainer
            # may train on it with reward 0.
            usable = bool(job.trajectory.turns)
            job.trajectory.reward = 0.0
            job.trajectory.reward_info = {"reason": "timed_out"}
        await self._conclude(job, status, stage=stage, etype=etype, message=message, usable=usable)
        return False

    # ---- stage bodies --------------------------------------------------------------

    async def _do_init(self, job: Job) -> None:
        handler = job.request.handler
        spec = handler.sandbox_spec(job.request.task)
        agent = _agent_of(job)
        if agent is not None:
            from rolloutd.sandbox import Bind, SandboxSpec

            spec = spec if spec is not None else SandboxSpec()  # a harness always needs one
            if agent.install is not None:
                from rolloutd.daemon.harness import WHEELS_DIR

                bind = Bind(host=agent.install.wheels, dest=WHEELS_DIR, readonly=True)
                spec = spec.model_copy(update={"binds": [*spec.binds, bind]})
        if spec is not None:
            job.sandbox = await self._open_sandbox(spec, job)
        await handler.setup(job.sandbox, job.request.task)
        if agent is not None and agent.install is not None:
            from rolloutd.daemon.harness import install_agent

            assert job.sandbox is not None
            await install_agent(job.sandbox, agent.install)

    async def _do_run(self, job: Job) -> None:
        handler = job.request.handler
        task = job.request.task
        if handler.custom_run:
            job.final_answer = await handler.run(task, job.trajectory, job.sandbox)
            return
        agent = _agent_of(job)
        if agent is not None:
            await self._run_harness(job, agent)
            return
        from rolloutd.daemon.agent import AgentLimits, run_agent
        from rolloutd.daemon.llm.base import SamplingParams
        from rolloutd.daemon.replay import ReplayPool, compare
        from rolloutd.tools import open_toolbox

        original = job.request.replay_of
        pool: Any = self.services.pool if original is None else ReplayPool(original)
        renderer_factory = self.services.renderer
        if pool is None or renderer_factory is None:
            raise PipelineError("no LLM backend pool is configured")
        renderer = await renderer_factory()
        prompt = handler.prompt(task)
        try:
            async with open_toolbox(job.sandbox, prompt.tools) as toolbox:
                job.final_answer = await run_agent(
                    trajectory=job.trajectory,
                    prompt=prompt,
                    pool=pool,
                    renderer=renderer,
                    toolbox=toolbox,
                    params=job.request.sampling or SamplingParams(),
                    limits=AgentLimits(**(job.request.limits or {})),
                    sticky_key=job.id,
                    group_key=job.group_id,
                    origin=job.submitted_at,
                )
        finally:
            pool.forget(job.id)
            if original is not None:
                job.trajectory.replay = compare(job.trajectory, original)

    async def _run_harness(self, job: Job, agent: AgentSpec) -> None:
        """RUN of a task with ``agent``: the harness in the sandbox, its calls recorded."""
        from rolloutd.daemon.agent import AgentLimits
        from rolloutd.daemon.harness import Session, run_harness
        from rolloutd.daemon.llm.base import SamplingParams
        from rolloutd.daemon.replay import ReplayPool, compare

        original = job.request.replay_of
        pool: Any = self.services.pool if original is None else ReplayPool(original)
        renderer_factory = self.services.renderer
        if pool is None or renderer_factory is None:
            raise PipelineError("no LLM backend pool is configured")
        assert job.sandbox is not None
        session = Session(
            trajectory=job.trajectory, pool=pool, renderer=await renderer_factory(),
            params=job.request.sampling or SamplingParams(),
            limits=AgentLimits(**(job.request.limits or {})), sticky_key=job.id,
            group_key=job.group_id, origin=job.submitted_at)
        prompt = job.request.handler.prompt(job.request.task)
        try:
            await run_harness(job.sandbox, agent, session, [dict(m) for m in prompt.messages])
        finally:
            pool.forget(job.id)
            session.close()
            if original is not None:
                job.trajectory.replay = compare(job.trajectory, original)
            job.final_answer = session.final_text
            info = job.trajectory.harness
            if info is not None and info.ended in ("exited", "timeout"):
                job.trajectory.finish_reason = "agent_exit" if info.ended == "exited" else "agent_timeout"

    async def _do_eval(self, job: Job) -> None:
        ctx = EvalContext(
            sandbox=job.sandbox,
            open_sandbox=lambda spec: self._scoped_sandbox(spec, job),
            final_answer=job.final_answer,
            options={"swe_grader": self.settings.swe_grader},
        )
        reward = await job.request.handler.evaluate(job.request.task, job.trajectory, ctx)
        job.trajectory.reward = float(reward.reward)
        job.trajectory.reward_info = dict(reward.info)

    # ---- sandboxes ------------------------------------------------------------------

    async def _open_sandbox(self, spec: SandboxSpec, job: Job) -> Sandbox:
        supervisor = self.services.supervisor
        if supervisor is None:
            raise PipelineError("this daemon has no sandbox supervisor")
        lifetime_s = job.budget.remaining() + self.settings.sandbox_lifetime_buffer_s
        image = job.request.task.get("image")
        if spec.image is None and isinstance(image, str) and image:
            # any sandboxed task may name an image: its sandboxes (evaluation's too) run in it
            spec = spec.model_copy(update={"image": image})
        sb = await supervisor.open(self.complete_spec(spec, lifetime_s=lifetime_s))
        log.debug("job %s opened sandbox %s", job.id, sb.id, extra=_ids(job, sandbox_id=sb.id))
        return sb

    def complete_spec(self, spec: SandboxSpec, *, lifetime_s: float) -> SandboxSpec:
        """A task's spec with the settings' limits (and ``lifetime_s``) where it names none."""
        update: dict[str, Any] = {
            key: value for key, value in self.sandbox_defaults().items() if getattr(spec, key) is None
        }
        if spec.memory_mb is not None:  # the daemon's /tmp size fits its own memory default only
            update.pop("tmpfs_mb", None)
        if spec.lifetime_s is None:
            update["lifetime_s"] = lifetime_s
        return spec.model_copy(update=update)

    def sandbox_defaults(self) -> dict[str, Any]:
        """Limits a sandbox gets when its task names none (from the settings)."""
        s = self.settings
        return {"memory_mb": s.sandbox_memory_mb, "pids_max": s.sandbox_pids_max,
                "cpu_cores": s.sandbox_cpu_cores, "disk_mb": s.sandbox_disk_mb,
                "tmpfs_mb": s.sandbox_tmpfs_mb}

    @asynccontextmanager
    async def _scoped_sandbox(self, spec: SandboxSpec, job: Job) -> AsyncIterator[Sandbox]:
        sb = await self._open_sandbox(spec, job)
        try:
            yield sb
        finally:
            with trio.move_on_after(RELEASE_TIMEOUT_S, shield=True):
                assert self.services.supervisor is not None
                await self.services.supervisor.release(sb)

    async def _release(self, job: Job) -> None:
        sb, job.sandbox = job.sandbox, None
        if sb is None or self.services.supervisor is None:
            return
        with trio.move_on_after(RELEASE_TIMEOUT_S, shield=True):
            try:
                await self.services.supervisor.release(sb)
            except Exception:
                log.exception("job %s: releasing sandbox %s failed", job.id, sb.id,
                              extra=_ids(job, sandbox_id=sb.id))

    # ---- bookkeeping ----------------------------------------------------------------

    def _track(self, job: Job) -> None:
        self._live.add(job)
        self._held_changed()
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        job.add_listener(self._untrack)

    def _untrack(self, job: Job) -> None:
        if job in self._live:
            if job.status is not Status.cancelled:  # it ran here (a cancel says nothing of speed)
                self.throughput.finished()
            self._live.discard(job)
            self._held_changed()
        self._away.discard(job)
        if not self._live and not self._away:
            self._idle.set()

    def _held_changed(self) -> None:
        self.throughput.held(len(self._live), self.slots)
        self._room_changed()

    def _room_changed(self) -> None:
        if self._room and self.has_room():
            self._room.unpark_all()

    async def _conclude(self, job: Job, status: Status, **details: Any) -> None:
        """Release what the job holds (bounded), then publish its terminal status: a trainer
        that sees a result can count on its sandbox being gone."""
        sandbox_id = job.sandbox.id if job.sandbox is not None else None
        await self._release(job)
        self._finish(job, status, sandbox_id=sandbox_id, **details)

    def _finish(
        self,
        job: Job,
        status: Status,
        *,
        stage: Stage | None = None,
        etype: str = "",
        message: str = "",
        usable: bool | None = None,
        sandbox_id: str | None = None,
    ) -> None:
        error = None
        if status is not Status.completed:
            error = ErrorInfo(stage=(stage or Stage.queue).value, type=etype, message=message)
        timing = job.trajectory.timing
        if job.finish(status, error=error, usable=usable):
            worked = timing.init_s + timing.run_s + timing.eval_s
            timing.queue_s = max(0.0, timing.total_s - worked)
            # One line per finished rollout, with the ids an operator greps for.
            log.info("rollout %s %s", job.id, status.value, extra=_ids(
                job, sandbox_id=sandbox_id, status=status.value, reward=job.trajectory.reward,
                error_type=error.type if error else None, stage=error.stage if error else None,
                total_s=round(timing.total_s, 3)))


def _agent_of(job: Job) -> AgentSpec | None:
    """The task's ``agent`` (validated at submit), or None for the built-in loop."""
    raw = job.request.task.get("agent")
    if raw is None:
        return None
    from rolloutd.daemon.harness import AgentSpec

    return AgentSpec.model_validate(raw)


def _leaf(exc: Exception) -> Exception:
    """The one exception inside (nested) single-member exception groups, else ``exc``."""
    while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _ids(job: Job, **fields: Any) -> dict[str, Any]:
    """Structured fields of a log record about ``job`` (daemon/logs.py prints them)."""
    sb = job.sandbox
    out: dict[str, Any] = {"job_id": job.id, "group_id": job.group_id,
                           "sandbox_id": sb.id if sb is not None else None}
    out.update((k, v) for k, v in fields.items() if v is not None)
    return {k: v for k, v in out.items() if v is not None}


def _stage_of(job: Job) -> Stage:
    try:
        return Stage(job.status.value)
    except ValueError:
        return Stage.queue
