"""A dynamic-sampling batch: its request, its groups, and how a finished group is judged.

The sampler (``rolloutd.daemon.sampling``) runs batches; this module is what a batch is. A finished
batch lets go of its request (every prompt) and of its groups' tasks (``Batch.release``), so
what it keeps while readable does not grow with the size of its tasks.

A group can outlive its batch: in a ``stream``, the groups still running when a batch is full
carry over to the stream's next batch. Each batch then has its own ``Group`` record of it
(``carried`` in the first, ``carried_from`` in the next); the records share one
``Progress``, which routes the group's completion to whichever batch holds it now.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from enum import StrEnum
from typing import Any, Literal

import trio
from pydantic import BaseModel, ConfigDict, Field

from rolloutd.daemon.agent import AgentLimits
from rolloutd.daemon.errors import DaemonError
from rolloutd.daemon.jobs import Job
from rolloutd.daemon.llm.base import SamplingParams


class BatchEnded(DaemonError, RuntimeError):
    """An ended batch's request was read: it is released when the batch ends."""


# ---- the request -----------------------------------------------------------------------


class GroupFilter(BaseModel):
    """Which finished groups are kept."""

    model_config = ConfigDict(extra="forbid")

    rule: Literal["not_all_equal", "keep_all"] = Field(
        "not_all_equal",
        description="not_all_equal (DAPO): drop a group whose metric is the same for every "
        "sample; keep_all: keep every group whose samples are all usable.",
    )
    metric: str = Field(
        "reward", min_length=1, max_length=200,
        description="`reward`, or a numeric/boolean key of each trajectory's reward_info (e.g. acc).",
    )
    min_std: float = Field(
        0.0, ge=0, description="not_all_equal also drops groups whose metric std is <= this."
    )


class BatchRequest(BaseModel):
    """Dynamic sampling: groups of ``group_size`` samples until ``keep`` groups pass the filter."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[dict[str, Any]] = Field(
        min_length=1, max_length=100_000, description="Tasks, tried in order, one group each."
    )
    group_size: int = Field(ge=1, description="G: samples per group.")
    keep: int = Field(ge=1, description="K: groups to keep.")
    max_in_flight_groups: int | None = Field(
        None, ge=1, le=100_000, description="Groups running at once (default: keep)."
    )
    max_gen_groups: int | None = Field(
        None, ge=1, description="Bound on groups tried (default: every prompt once)."
    )
    filter: GroupFilter = Field(default_factory=GroupFilter)
    max_staleness: int | None = Field(
        None, ge=0,
        description="Drop (reason `stale`) a group any of whose samples began a turn more than "
        "this many policy versions before the version current when the group is judged; "
        "0 keeps only groups sampled entirely on the current version. Default: no bound.",
    )
    stream: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$",
        description="A sampling stream (e.g. one per training run): batches of one stream run one "
        "at a time, and the groups still running when a batch of it has its K (and those that "
        "finished but were not judged) carry over to its next batch instead of being cancelled, "
        "so slow groups are not selected against. Without a stream they are cancelled.",
    )
    carry_over: bool = Field(
        True,
        description="With a stream: pass this batch's leftovers on to the stream's next batch. "
        "False (e.g. a run's last batch): cancel them. Groups carried in are adopted either way.",
    )
    carry_ttl_s: float = Field(
        600.0, gt=0, le=86_400,
        description="How long carried groups wait for the stream's next batch; then they are "
        "cancelled (reason `not_adopted`).",
    )
    cancel_on_disconnect: bool = Field(
        True,
        description="Cancel the batch when the last client streaming its groups disconnects "
        "before it ends. False: it runs on; reconnect with ?start=N.",
    )
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    limits: AgentLimits = Field(default_factory=AgentLimits)
    timeout_s: float | None = Field(None, gt=0, description="Work budget per sample.")
    priority: int = Field(0, ge=-1000, le=1000)
    labels: list[str] = Field(default_factory=list, max_length=30)


# ---- state -----------------------------------------------------------------------------


class BatchState(StrEnum):
    running = "running"
    completed = "completed"  # K groups kept
    exhausted = "exhausted"  # nothing left to try, fewer than K kept
    cancelled = "cancelled"  # DELETE, client disconnect, daemon stop


class GroupState(StrEnum):
    running = "running"
    kept = "kept"
    filtered = "filtered"
    cancelled = "cancelled"
    carried = "carried"  # passed on to the stream's next batch (which judges it)


@dataclass(eq=False)
class Progress:
    """A group's samples still running, and where its completion goes (the batch holding it;
    nowhere while it waits between two batches of a stream)."""

    pending: int
    route: Callable[[], None] | None = None

    def sample_done(self) -> None:
        self.pending -= 1
        if self.pending == 0 and self.route is not None:
            self.route()


@dataclass(eq=False)
class Group:
    """One prompt's G samples."""

    index: int
    group_id: str
    task: dict[str, Any] | None  # None once released (see the module docstring)
    jobs: list[Job]
    state: GroupState = GroupState.running
    reason: str | None = None
    detail: str | None = None
    progress: Progress = field(default_factory=lambda: Progress(0))
    carried_from: str | None = None  # the batch of the stream that started it

    @property
    def rewards(self) -> list[float | None]:
        return [j.trajectory.reward for j in self.jobs]

    @property
    def finished(self) -> bool:
        return self.progress.pending == 0

    def successor(self, holder: str) -> Group:
        """The record of this group in the stream's next batch (same samples, same progress),
        handed on by the batch ``holder``. ``carried_from`` stays the batch that started the
        group, however many batches it is carried through: ``index`` counts in its prompts."""
        return Group(index=self.index, group_id=self.group_id, task=self.task, jobs=self.jobs,
                     progress=self.progress, carried_from=self.carried_from or holder)

    def duration_s(self) -> float:
        """The slowest sample's time from submission to its end."""
        return max((j.trajectory.timing.total_s for j in self.jobs), default=0.0)

    def tokens(self) -> float:
        """Mean sampled (loss-masked) tokens per sample."""
        return statistics.fmean(sum(j.trajectory.loss_mask) for j in self.jobs) if self.jobs else 0.0

    def work_s(self) -> float:
        """Sample-seconds spent (INIT, RUN and EVAL of every sample, queueing excluded)."""
        t = [j.trajectory.timing for j in self.jobs]
        return sum(x.init_s + x.run_s + x.eval_s for x in t)

    def line(self) -> dict[str, Any]:
        """The NDJSON line of a kept group."""
        return {
            "group_id": self.group_id,
            "prompt_index": self.index,
            "task": self.task,
            "rewards": self.rewards,
            "carried_from": self.carried_from,
            "rollouts": [j.trajectory.model_dump(mode="json") for j in self.jobs],
        }

    def summary(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "prompt_index": self.index,
            "state": self.state.value,
            "reason": self.reason,
            "detail": self.detail,
            "rewards": self.rewards,
            "carried_from": self.carried_from,
        }


