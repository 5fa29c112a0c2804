"""A rollout job: its state machine, its pausable deadline, and the store of results.

A job is one sample of one task. Its ``Budget`` counts only time spent working in a stage
(INIT, RUN, EVAL); time waiting in a queue or for the next stage's capacity does not count.
A job reaches exactly one terminal status, once; ``finish`` is idempotent, so a cancel that
races a worker cannot produce two outcomes. A finished job lets go of its request (the task,
which may be megabytes) and keeps only its trajectory, so what the result store holds per
finished result does not grow with the size of the task.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rolloutd.daemon.errors import DaemonError
from rolloutd.daemon.replay import ReplaySource, keep_for_replay
from rolloutd.daemon.trajectory import ErrorInfo, ReplayInfo, Stage, Status, Trajectory

if TYPE_CHECKING:
    from rolloutd.daemon.llm.base import SamplingParams
    from rolloutd.daemon.tasks.base import TaskHandler
    from rolloutd.sandbox import Sandbox


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


class Budget:
    """A deadline that only runs while a stage works on the job."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self._spent = 0.0
        self._since: float | None = None

    def resume(self) -> None:
        if self._since is None:
            self._since = trio.current_time()

    def pause(self) -> None:
        if self._since is not None:
            self._spent += trio.current_time() - self._since
            self._since = None

    @property
    def spent(self) -> float:
        running = trio.current_time() - self._since if self._since is not None else 0.0
        return self._spent + running

    def remaining(self) -> float:
        return max(0.0, self.total_s - self.spent)


@dataclass
class JobRequest:
    """What was asked for one sample: the task and how to run it."""

    task: dict[str, Any]
    handler: TaskHandler
    timeout_s: float
    sampling: SamplingParams | None = None
    limits: dict[str, Any] | None = None
    priority: int = 0
    labels: list[str] = field(default_factory=list)
    batch_id: str | None = None
    #: A replay: the finished rollout whose sampled turns are fed back (daemon/replay.py).
    replay_of: Trajectory | None = None


class JobFinished(DaemonError, RuntimeError):
    """A finished job's request was read: it is released when the job finishes."""


