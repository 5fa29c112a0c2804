"""What ``GET /v1/status`` shows for the dashboard's overview: each tool's calls and latency,
the image store's figures, and finished rollouts with their mean reward per minute over the
last hour (kept by the daemon, so a page opened late still sees the hour).

The rollouts with tool calls run in a real ``rolloutd serve`` whose policy is the scripted
backend, a labelled TEST DOUBLE (a calculator call, then the answer)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from rolloutd.daemon.metrics import History, ToolLatency
from rolloutd.daemon.trajectory import Trajectory
from tests.hostile._daemon import Daemon, tool_call

from .conftest import sleep_task

CALC_REPLIES = [tool_call("calculator", expression="6 * 7"), "The answer is 42"]


async def test_a_fresh_daemon_shows_empty_figures(asgi):
    client, _ = await asgi()
    async with client:
        st = (await client.get("/v1/status")).json()
    assert st["tools"] == []
    history = st["history"]
    assert history["bucket_s"] == 60 and len(history["buckets"]) == 60
    assert all(b["finished"] == 0 and b["rewarded"] == 0 and b["mean_reward"] is None
               for b in history["buckets"])
    starts = [b["start"] for b in history["buckets"]]
    assert starts == sorted(starts) and starts[1] - starts[0] == 60
    # this node's image store was never read (its refresher does not run here): prefetch only
    assert st["images"]["prefetched"] == 0 and st["images"]["prefetch_failed"] == 0


def test_status_shows_tools_and_the_last_hour_of_a_real_daemon(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "state", sandbox_backend="local", log_level="warning",
                    backends=[{"kind": "scripted", "replies": CALC_REPLIES}])
    daemon.start_sync()
    try:
        with httpx.Client(base_url=daemon.url, headers=daemon.headers, timeout=60) as h:
            r = h.post("/v1/rollouts", json={"task": {"kind": "calc", "expression": "6 * 7", "examples": 0},
                                             "n": 3, "wait": True})
            assert r.status_code == 200, r.text
            calc = r.json()["rollouts"]
            assert all(len(t["turns"]) == 2 and t["reward"] == 1.0 for t in calc), calc
            r = h.post("/v1/rollouts", json={"task": sleep_task(rewards=[0.0, 0.5]), "n": 2, "wait": True})
            assert r.status_code == 200, r.text
            r = h.post("/v1/rollouts", json={"task": sleep_task(fail_stage="eval"), "wait": True})
            assert r.status_code == 200, r.text
            st = h.get("/v1/status").json()
            doc = h.get("/openapi.json").json()
    finally:
        daemon.stop_sync()

    latencies = sorted(c["latency_s"] for t in calc for turn in t["turns"] for c in turn["tool_calls"])
    assert len(latencies) == 3
    (row,) = st["tools"]
    assert row == {"name": "calculator", "calls": 3, "failed": 0, "window": 3,
                   "p50_s": latencies[1], "p95_s": latencies[2]}
    # the last hour: six finished rollouts (one failed, unrewarded), mean reward (3 + 0.5) / 5
    buckets = st["history"]["buckets"]
    assert len(buckets) == 60
    finished = sum(b["finished"] for b in buckets)
    rewarded = sum(b["rewarded"] for b in buckets)
    assert (finished, rewarded) == (6, 5)
    total = sum(b["mean_reward"] * b["rewarded"] for b in buckets if b["rewarded"])
    assert total == pytest.approx(3.5)
    images = st["images"]
    assert (images["images"], images["bytes"], images["prefetch_failed"]) == (0, 0, 0)
    assert {"hits", "misses", "unpack_s_total", "prefetched", "prefetching"} <= set(images)
    # the OpenAPI document describes the new figures
    schema = doc["paths"]["/v1/status"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    if "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    assert {"tools", "history"} <= set(schema["properties"]), schema


def test_history_keeps_an_hour_of_minutes() -> None:
    now = [10_000.0 * 60]
    hist = History(lambda: now[0])
    for reward in (1.0, 0.0, None):
        hist.observe(Trajectory(id="r", reward=reward))
    last = hist.snapshot()["buckets"][-1]
    assert last == {"start": now[0], "finished": 3, "rewarded": 2, "mean_reward": 0.5}
    now[0] += 59 * 60  # 59 minutes later: the first minute is the oldest bucket shown
    hist.observe(Trajectory(id="r", reward=2.0))
    buckets = hist.snapshot()["buckets"]
    assert buckets[0]["finished"] == 3 and buckets[-1]["mean_reward"] == 2.0
    assert sum(b["finished"] for b in buckets) == 4
    now[0] += 60  # one more minute: the first falls out, and what is held stays bounded
    hist.observe(Trajectory(id="r", reward=1.0))
    buckets = hist.snapshot()["buckets"]
    assert len(buckets) == 60 and sum(b["finished"] for b in buckets) == 2
    assert len(hist._buckets) <= History.BUCKETS
    now[0] += 3 * 3600  # a quiet daemon shows an empty hour
    assert all(b["finished"] == 0 and b["mean_reward"] is None for b in hist.snapshot()["buckets"])


def test_tool_latency_is_bounded_in_names_and_calls() -> None:
    tools = ToolLatency()
    for i in range(ToolLatency.MAX_TOOLS + 5):
        tools.observe(f"tool{i}", 0.01, ok=i % 2 == 0)
    rows = {r["name"]: r for r in tools.snapshot()}
    assert len(rows) == ToolLatency.MAX_TOOLS + 1
    assert rows[ToolLatency.OTHER]["calls"] == 5 and rows[ToolLatency.OTHER]["failed"] == 2
    tools = ToolLatency()
    tools.observe("read", 1.0, ok=True)
    for i in range(ToolLatency.WINDOW + 100):
        tools.observe("shell", float(i), ok=True)
    shell = tools.snapshot()[0]  # the most called first
    assert shell["name"] == "shell" and shell["calls"] == ToolLatency.WINDOW + 100
    assert shell["window"] == ToolLatency.WINDOW
    assert shell["p50_s"] == pytest.approx(100 + ToolLatency.WINDOW / 2 - 1)