@dataclass(eq=False)
class Batch:
    id: str
    req: InitVar[BatchRequest]
    max_in_flight: int
    max_gen_groups: int
    state: BatchState = BatchState.running
    stop_reason: str | None = None
    groups: list[Group] = field(default_factory=list)
    kept_groups: list[Group] = field(default_factory=list)
    filtered_reasons: dict[str, int] = field(default_factory=dict)
    cancelled_reasons: dict[str, int] = field(default_factory=dict)
    carried_in: list[Group] = field(default_factory=list)  # adopted from the stream's last batch
    carried_to: str | None = None  # the stream's batch that adopted this one's leftovers
    wasted_s: float = 0.0  # sample-seconds of groups cancelled unjudged
    readers: int = 0
    running: int = 0  # groups started and not yet judged or cancelled
    started_at: float = field(default_factory=trio.current_time)
    created_wall: float = field(default_factory=time.time)
    ended_at: float | None = None
    done: trio.Event = field(default_factory=trio.Event)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    _finished: deque[Group] = field(default_factory=deque)
    _wake: trio.Event = field(default_factory=trio.Event)
    _changed: trio.Event = field(default_factory=trio.Event)

    def __post_init__(self, req: BatchRequest) -> None:
        self._request: BatchRequest | None = req
        # What the status needs once the request is released.
        self.prompts = len(req.prompts)
        self.group_size = req.group_size
        self.keep = req.keep
        self.cancel_on_disconnect = req.cancel_on_disconnect
        self.stream = req.stream
        self._judged: list[tuple[bool, float, float]] = []  # kept?, duration_s, tokens

    @property
    def request(self) -> BatchRequest:
        """What was asked for; only while the batch runs (``release`` lets go of it)."""
        if self._request is None:
            raise BatchEnded(f"batch {self.id} has ended; its request was released")
        return self._request

    def release(self) -> None:
        """The batch has ended: let go of what only a running batch needs (the request, the
        groups waiting to be judged, the tasks of groups; kept groups' tasks once no stream
        of the groups is open)."""
        self._request = None
        self._finished.clear()
        for group in self.every_group():
            if group.state is not GroupState.kept or self.readers == 0:
                group.task = None

    def every_group(self) -> list[Group]:
        """The groups this batch holds or held: those carried in, then those it started."""
        return [*self.carried_in, *self.groups]

    def count(self, state: GroupState) -> int:
        return sum(1 for g in self.every_group() if g.state is state)

    def judged(self, group: Group, keep: bool) -> None:
        """Account a judged group (its duration and length, for ``lengths``)."""
        self._judged.append((keep, group.duration_s(), group.tokens()))

    def cancelled(self, group: Group, reason: str) -> None:
        group.state, group.reason = GroupState.cancelled, reason
        self.cancelled_reasons[reason] = self.cancelled_reasons.get(reason, 0) + 1

    def lengths(self) -> dict[str, Any]:
        """Kept versus offered (every judged) groups: how long the slowest sample took and how
        many tokens a sample sampled, on average. Kept groups much shorter than offered ones
        mean the batch selects for speed (see docs/sampling.md)."""

        def mean(rows: list[tuple[bool, float, float]]) -> dict[str, Any]:
            if not rows:
                return {"groups": 0, "mean_duration_s": None, "mean_tokens": None}
            return {"groups": len(rows),
                    "mean_duration_s": round(statistics.fmean(r[1] for r in rows), 6),
                    "mean_tokens": round(statistics.fmean(r[2] for r in rows), 3)}

        return {"kept": mean([r for r in self._judged if r[0]]), "offered": mean(self._judged)}

    def status(self) -> dict[str, Any]:
        """Progress, as GET /v1/batches/{id} answers it."""
        end = self.ended_at if self.ended_at is not None else trio.current_time()
        return {
            "id": self.id,
            "state": self.state.value,
            "stop_reason": self.stop_reason,
            "prompts": self.prompts,
            "group_size": self.group_size,
            "keep": self.keep,
            "max_in_flight_groups": self.max_in_flight,
            "max_gen_groups": self.max_gen_groups,
            "cancel_on_disconnect": self.cancel_on_disconnect,
            "stream": self.stream,
            "tried": len(self.groups),
            "carried_in": len(self.carried_in),
            "kept": len(self.kept_groups),
            "filtered": self.count(GroupState.filtered),
            "filtered_reasons": dict(self.filtered_reasons),
            "in_flight": self.running,
            "cancelled": self.count(GroupState.cancelled),
            "cancelled_reasons": dict(self.cancelled_reasons),
            "carried_out": self.count(GroupState.carried),
            "carried_to": self.carried_to,
            "lengths": self.lengths(),
            "wasted_sample_s": round(self.wasted_s, 6),
            "elapsed_s": round(end - self.started_at, 6),
            "created_at": self.created_wall,
            "filtered_groups": [g.summary() for g in self.every_group()
                                if g.state is GroupState.filtered],
        }

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def _group_done(self, group: Group) -> None:
        self._finished.append(group)
        self._wake.set()