class Job:
    """One rollout in flight or finished."""

    def __init__(self, request: JobRequest, *, job_id: str, group_id: str, sample_index: int) -> None:
        self.id = job_id
        self._request: JobRequest | None = request
        self.priority = request.priority
        #: The task's kind (kept after the request is released, for listings).
        kind = request.task.get("kind") or getattr(request.handler, "kind", None)
        self.kind: str | None = str(kind) if kind is not None else None
        self.budget = Budget(request.timeout_s)
        self.trajectory = Trajectory(
            id=job_id,
            group_id=group_id,
            batch_id=request.batch_id,
            task_id=str(request.task.get("id")) if request.task.get("id") is not None else None,
            sample_index=sample_index,
            labels=list(request.labels),
        )
        self.sandbox: Sandbox | None = None
        self.final_answer: str | None = None
        #: What a replay of this finished rollout needs (daemon/replay.py); set on finish.
        self.replay_source: ReplaySource | None = None
        if request.replay_of is not None:
            self.trajectory.replay = ReplayInfo(of=request.replay_of.id)
        self.cancel_requested = False
        self.stage_scope: trio.CancelScope | None = None
        #: Work stealing: the peer this queued job was handed over to (it runs there, and this
        #: job ends with the peer's trajectory), and the peer a job taken over here came from.
        self.moved_to: str | None = None
        self.adopted_from: str | None = None
        #: The member that forwarded this job here (it never steals the job back).
        self.forwarded_from: str | None = None
        #: Called by ``cancel`` while the job runs elsewhere (the hand-over relays it).
        self.on_cancel: Callable[[], None] | None = None
        self.done = trio.Event()
        self.submitted_at = trio.current_time()
        self.finished_at: float | None = None
        self._listeners: list[Callable[[Job], None]] = []

    @property
    def request(self) -> JobRequest:
        """What was asked for; only while the job is not finished (``finish`` releases it)."""
        if self._request is None:
            raise JobFinished(f"job {self.id} is finished; its request was released")
        return self._request

    @property
    def status(self) -> Status:
        return self.trajectory.status

    @property
    def group_id(self) -> str:
        return self.trajectory.group_id or self.id

    def add_listener(self, fn: Callable[[Job], None]) -> None:
        """Call ``fn(job)`` once the job is terminal (at once if it already is)."""
        if self.done.is_set():
            fn(self)
        else:
            self._listeners.append(fn)

    def set_stage(self, status: Status) -> None:
        self.trajectory.status = status

    def finish(
        self,
        status: Status,
        *,
        error: ErrorInfo | None = None,
        usable: bool | None = None,
    ) -> bool:
        """Move to a terminal status. Returns False (and changes nothing) if already terminal."""
        if self.done.is_set():
            return False
        traj = self.trajectory
        traj.status = status
        if error is not None:
            traj.error = error
        if usable is None:
            usable = status is Status.completed
        traj.usable = usable
        self.finished_at = trio.current_time()
        traj.timing.total_s = self.finished_at - self.submitted_at
        # The result store keeps finished jobs for result_ttl_s: only the trajectory stays
        # (and a small task, for a replay).
        if self._request is not None:
            req = self._request
            self.replay_source = keep_for_replay(
                ReplaySource(req.task, req.sampling, req.limits, req.timeout_s), traj
            )
        self._request = None
        self.final_answer = None
        self.done.set()
        listeners, self._listeners = self._listeners, []
        for fn in listeners:
            fn(self)
        return True

    def cancel(self) -> None:
        """Ask for cancellation; the owner of the current stage finishes the job."""
        self.cancel_requested = True
        if self.stage_scope is not None:
            self.stage_scope.cancel()
        if self.on_cancel is not None:
            self.on_cancel()

    def summary(self) -> dict[str, Any]:
        t = self.trajectory
        return {
            "id": t.id,
            "group_id": t.group_id,
            "task_id": t.task_id,
            "status": t.status.value,
            "usable": t.usable,
            "reward": t.reward,
            "error": t.error.model_dump() if t.error else None,
        }

    def listing(self) -> RolloutSummary:
        """What a rollout listing shows of the job (``GET /v1/rollouts``)."""
        t = self.trajectory
        total_s = t.timing.total_s if self.done.is_set() else trio.current_time() - self.submitted_at
        return RolloutSummary(
            id=t.id,
            group_id=t.group_id,
            batch_id=t.batch_id,
            sample_index=t.sample_index,
            status=t.status,
            usable=t.usable,
            reward=t.reward,
            kind=self.kind,
            labels=list(t.labels),
            turns=len(t.turns),
            sampled_tokens=sum(t.loss_mask),
            total_s=round(total_s, 6),
            error_type=t.error.type if t.error else None,
        )


class RolloutSummary(BaseModel):
    """One rollout of a listing: enough to choose which to open."""

    id: str
    group_id: str | None
    batch_id: str | None = Field(description="The batch it was sampled for (null: submitted alone).")
    sample_index: int
    status: Status
    usable: bool
    reward: float | None
    kind: str | None = Field(description="The task's kind.")
    labels: list[str]
    turns: int = Field(description="LLM calls so far.")
    sampled_tokens: int = Field(description="Tokens the model sampled (the loss mask's ones).")
    total_s: float = Field(description="Seconds since submitted (`timing.total_s` once finished).")
    error_type: str | None = Field(description="`error.type` of a failed rollout.")


#: The most ids one listing may name (``RolloutFilter.ids``): a page's most rollouts.
MAX_FILTER_IDS = 500


