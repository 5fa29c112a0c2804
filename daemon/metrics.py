"""Prometheus metrics of one daemon (its own registry, so several daemons can share a process).

Two sources:

- **At scrape time**, a collector reads ``node.status()``: stage queue depths, in-flight and
  worker counts, live jobs, images (stored, bytes, hits, misses, prefetch, unpack time),
  sandboxes (live, idle in the warm pool, opened, closed, start
  failures, swept orphans), each LLM backend's health, in-flight requests, served requests
  and failures, whether the daemon drains; in a federation, its members by state, its gossip
  counters, and what it forwarded, relayed and had stolen. Plus the process's RSS, fds and CPU.
- **Per finished rollout**, :meth:`Metrics.observe_job` reads its trajectory: rollouts by
  status (and usable), time per stage, LLM request latency, sampled tokens and retries by
  backend, tool latency and failed tool calls by tool. The same observation feeds what
  ``GET /v1/status`` shows of it (the dashboard's overview): each tool's calls and latency
  percentiles (:class:`ToolLatency`), and finished rollouts and their mean reward per minute
  over the last hour (:class:`History`), kept here so a page opened late still sees the hour.

Every family is prefixed ``rolloutd_``; docs in README "Operating rolloutd".
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from pydantic import BaseModel, Field

from rolloutd.daemon.jobs import Job, percentiles
from rolloutd.daemon.trajectory import Trajectory

_STAGE_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_FAST_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STAGES = ("queue", "init", "run", "eval")


class _StatusCollector(Collector):
    """Gauges read from the daemon's live status at scrape time."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        st = self._status()
        pipeline = st["pipeline"]
        queued = GaugeMetricFamily("rolloutd_stage_queued", "Jobs waiting for a stage", labels=["stage"])
        busy = GaugeMetricFamily("rolloutd_stage_in_flight", "Jobs being worked on", labels=["stage"])
        workers = GaugeMetricFamily("rolloutd_stage_workers", "Workers of a stage", labels=["stage"])
        for name, s in pipeline["stages"].items():
            queued.add_metric([name], s["queued"])
            busy.add_metric([name], s["in_flight"])
            workers.add_metric([name], s["workers"])
        yield queued
        yield busy
        yield workers
        yield GaugeMetricFamily("rolloutd_queue_capacity", "Size of the intake queue (429 when full)",
                                value=pipeline["queue_capacity"])
        yield GaugeMetricFamily("rolloutd_live_jobs", "Jobs not yet terminal", value=pipeline["live_jobs"])
        yield from _sandbox_metrics(st.get("sandboxes") or {})
        yield from _image_metrics(st.get("images") or {})
        yield from _backend_metrics((st.get("backends") or {}).get("backends", []))
        if st.get("federation"):
            yield from _federation_metrics(st["federation"])
        yield GaugeMetricFamily("rolloutd_draining", "1 while draining", value=1.0 if st["draining"] else 0.0)
        yield GaugeMetricFamily("rolloutd_ready", "1 while accepting rollouts", value=1.0 if st["ready"] else 0.0)


def _sandbox_metrics(sb: dict[str, Any]) -> Iterator[Metric]:
    yield GaugeMetricFamily("rolloutd_sandboxes_live", "Live sandboxes held by rollouts",
                            value=sb.get("live", 0))
    yield GaugeMetricFamily("rolloutd_sandboxes_pool_idle", "Warm sandboxes waiting in the pool",
                            value=sb.get("pool_idle", 0))
    for key, help_text in (("opened", "Sandboxes opened"), ("closed", "Sandboxes torn down"),
                           ("start_failures", "Sandboxes that failed to start"),
                           ("swept", "Orphan sandboxes of earlier daemon processes removed at start")):
        yield CounterMetricFamily(f"rolloutd_sandboxes_{key}", help_text, value=sb.get(key, 0))


def _image_metrics(images: dict[str, Any]) -> Iterator[Metric]:
    yield GaugeMetricFamily("rolloutd_images_stored", "Images in the image store",
                            value=images.get("images", 0))
    yield GaugeMetricFamily("rolloutd_images_bytes", "Bytes of unpacked layers in the image store",
                            value=images.get("bytes", 0))
    for key, help_text in (("hits", "Image resolves answered from the store"),
                           ("misses", "Image resolves that imported (unpacked) the image"),
                           ("prefetched", "Images resolved ahead of INIT"),
                           ("prefetch_failed", "Prefetches that failed (INIT reports the error)")):
        yield CounterMetricFamily(f"rolloutd_images_{key}", help_text, value=images.get(key, 0))
    yield CounterMetricFamily("rolloutd_images_unpack_seconds", "Time spent unpacking images",
                              value=images.get("unpack_s_total", 0.0))


