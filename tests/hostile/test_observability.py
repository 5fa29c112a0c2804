"""One real `rolloutd serve` (bwrap, scripted policy: a labelled TEST DOUBLE, bearer token,
debug logs) shared by the module: a sandbox that fails to start, a client that disconnects
during ``wait=true``, the Prometheus families after real rollouts, and logs that carry job
and sandbox ids but never the token."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from ._daemon import GOOD, RUN_SCRIPT, Daemon, assert_clean, code_task, fd_count, short_dir

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

TOKEN = "hostile-suite-token-5f1d9c"
WRONG = "guessed-token-0b7e44"


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    root = short_dir()
    d = Daemon(root / "state", token=TOKEN, log_level="debug", n_run=4,
               backends=[{"kind": "scripted", "replies": RUN_SCRIPT, "latency_s": 0.02}])
    d.start_sync()
    try:
        yield d
    finally:
        if d.proc is not None and d.proc.poll() is None:
            assert d.stop_sync() == 0
        shutil.rmtree(root, ignore_errors=True)


async def post(d: Daemon, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    async with d.client() as h:
        r = await h.post("/v1/rollouts", json=body, **kw)
        assert r.status_code in (200, 202), r.text
        return dict(r.json())


async def test_sandbox_that_fails_to_start_is_failed_never_reward_zero(daemon: Daemon) -> None:
    swe = {"kind": "swe", "instance_id": "x-1", "problem_statement": "p", "base_commit": "abc123",
           "FAIL_TO_PASS": ["t"]}
    cases = [
        ({**swe, "repo_path": "/nonexistent/repo"}, "SandboxStartError", "Can't find source path"),
        ({**swe, "image": "/nonexistent/image.sif"}, "ImageNotFound", "/nonexistent/image.sif"),
    ]
    for task, etype, words in cases:
        out = await post(daemon, {"task": task, "n": 2, "wait": True, "timeout_s": 60})
        for t in out["rollouts"]:
            assert (t["status"], t["usable"], t["reward"]) == ("failed", False, None)
            assert t["error"]["stage"] == "init" and t["error"]["type"] == etype
            assert words in t["error"]["message"]
    await assert_clean(daemon)


async def test_client_disconnect_during_wait_keeps_the_rollouts(daemon: Daemon) -> None:
    """The trainer dies mid ``wait=true``: the rollouts run on and finish; a retry with the
    same idempotency key finds them (and runs nothing twice)."""
    fds = fd_count(daemon.pid)
    body = {"task": code_task("sleep 2; " + GOOD), "n": 3, "timeout_s": 60,
            "idempotency_key": "disconnect-1"}
    async with daemon.client(timeout=httpx.Timeout(5, read=0.5)) as h:
        with pytest.raises(httpx.ReadTimeout):
            await h.post("/v1/rollouts", json={**body, "wait": True})
    again = await post(daemon, body)
    assert again["replayed"] is True and len(again["ids"]) == 3
    async with daemon.client() as h:
        with trio.fail_after(60):
            while True:
                ts = [(await h.get(f"/v1/rollouts/{i}")).json() for i in again["ids"]]
                if all(t["status"] in ("completed", "failed", "timed_out", "cancelled") for t in ts):
                    break
                await trio.sleep(0.2)
    assert [(t["status"], t["reward"]) for t in ts] == [("completed", 1.0)] * 3
    await assert_clean(daemon)
    with trio.fail_after(10):  # the dropped connection's fd is closed
        while fd_count(daemon.pid) > fds + 2:
            await trio.sleep(0.1)


FAMILIES = {
    # family -> label values that must have samples (None: any sample)
    "rolloutd_stage_queued": {"stage": {"init", "run", "eval"}},
    "rolloutd_stage_in_flight": {"stage": {"init", "run", "eval"}},
    "rolloutd_stage_seconds": {"stage": {"queue", "init", "run", "eval"}},
    "rolloutd_live_jobs": None,
    "rolloutd_queue_capacity": None,
    "rolloutd_sandboxes_live": None,
    "rolloutd_sandboxes_opened": None,
    "rolloutd_sandboxes_start_failures": None,
    "rolloutd_images_stored": None,
    "rolloutd_images_misses": None,
    "rolloutd_images_unpack_seconds": None,
    "rolloutd_tool_seconds": {"tool": {"bash", "finish"}},
    "rolloutd_llm_request_seconds": {"backend": {"scripted-1"}},
    "rolloutd_llm_tokens": {"backend": {"scripted-1"}},
    "rolloutd_backend_healthy": {"backend": {"scripted-1"}},
    "rolloutd_backend_in_flight": {"backend": {"scripted-1"}},
    "rolloutd_rollouts": {"status": {"completed"}},
    "rolloutd_draining": None,
    "rolloutd_process_resident_memory_bytes": None,
    "rolloutd_process_open_fds": None,
}


async def test_metrics_after_real_rollouts(daemon: Daemon) -> None:
    out = await post(daemon, {"task": code_task(GOOD), "n": 3, "wait": True, "timeout_s": 60})
    assert [t["reward"] for t in out["rollouts"]] == [1.0] * 3
    async with daemon.client() as h:
        assert (await h.get("/metrics", headers={"Authorization": "Bearer nope"})).status_code == 401
        r = await h.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name, labels in FAMILIES.items():
        assert name in families, f"no metric family {name}"
        samples = families[name].samples
        assert samples, f"{name} has no samples"
        for key, wanted in (labels or {}).items():
            seen = {s.labels.get(key) for s in samples}
            assert wanted <= seen, f"{name}: {key} {wanted - seen} missing"
    count = {s.labels["tool"]: s.value for s in families["rolloutd_tool_seconds"].samples
             if s.name.endswith("_count")}
    assert count["bash"] >= 3 and count["finish"] >= 3
    done = {s.labels["status"]: s.value for s in families["rolloutd_rollouts"].samples
            if s.name.endswith("_total")}
    assert done["completed"] >= 3
    tokens = [s.value for s in families["rolloutd_llm_tokens"].samples if s.name.endswith("_total")]
    assert sum(tokens) > 0


async def test_logs_carry_ids_and_never_the_token(daemon: Daemon) -> None:
    async with httpx.AsyncClient(base_url=daemon.url, timeout=10) as h:
        for headers, params in (({"Authorization": f"Bearer {WRONG}"}, {}),
                                ({"Authorization": WRONG}, {}),
                                ({}, {"token": WRONG}),
                                ({"Authorization": f"Bearer {TOKEN}"}, {"token": TOKEN})):
            await h.get("/v1/status", headers=headers, params=params)
            await h.post("/v1/rollouts", headers=headers, params=params, content=b"{bad json")
    ok = await post(daemon, {"task": code_task(GOOD), "wait": True, "timeout_s": 60})
    bad = await post(daemon, {"task": {"kind": "swe", "instance_id": "x-2", "problem_statement": "p",
                                       "base_commit": "abc123", "FAIL_TO_PASS": ["t"],
                                       "repo_path": "/nonexistent/repo"}, "wait": True})
    [ok_id], [bad_id] = ([t["id"] for t in x["rollouts"]] for x in (ok, bad))
    await trio.sleep(0.5)
    text = daemon.log_text()
    assert TOKEN not in text and WRONG not in text
    records = daemon.log_records()
    assert records and all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    mine = [r for r in records if r.get("job_id") == ok_id]
    assert any(r.get("sandbox_id") and r.get("status") == "completed" for r in mine), mine
    failed = [r for r in records if r.get("job_id") == bad_id]
    assert any(r.get("error_type") == "SandboxStartError" and r.get("stage") == "init" for r in failed)
    finished = [r for r in records if r.get("status") and r.get("job_id")]
    assert all(json.dumps(r).count(TOKEN) == 0 for r in finished)


async def test_an_agent_that_fills_tmp_and_shm_gets_enospc_and_a_usable_trajectory(
        daemon: Daemon) -> None:
    """Filling `/tmp` and `/dev/shm` (memory-backed, charged to the sandbox's memory cgroup)
    used to reach the memory limit first: the OOM killer took the helper and the rollout
    ended `failed`, `usable: false`. Both are capped below the limit now (issue 15, point 2):
    the agent sees ENOSPC, goes on, and the trajectory is scored."""
    fill = ("dd if=/dev/zero of=/tmp/fill bs=1M 2>&1 | grep -o 'No space left on device'; "
            "dd if=/dev/zero of=/dev/shm/fill bs=1M 2>&1 | grep -o 'No space left on device'; ")
    out = await post(daemon, {"task": code_task(fill + GOOD), "wait": True, "timeout_s": 120})
    [t] = out["rollouts"]
    assert (t["status"], t["usable"], t["reward"]) == ("completed", True, 1.0), t["error"]
    assert json.dumps(t["messages"]).count("No space left on device") == 2, t["messages"][2:]
    await assert_clean(daemon)