class RolloutFilter(BaseModel):
    """Which held jobs a listing selects: every condition given holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: Status | None = None
    group_id: str | None = Field(None, min_length=1, max_length=200)
    batch_id: str | None = Field(None, min_length=1, max_length=200,
                                 description="The batch (`POST /v1/batches`) the rollouts were sampled for.")
    label: str | None = Field(None, min_length=1, max_length=200)
    kind: str | None = Field(None, min_length=1, max_length=200, description="The task's kind.")
    min_reward: float | None = Field(None, allow_inf_nan=False)
    max_reward: float | None = Field(None, allow_inf_nan=False)
    id_prefix: str | None = Field(None, min_length=1, max_length=200)
    ids: str | None = Field(None, min_length=1, max_length=MAX_FILTER_IDS * 64, pattern=r"^[^,]+(,[^,]+)*$",
                            description=f"Only these rollouts: ids, comma-separated (at most {MAX_FILTER_IDS}). "
                            "An id this daemon does not hold is left out.")

    @field_validator("ids")
    @classmethod
    def _few_ids(cls, value: str | None) -> str | None:
        if value is not None and value.count(",") >= MAX_FILTER_IDS:
            raise ValueError(f"at most {MAX_FILTER_IDS} ids")
        return value

    @functools.cached_property
    def wanted(self) -> dict[str, None] | None:
        """The ``ids`` asked for, each once, in the order given (None: every id); a dict, so
        that ``__call__`` tests an id in constant time."""
        return None if self.ids is None else dict.fromkeys(self.ids.split(","))

    def __call__(self, job: Job) -> bool:
        t = job.trajectory
        if self.wanted is not None and job.id not in self.wanted:
            return False
        if self.status is not None and t.status is not self.status:
            return False
        if self.group_id is not None and job.group_id != self.group_id:
            return False
        if self.batch_id is not None and t.batch_id != self.batch_id:
            return False
        if self.label is not None and self.label not in t.labels:
            return False
        if self.kind is not None and job.kind != self.kind:
            return False
        if self.id_prefix is not None and not job.id.startswith(self.id_prefix):
            return False
        if self.min_reward is not None or self.max_reward is not None:
            if t.reward is None:
                return False
            if self.min_reward is not None and t.reward < self.min_reward:
                return False
            if self.max_reward is not None and t.reward > self.max_reward:
                return False
        return True


class QueueFull(DaemonError):
    """The intake queue has no room; the API answers 429."""


class QueueClosed(DaemonError):
    """The intake queue no longer accepts jobs (the daemon is draining)."""


class JobQueue:
    """A bounded priority queue of jobs (higher priority first, FIFO within a priority).

    Unlike a memory channel it lets a queued job be withdrawn when it is cancelled, so a
    cancelled job never holds a slot.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._heap: list[tuple[int, int, Job]] = []
        self._counter = itertools.count()
        self._closed = False
        self._lot = trio.lowlevel.ParkingLot()
        self._room = trio.lowlevel.ParkingLot()  # wait_at_most's waiters

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def free(self) -> int:
        return max(0, self.capacity - len(self._heap))

    @property
    def closed(self) -> bool:
        return self._closed

    def put_many_nowait(self, jobs: list[Job]) -> None:
        """All or nothing: either every job is queued or QueueFull/QueueClosed is raised."""
        if self._closed:
            raise QueueClosed
        if len(self._heap) + len(jobs) > self.capacity:
            raise QueueFull
        for job in jobs:
            heapq.heappush(self._heap, (-job.priority, next(self._counter), job))
        self._lot.unpark(count=len(jobs))

    def remove(self, job: Job) -> bool:
        """Withdraw a queued job (it no longer holds a slot or a reference). Returns True if it
        was still queued."""
        for i, (_, _, queued) in enumerate(self._heap):
            if queued is job:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                self._room.unpark_all()
                return True
        return False

    def take_last(self, n: int, eligible: Callable[[Job], bool]) -> list[Job]:
        """Withdraw up to ``n`` eligible jobs from the far end (lowest priority, newest first):
        the ones that would start last here, for a peer to run (work stealing)."""
        order = sorted(self._heap, reverse=True)
        taken = [job for _, _, job in order if eligible(job)][:n]
        if taken:
            ids = {id(job) for job in taken}
            self._heap = [entry for entry in self._heap if id(entry[2]) not in ids]
            heapq.heapify(self._heap)
            self._room.unpark_all()
        return taken

    def put_back(self, jobs: list[Job]) -> None:
        """Queue again jobs that ``take_last`` withdrew (the peer did not take them); their
        slots were theirs, so the capacity is not checked. Raises QueueClosed when draining."""
        if self._closed:
            raise QueueClosed
        for job in jobs:
            heapq.heappush(self._heap, (-job.priority, next(self._counter), job))
        self._lot.unpark(count=len(jobs))

    def close(self) -> None:
        self._closed = True
        self._lot.unpark_all()

    def drain_nowait(self) -> list[Job]:
        """Take every queued job out (used when the daemon drains)."""
        jobs = [j for _, _, j in sorted(self._heap)]
        self._heap.clear()
        self._room.unpark_all()
        return jobs

    async def get(self) -> Job:
        """The next job; raises trio.EndOfChannel once closed and empty."""
        while True:
            if self._heap:
                _, _, job = heapq.heappop(self._heap)
                self._room.unpark_all()
                await trio.lowlevel.checkpoint()
                return job
            if self._closed:
                raise trio.EndOfChannel
            await self._lot.park()

    async def wait_at_most(self, n: int) -> None:
        """Return once at most ``n`` jobs are queued (a producer's back-pressure)."""
        while len(self._heap) > n:
            await self._room.park()
        await trio.lowlevel.checkpoint()