# ---- judging ---------------------------------------------------------------------------


def _metric(job: Job, metric: str) -> float | None:
    traj = job.trajectory
    value = traj.reward if metric == "reward" else traj.reward_info.get(metric)
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def sample_version(job: Job) -> int | None:
    """The oldest policy version a sample's turns began on (None: it has no turn)."""
    turns = job.trajectory.turns
    return min(t.policy_version_start for t in turns) if turns else None


def judge(
    group: Group, flt: GroupFilter, *, max_staleness: int | None = None, current_version: int = 0
) -> tuple[bool, str | None, str | None]:
    """(keep, reason, detail) for a group whose samples are all terminal."""
    bad = [j for j in group.jobs if not j.trajectory.usable]
    if bad:
        j = bad[0]
        err = j.trajectory.error
        what = f"{err.stage}: {err.type}: {err.message}" if err else "not usable"
        return False, "infrastructure", (
            f"{len(bad)} of {len(group.jobs)} samples unusable; sample {j.trajectory.sample_index} "
            f"{j.status.value} ({what})"
        )
    if max_staleness is not None:
        versions = [v for v in map(sample_version, group.jobs) if v is not None]
        if versions and current_version - min(versions) > max_staleness:
            return False, "stale", (
                f"a sample began on policy version {min(versions)}; the current version is "
                f"{current_version} (max_staleness {max_staleness})"
            )
    values = [_metric(j, flt.metric) for j in group.jobs]
    if any(v is None for v in values):
        return False, "missing_metric", f"metric {flt.metric!r} is missing or not a number"
    if flt.rule == "keep_all":
        return True, None, None
    numbers = [v for v in values if v is not None]
    if max(numbers) == min(numbers):
        return False, "all_equal", f"every sample has {flt.metric}={numbers[0]:g}"
    std = statistics.pstdev(numbers)
    if std <= flt.min_std:
        return False, "low_std", f"{flt.metric} std {std:.4g} <= min_std {flt.min_std:g}"
    return True, None, None
