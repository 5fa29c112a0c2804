"""Rollout submission, lookup, cancellation and streaming: what the API routes call."""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from rolloutd.daemon.agent import AgentLimits
from rolloutd.daemon.config import Settings
from rolloutd.daemon.errors import (
    Draining,
    IdempotencyConflict,
    InvalidTask,
    NotFound,
    NotReplayable,
    QueueFullError,
)
from rolloutd.daemon.jobs import Job, JobRequest, QueueClosed, QueueFull, ResultStore, new_id
from rolloutd.daemon.llm.base import SamplingParams
from rolloutd.daemon.pipeline import Pipeline
from rolloutd.daemon.replay import LABEL as REPLAY_LABEL
from rolloutd.daemon.replay import check_replayable
from rolloutd.daemon.tasks.base import TaskError
from rolloutd.daemon.tasks.registry import TaskRegistry
from rolloutd.daemon.trajectory import Stage, Trajectory


class RolloutRequest(BaseModel):
    """One task, ``n`` samples of it (a group)."""

    model_config = ConfigDict(extra="forbid")

    task: dict[str, Any] = Field(description="The task; `kind` selects its handler.")
    n: int = Field(1, ge=1, description="Samples of the task (a GRPO group).")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    limits: AgentLimits = Field(default_factory=AgentLimits)
    timeout_s: float | None = Field(None, gt=0, description="Work budget per sample; queue time excluded.")
    group_id: str | None = Field(None, min_length=1, max_length=200)
    priority: int = Field(0, ge=-1000, le=1000)
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)
    wait: bool = Field(False, description="Answer with the finished trajectories.")
    labels: list[str] = Field(default_factory=list, max_length=32)


#: A rollout's id as a peer hands it over (the form ``new_id`` makes).
SampleId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")]


class QueuedSample(BaseModel):
    """One queued sample as it moves to a federation peer (work stealing): all it needs to
    run there under the same id. ``timeout_s`` is what is left of its budget (an INIT that
    ran here before the hand-over spent some)."""

    model_config = ConfigDict(extra="forbid")

    id: SampleId
    group_id: str = Field(min_length=1, max_length=200)
    sample_index: int = Field(ge=0)
    batch_id: str | None = Field(None, max_length=200)
    task: dict[str, Any]
    sampling: SamplingParams | None = None
    limits: dict[str, Any] | None = None
    timeout_s: float = Field(gt=0)
    priority: int = Field(0, ge=-1000, le=1000)
    labels: list[str] = Field(default_factory=list, max_length=64)

    @classmethod
    def of(cls, job: Job) -> QueuedSample:
        req = job.request
        t = job.trajectory
        return cls(id=job.id, group_id=job.group_id, sample_index=t.sample_index,
                   batch_id=req.batch_id, task=req.task, sampling=req.sampling, limits=req.limits,
                   timeout_s=min(req.timeout_s, max(job.budget.remaining(), 0.001)),
                   priority=req.priority, labels=list(req.labels))


@dataclass
class Submitted:
    group_id: str
    jobs: list[Job]
    replayed: bool = False


