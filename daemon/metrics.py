"""Prometheus metrics of one daemon (its own registry, so several daemons can share a process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from daemon.jobs import Job

_STAGE_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_FAST_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _StatusCollector(Collector):
    """Gauges read from the daemon's live status at scrape time."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        st = self._status()
        stages = st["pipeline"]["stages"]
        queued = GaugeMetricFamily("rolloutd_stage_queued", "Jobs waiting for a stage", labels=["stage"])
        busy = GaugeMetricFamily("rolloutd_stage_in_flight", "Jobs being worked on", labels=["stage"])
        for name, s in stages.items():
            queued.add_metric([name], s["queued"])
            busy.add_metric([name], s["in_flight"])
        yield queued
        yield busy
        yield GaugeMetricFamily("rolloutd_live_jobs", "Jobs not yet terminal", value=st["pipeline"]["live_jobs"])
        sandboxes = st.get("sandboxes") or {}
        yield GaugeMetricFamily("rolloutd_sandboxes_live", "Live sandboxes", value=sandboxes.get("live", 0))
        health = GaugeMetricFamily("rolloutd_backend_healthy", "1 if the backend is healthy", labels=["backend"])
        inflight = GaugeMetricFamily("rolloutd_backend_in_flight", "LLM requests in flight", labels=["backend"])
        for b in (st.get("backends") or {}).get("backends", []):
            health.add_metric([b["id"]], 1.0 if b.get("healthy") else 0.0)
            inflight.add_metric([b["id"]], b.get("in_flight", 0))
        yield health
        yield inflight
        yield GaugeMetricFamily("rolloutd_draining", "1 while draining", value=1.0 if st["draining"] else 0.0)


class Metrics:
    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StatusCollector(status))
        self.rollouts = Counter("rolloutd_rollouts", "Finished rollouts by status", ["status"],
                                registry=self.registry)
        self.stage_seconds = Histogram("rolloutd_stage_seconds", "Time a job spent in a stage",
                                       ["stage"], buckets=_STAGE_BUCKETS, registry=self.registry)
        self.tool_seconds = Histogram("rolloutd_tool_seconds", "Tool call latency", ["tool"],
                                      buckets=_FAST_BUCKETS, registry=self.registry)
        self.llm_seconds = Histogram("rolloutd_llm_request_seconds", "LLM request latency",
                                     ["backend"], buckets=_STAGE_BUCKETS, registry=self.registry)
        self.llm_tokens = Counter("rolloutd_llm_tokens", "Sampled tokens by backend", ["backend"],
                                  registry=self.registry)

    def observe_job(self, job: Job) -> None:
        t = job.trajectory
        self.rollouts.labels(t.status.value).inc()
        for stage in ("queue", "init", "run", "eval"):
            self.stage_seconds.labels(stage).observe(getattr(t.timing, f"{stage}_s"))
        for turn in t.turns:
            backend = turn.backend or "unknown"
            self.llm_seconds.labels(backend).observe(turn.llm_s)
            self.llm_tokens.labels(backend).inc(turn.end - turn.start)
            for call in turn.tool_calls:
                self.tool_seconds.labels(call.name).observe(call.latency_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