def _backend_metrics(backends: list[dict[str, Any]]) -> Iterator[Metric]:
    health = GaugeMetricFamily("rolloutd_backend_healthy", "1 if the backend is healthy", labels=["backend"])
    inflight = GaugeMetricFamily("rolloutd_backend_in_flight", "LLM requests in flight", labels=["backend"])
    served = CounterMetricFamily("rolloutd_backend_served", "LLM requests served", labels=["backend"])
    failures = CounterMetricFamily("rolloutd_backend_failures", "LLM requests that failed (then retried elsewhere)",
                                   labels=["backend"])
    for b in backends:
        health.add_metric([b["id"]], 1.0 if b.get("healthy") else 0.0)
        inflight.add_metric([b["id"]], b.get("in_flight", 0))
        served.add_metric([b["id"]], b.get("served", 0))
        failures.add_metric([b["id"]], b.get("failures", 0))
    yield health
    yield inflight
    yield served
    yield failures


#: The federation's counters in GET /v1/status: (its key there, metric name, help).
_FEDERATION_COUNTERS = (
    (("gossip", "rounds"), "gossip_rounds", "Gossip rounds this daemon started"),
    (("gossip", "exchanges"), "gossip_exchanges", "Gossip exchanges this daemon started that succeeded"),
    (("gossip", "datagram_exchanges"), "gossip_datagram_exchanges",
     "Gossip exchanges this daemon started that went over UDP (the rest went over HTTP)"),
    (("gossip", "answered"), "gossip_answered", "Gossip exchanges peers started with this daemon"),
    (("gossip", "failures"), "gossip_failures", "Gossip exchanges that failed (unreachable, timeout, bad answer)"),
    (("gossip", "auth_failures"), "gossip_auth_failures",
     "Gossip exchanges a peer refused (401/403: the federation's token differs)"),
    (("gossip", "refutations"), "gossip_refutations", "Times this daemon refuted a suspicion of itself"),
    (("forwarded_total",), "forwarded", "Rollouts this daemon forwarded to peers"),
    (("submit_requests",), "forward_requests",
     "Requests that carried submits this daemon forwarded to peers (one or more submits each)"),
    (("relay_probes",), "relay_probes", "Listings of a peer's undelivered rollouts (relay sweeps)"),
    (("relay_lookups",), "relay_lookups", "Lookups of one forwarded rollout's trajectory"),
    (("taken_over",), "taken_over", "Queued rollouts this daemon took from busier peers"),
    (("handed_over",), "handed_over", "Queued rollouts this daemon handed to peers that asked"),
    (("steal_asks",), "steal_asks", "Asks for queued rollouts this daemon sent to busier peers"),
    (("batch_placed",), "batch_placed",
     "Samples of batch groups this daemon placed on peers (handed over as they were queued)"),
    (("placements", "image_home"), "image_home_placements",
     "Submits of a task with an image placed on one of the image's homes"),
    (("placements", "image_spilled"), "image_spilled_placements",
     "Submits of a task with an image placed elsewhere: neither home had room"),
)


def _federation_metrics(fed: dict[str, Any]) -> Iterator[Metric]:
    members = GaugeMetricFamily("rolloutd_federation_members",
                                "Members this daemon knows of, itself included, by state", labels=["state"])
    for state, n in fed.get("states", {}).items():
        members.add_metric([state], n)
    yield members
    yield GaugeMetricFamily("rolloutd_federation_forwarded_open",
                            "Forwarded rollouts whose result has not come back yet", value=fed.get("forwarded", 0))
    for path, name, help_text in _FEDERATION_COUNTERS:
        value: Any = fed
        for key in path:
            value = value.get(key, 0) if isinstance(value, dict) else 0
        yield CounterMetricFamily(f"rolloutd_federation_{name}", help_text, value=value)


# ---- what /v1/status shows of the observed rollouts -----------------------------------------


class ToolRow(BaseModel):
    name: str = Field(description="The tool's name (`(other)`: the calls of every name past the first "
                      "`MAX_TOOLS`).")
    calls: int = Field(description="Calls since the daemon started (of finished rollouts).")
    failed: int = Field(description="Calls that failed or timed out.")
    p50_s: float | None = Field(description="Median latency over its last `window` calls.")
    p95_s: float | None
    window: int = Field(description="How many recent calls the percentiles are taken over.")


class ToolLatency:
    """Each tool's calls and latency percentiles: the tool calls of finished rollouts
    (``ToolCallRecord.latency_s``, which the agent loop times), as ``rolloutd_tool_seconds``."""

    #: Recent calls per tool its percentiles are taken over.
    WINDOW = 2048
    #: Tool names kept apart (a model names the tools it calls); later ones count as OTHER.
    MAX_TOOLS = 200
    OTHER = "(other)"

    def __init__(self) -> None:
        self._calls: dict[str, list[int]] = {}  # name -> [calls, failed]
        self._latency: dict[str, deque[float]] = {}

    def observe(self, name: str, latency_s: float, *, ok: bool) -> None:
        if name not in self._calls and len(self._calls) >= self.MAX_TOOLS:
            name = self.OTHER
        counts = self._calls.setdefault(name, [0, 0])
        counts[0] += 1
        counts[1] += 0 if ok else 1
        self._latency.setdefault(name, deque(maxlen=self.WINDOW)).append(latency_s)

    def snapshot(self) -> list[dict[str, Any]]:
        """One row per tool, most called first."""
        rows = [
            ToolRow(name=name, calls=calls, failed=failed, window=len(self._latency[name]),
                    **percentiles(self._latency[name], (50, 95)))
            for name, (calls, failed) in self._calls.items()
        ]
        rows.sort(key=lambda r: (-r.calls, r.name))
        return [r.model_dump() for r in rows]