class RolloutService:
    """Turns requests into jobs on the pipeline, and answers for them afterwards."""

    IDEMPOTENCY_KEYS = 100_000

    def __init__(self, settings: Settings, pipeline: Pipeline, registry: TaskRegistry, *,
                 node_id: str | None = None) -> None:
        self.settings = settings
        #: Stamped on every trajectory this daemon runs (``Trajectory.node_id``).
        self.node_id = node_id
        self.pipeline = pipeline
        self.registry = registry
        self.store = ResultStore(ttl_s=settings.result_ttl_s, max_results=settings.max_results)
        self._idempotency: OrderedDict[str, tuple[str, str, list[str]]] = OrderedDict()
        self.draining = False
        self.submitted_total = 0

    # ---- submit -------------------------------------------------------------------

    def submit(self, req: RolloutRequest, *, batch_id: str | None = None,
               replay_of: Trajectory | None = None, ids: list[str] | None = None) -> Submitted:
        """Turn ``req`` into jobs on the pipeline; ``batch_id``: the batch they are sampled for
        (the sampler's, never a client's: it is no field of the request); ``replay_of``: a
        replay of that finished rollout; ``ids``: the samples' ids, chosen by the federation
        peer that forwarded the request (one per sample, none in use here)."""
        if self.draining:
            raise Draining("the daemon is draining and takes no new rollouts", retry_after_s=5)
        self.check_group_size("n", req.n)
        digest = ""
        if req.idempotency_key is not None:
            digest = _digest(req)
            seen = self._idempotency.get(req.idempotency_key)
            if seen is not None:
                if seen[0] != digest:
                    raise IdempotencyConflict(
                        f"idempotency_key {req.idempotency_key!r} was used with another request body"
                    )
                jobs = [j for j in (self.store.get(i) for i in seen[2]) if j is not None]
                if len(jobs) == len(seen[2]):
                    return Submitted(seen[1], jobs, replayed=True)
        if ids is not None:
            self._check_ids(ids, req.n)
        try:
            handler = self.registry.get(req.task.get("kind"))
            task = self.registry.validate(req.task)
        except TaskError as exc:
            raise InvalidTask(str(exc)) from None
        timeout_s = req.timeout_s or self.settings.default_timeout_s
        if timeout_s > self.settings.max_timeout_s:
            raise InvalidTask(f"timeout_s={timeout_s:g} exceeds max_timeout_s={self.settings.max_timeout_s:g}")
        group_id = req.group_id or new_id("g")
        labels = list(req.labels)
        label = getattr(handler, "label", None)
        if isinstance(label, str):
            labels.append(label)
        request = JobRequest(
            task=task,
            handler=handler,
            timeout_s=timeout_s,
            sampling=req.sampling,
            limits=req.limits.model_dump(),
            priority=req.priority,
            labels=labels,
            batch_id=batch_id,
            replay_of=replay_of,
        )
        ids = ids if ids is not None else [new_id("r") for _ in range(req.n)]
        jobs = [Job(request, job_id=job_id, group_id=group_id, sample_index=i)
                for i, job_id in enumerate(ids)]
        try:
            self.pipeline.submit(jobs)
        except QueueFull:
            raise QueueFullError(
                f"the intake queue is full ({self.pipeline.intake.capacity} jobs); retry later",
                retry_after_s=self._retry_after(),
            ) from None
        except QueueClosed:
            raise Draining("the daemon is draining and takes no new rollouts", retry_after_s=5) from None
        for job in jobs:
            job.trajectory.node_id = self.node_id
            self.store.add(job)
        self.submitted_total += len(jobs)
        if req.idempotency_key is not None:
            self._idempotency[req.idempotency_key] = (digest, group_id, [j.id for j in jobs])
            while len(self._idempotency) > self.IDEMPOTENCY_KEYS:
                self._idempotency.popitem(last=False)
        return Submitted(group_id, jobs)

    def _check_ids(self, ids: list[str], n: int) -> None:
        if len(ids) != n:
            raise InvalidTask(f"{len(ids)} rollout ids were given for n={n} samples")
        taken = next((i for i in ids if self.store.get(i) is not None), None)
        if taken is not None:
            raise IdempotencyConflict(f"rollout id {taken!r} is already in use here")

    def adopt(self, samples: list[QueuedSample], *, origin: str) -> tuple[list[Job], list[str], dict[str, str]]:
        """Take over queued samples from peer ``origin`` (work stealing), under their ids.

        Returns the jobs newly queued here, the ids of every sample accepted, and for each
        sample refused, why (draining, queue full, a task this daemon cannot run). A sample
        already taken over here (a retried hand-over) is accepted again, not queued twice."""
        jobs: list[Job] = []
        accepted: list[str] = []
        refused: dict[str, str] = {}
        for sample in samples:
            known = self.store.get(sample.id)
            if known is not None:
                if known.adopted_from == origin:
                    accepted.append(sample.id)
                else:
                    refused[sample.id] = "the id is in use here"
                continue
            if self.draining:
                refused[sample.id] = "draining"
                continue
            try:
                handler = self.registry.get(sample.task.get("kind"))
                task = self.registry.validate(sample.task)
            except TaskError as exc:
                refused[sample.id] = f"invalid task: {exc}"
                continue
            request = JobRequest(task=task, handler=handler, timeout_s=sample.timeout_s,
                                 sampling=sample.sampling, limits=sample.limits,
                                 priority=sample.priority, labels=list(sample.labels),
                                 batch_id=sample.batch_id)
            job = Job(request, job_id=sample.id, group_id=sample.group_id,
                      sample_index=sample.sample_index)
            job.adopted_from = origin
            job.trajectory.node_id = self.node_id
            try:
                self.pipeline.submit([job])
            except (QueueFull, QueueClosed) as exc:
                refused[sample.id] = "queue full" if isinstance(exc, QueueFull) else "draining"
                continue
            self.store.add(job)
            self.submitted_total += 1
            jobs.append(job)
            accepted.append(job.id)
        return jobs, accepted, refused

    @property
    def max_group_size(self) -> int:
        """The largest group a request may ask for: ``max_samples_per_request``, and the whole
        intake queue (a group is queued all or nothing, so a larger one never fits)."""
        return min(self.settings.max_samples_per_request, self.pipeline.intake.capacity)

    def check_group_size(self, field: str, n: int) -> None:
        """InvalidTask naming the limit when a group of ``n`` can never be taken (not a 429)."""
        if n > self.settings.max_samples_per_request:
            raise InvalidTask(
                f"{field}={n} exceeds max_samples_per_request={self.settings.max_samples_per_request}"
            )
        if n > self.pipeline.intake.capacity:
            raise InvalidTask(f"{field}={n} exceeds queue_size={self.pipeline.intake.capacity}: "
                              "a group is queued whole")

    def withdraw(self, sub: Submitted, idempotency_key: str | None) -> None:
        """Undo a submit whose answer never reached the client (the journal could not record
        it): its jobs are cancelled and its idempotency key forgotten, so a retry starts anew."""
        if sub.replayed:
            return
        for job in sub.jobs:
            self.pipeline.cancel(job)
        if idempotency_key is not None:
            self._idempotency.pop(idempotency_key, None)

    def _retry_after(self) -> float:
        """Seconds until a slot is likely free: the queue drained at the run stage's pace."""
        run = self.pipeline.stats[Stage.run]
        p50 = run.percentiles()["p50_s"] or 1.0
        waves = len(self.pipeline.intake) / max(1, run.workers)
        return float(min(60, max(1, math.ceil(p50 * waves))))

    # ---- lookups --------------------------------------------------------------------

    def get(self, job_id: str) -> Job:
        job = self.store.get(job_id)
        if job is None:
            raise NotFound(f"no rollout with id {job_id!r}")
        return job

    def replay_request(self, job_id: str) -> tuple[RolloutRequest, Trajectory]:
        """The request that replays finished rollout ``job_id``, and its trajectory."""
        job = self.get(job_id)
        source = check_replayable(job.trajectory, job.replay_source, done=job.done.is_set())
        if getattr(self.registry.get(source.task.get("kind")), "custom_run", False):
            raise NotReplayable(f"rollout {job_id}'s task kind runs its own loop, not the agent's: "
                                "it cannot be replayed")
        req = RolloutRequest(
            task=source.task,
            sampling=source.sampling or SamplingParams(),
            limits=AgentLimits(**(source.limits or {})),
            timeout_s=source.timeout_s,
            labels=[REPLAY_LABEL, f"replay-of:{job_id}"],
        )
        return req, job.trajectory

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        self.pipeline.cancel(job)
        return job

    async def wait(self, jobs: list[Job]) -> None:
        for job in jobs:
            await job.done.wait()


def _digest(req: RolloutRequest) -> str:
    body = req.model_dump(mode="json", exclude={"wait", "idempotency_key"})
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