class ResultStore:
    """Every job the daemon knows, finished ones kept until their TTL or the size bound."""

    def __init__(self, *, ttl_s: float, max_results: int) -> None:
        self.ttl_s = ttl_s
        self.max_results = max_results
        self._jobs: dict[str, Job] = {}
        self._finished: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self._jobs.values()))

    def add(self, job: Job) -> None:
        self._jobs[job.id] = job
        job.add_listener(self._on_finished)

    def get(self, job_id: str) -> Job | None:
        self.expire()
        return self._jobs.get(job_id)

    def _on_finished(self, job: Job) -> None:
        self._finished[job.id] = trio.current_time()
        self.expire()

    def expire(self) -> None:
        now = trio.current_time()
        while self._finished:
            job_id, at = next(iter(self._finished.items()))
            if now - at < self.ttl_s and len(self._finished) <= self.max_results:
                break
            self._finished.popitem(last=False)
            self._jobs.pop(job_id, None)

    def select(self, match: RolloutFilter, *, limit: int, offset: int = 0) -> tuple[list[Job], int]:
        """The held jobs ``match`` selects, newest submitted first: ``limit`` of them from
        ``offset``, and how many match in all. Only what this store holds (its TTL and size
        bound), not the journal."""
        self.expire()
        page: list[Job] = []
        total = 0
        wanted = match.wanted
        held: Iterable[Job] = reversed(self._jobs.values())
        if wanted is not None:  # a few named ones: looked up, not found by a scan of the store
            named = [job for job in map(self._jobs.get, wanted) if job is not None]
            held = sorted(named, key=lambda job: job.submitted_at, reverse=True)
        for job in held:
            if match(job):
                if offset <= total < offset + limit:
                    page.append(job)
                total += 1
        return page, total

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for job in self._jobs.values():
            out[job.status.value] = out.get(job.status.value, 0) + 1
        return out


def percentiles(durations: Iterable[float], qs: Iterable[int]) -> dict[str, float | None]:
    """``{"p50_s": ...}`` for each percentile in ``qs`` (nearest rank; None without data): the
    stages' and the tools' (``rolloutd.daemon.metrics.ToolLatency``) one definition."""
    data = sorted(durations)
    out: dict[str, float | None] = {}
    for q in qs:
        out[f"p{q}_s"] = data[min(len(data) - 1, math.ceil(q / 100 * len(data)) - 1)] if data else None
    return out


class StageStats:
    """Counters and recent durations of one pipeline stage."""

    WINDOW = 2048

    def __init__(self, name: Stage, workers: int) -> None:
        self.name = name
        self.workers = workers
        self.in_flight = 0
        self.finished = 0
        self.failed = 0
        self._durations: list[float] = []

    def record(self, duration_s: float, *, ok: bool) -> None:
        self.finished += 1
        if not ok:
            self.failed += 1
        self._durations.append(duration_s)
        if len(self._durations) > self.WINDOW:
            del self._durations[: len(self._durations) - self.WINDOW]

    def percentiles(self) -> dict[str, float | None]:
        return percentiles(self._durations, (50, 95, 99))

    def snapshot(self, queued: int) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "queued": queued,
            "in_flight": self.in_flight,
            "free": max(0, self.workers - self.in_flight),
            "finished": self.finished,
            "failed": self.failed,
            **self.percentiles(),
        }