class Bucket(BaseModel):
    start: float = Field(description="Unix time the bucket (minute) begins.")
    finished: int = Field(description="Rollouts that finished in it (any terminal status).")
    rewarded: int = Field(description="Of those, rollouts with a reward.")
    mean_reward: float | None = Field(description="Their mean reward (null: none rewarded).")


class HistoryView(BaseModel):
    bucket_s: int
    buckets: list[Bucket] = Field(description="Oldest first, the last ending with the current one.")


class History:
    """Finished rollouts and their mean reward per ``BUCKET_S``, the last ``BUCKETS`` of them
    (an hour): at most ``BUCKETS`` buckets are held, whatever the rate."""

    BUCKET_S = 60
    BUCKETS = 60

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._buckets: dict[int, list[float]] = {}  # minute -> [finished, rewarded, reward sum]

    def observe(self, trajectory: Trajectory) -> None:
        minute = int(self._clock() // self.BUCKET_S)
        b = self._buckets.setdefault(minute, [0, 0, 0.0])
        b[0] += 1
        if trajectory.reward is not None:
            b[1] += 1
            b[2] += trajectory.reward
        for old in [m for m in self._buckets if m <= minute - self.BUCKETS]:
            del self._buckets[old]

    def snapshot(self) -> dict[str, Any]:
        """Every bucket of the last hour, empty ones included."""
        now = int(self._clock() // self.BUCKET_S)
        buckets = []
        for minute in range(now - self.BUCKETS + 1, now + 1):
            finished, rewarded, total = self._buckets.get(minute, (0, 0, 0.0))
            buckets.append(Bucket(start=minute * self.BUCKET_S, finished=int(finished), rewarded=int(rewarded),
                                  mean_reward=total / rewarded if rewarded else None))
        return HistoryView(bucket_s=self.BUCKET_S, buckets=buckets).model_dump()


class Metrics:
    def __init__(self, status: Callable[[], dict[str, Any]], *, clock: Callable[[], float] = time.time) -> None:
        self.tools = ToolLatency()
        self.history = History(clock)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StatusCollector(status))
        ProcessCollector(namespace="rolloutd", registry=self.registry)
        r = self.registry
        self.rollouts = Counter("rolloutd_rollouts", "Finished rollouts by status", ["status"], registry=r)
        self.unusable = Counter("rolloutd_rollouts_unusable", "Finished rollouts a trainer should not train on",
                                ["status"], registry=r)
        self.stage_seconds = Histogram("rolloutd_stage_seconds", "Time a job spent in a stage (queue: waiting)",
                                       ["stage"], buckets=_STAGE_BUCKETS, registry=r)
        self.tool_seconds = Histogram("rolloutd_tool_seconds", "Tool call latency", ["tool"],
                                      buckets=_FAST_BUCKETS, registry=r)
        self.tool_errors = Counter("rolloutd_tool_errors", "Tool calls that failed or timed out", ["tool"],
                                   registry=r)
        self.llm_seconds = Histogram("rolloutd_llm_request_seconds", "LLM request latency (one turn)",
                                     ["backend"], buckets=_STAGE_BUCKETS, registry=r)
        self.llm_tokens = Counter("rolloutd_llm_tokens", "Sampled tokens by backend", ["backend"], registry=r)
        self.llm_retries = Counter("rolloutd_llm_retries", "LLM requests retried on another backend",
                                   ["backend"], registry=r)
        for stage in STAGES:  # every stage shows up from the first scrape
            self.stage_seconds.labels(stage)

    def observe_job(self, job: Job) -> None:
        t = job.trajectory
        self.history.observe(t)
        self.rollouts.labels(t.status.value).inc()
        if not t.usable:
            self.unusable.labels(t.status.value).inc()
        for stage in STAGES:
            seconds = getattr(t.timing, f"{stage}_s")
            if stage == "queue" or seconds > 0:
                self.stage_seconds.labels(stage).observe(seconds)
        for turn in t.turns:
            backend = turn.backend or "unknown"
            self.llm_seconds.labels(backend).observe(turn.llm_s)
            self.llm_tokens.labels(backend).inc(turn.end - turn.start)
            if turn.retries:
                self.llm_retries.labels(backend).inc(turn.retries)
            for call in turn.tool_calls:
                self.tool_seconds.labels(call.name).observe(call.latency_s)
                self.tools.observe(call.name, call.latency_s, ok=call.ok)
                if not call.ok:
                    self.tool_errors.labels(call.name).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
