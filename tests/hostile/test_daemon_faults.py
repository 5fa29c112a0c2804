"""Daemon faults against a real `rolloutd serve` with bwrap sandboxes and the scripted policy
(a labelled TEST DOUBLE): SIGKILL with live sandboxes then restart, a backend process killed
mid-rollout, a sandbox that fails to start, a client that disconnects during ``wait=true``.

Each test ends with no sandbox process, sandbox dir, cgroup or mount of the daemon left
(and the suite-wide fixture checks that no child process of this test is left).
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ._daemon import (
    GOOD,
    RUN_SCRIPT,
    Daemon,
    ModelServer,
    assert_clean,
    cgroup_dirs,
    code_task,
    running,
    sandbox_dirs,
    sandbox_pids,
    short_dir,
)

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

SCRIPTED = {"kind": "scripted", "replies": RUN_SCRIPT, "latency_s": 0.02}


@pytest.fixture
def root() -> Iterator[Path]:
    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def submit(h: httpx.AsyncClient, task: dict[str, Any], **body: Any) -> dict[str, Any]:
    r = await h.post("/v1/rollouts", json={"task": task, **body})
    assert r.status_code in (200, 202), r.text
    return dict(r.json())


async def wait_all(h: httpx.AsyncClient, ids: list[str], timeout_s: float = 90) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    with trio.fail_after(timeout_s):
        async with h.stream("GET", "/v1/rollouts/stream", params={"ids": ",".join(ids)}) as resp:
            async for line in resp.aiter_lines():
                if line.strip():
                    t = httpx.Response(200, content=line).json()
                    out[t["id"]] = t
    return out


@pytest.mark.slow
async def test_sigkill_with_live_sandboxes_then_restart(root: Path) -> None:
    """SIGKILL the daemon while 4 rollouts sit in a tool call: the sandboxes die with it
    (bwrap --die-with-parent); a new daemon on the same state dir sweeps what is left
    (dirs, cgroups) and answers ``lost`` for the old ids."""
    first = Daemon(root / "state", backends=[SCRIPTED], n_run=4)
    await first.start()
    try:
        async with first.client() as h:
            sub = await submit(h, code_task("sleep 300"), n=4, timeout_s=600,
                               limits={"tool_timeout_s": 500})
            with trio.fail_after(60):
                while (await h.get("/v1/status")).json()["sandboxes"]["live"] < 4:
                    await trio.sleep(0.1)
                while not any(b"sleep" in _cmdline(p) for p in sandbox_pids(first.tag)):
                    await trio.sleep(0.1)
        old_tag = first.tag
        assert len(sandbox_dirs(first.state_dir)) >= 4  # and any parked spare launchers'
        first.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        await first.stop()
    finally:
        if first.proc is not None and first.proc.poll() is None:
            await first.kill()
    # Nothing of a sandbox outlives its daemon, even before a restart.
    with trio.fail_after(10):
        while sandbox_pids(old_tag):
            await trio.sleep(0.1)
    assert len(sandbox_dirs(first.state_dir)) >= 4  # left for the next daemon's sweep

    second = Daemon(root / "state", backends=[SCRIPTED])
    async with running(second):
        assert [d for d in sandbox_dirs(second.state_dir) if d.parent.name == old_tag] == []
        assert cgroup_dirs(old_tag) == []
        async with second.client() as h:
            st = (await h.get("/v1/status")).json()
            assert st["sandboxes"]["swept"] >= 4
            for job_id in sub["ids"]:
                t = (await h.get(f"/v1/rollouts/{job_id}")).json()
                assert (t["status"], t["usable"], t["reward"]) == ("lost", False, None)
                assert t["error"]["type"] == "lost"
            # The restarted daemon works.
            done = await submit(h, code_task(GOOD), wait=True, timeout_s=60)
            assert [t["reward"] for t in done["rollouts"]] == [1.0]
    await assert_clean(second)
    await assert_clean(second, tag=old_tag)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["rollouts", "batch"])
async def test_sigkill_right_after_the_202_then_the_ids_answer_lost(root: Path, what: str) -> None:
    """An id answered with 202 is in the journal before the answer: SIGKILL the daemon the
    moment the 202 arrives (well inside the journal's batching interval) and a new daemon on
    the same state dir answers ``lost`` for every id, never 404 (issue 15, point 14)."""
    first = Daemon(root / "state", sandbox_spares=0)
    task = {"kind": "sleep", "init_s": 600}
    await first.start()
    try:
        async with first.client() as h:
            if what == "rollouts":
                r = await h.post("/v1/rollouts", json={"task": task, "n": 3})
            else:
                r = await h.post("/v1/batches", json={"prompts": [task] * 4, "group_size": 2, "keep": 2})
            first.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]  # no await in between
            assert r.status_code == 202, r.text
            ids = r.json()["ids"] if what == "rollouts" else [r.json()["id"]]
        await first.stop()
    finally:
        if first.proc is not None and first.proc.poll() is None:
            await first.kill()
    old_tag = first.tag

    second = Daemon(root / "state", sandbox_spares=0)
    async with running(second), second.client() as h:
        for job_id in ids:
            if what == "batch":
                r = await h.get(f"/v1/batches/{job_id}")
                assert r.status_code == 200, r.text
                b = r.json()
                assert (b["state"], b["in_flight"], b["keep"], b["group_size"]) == ("lost", 0, 2, 2)
                r = await h.delete(f"/v1/batches/{job_id}")
                assert (r.status_code, r.json()["state"]) == (200, "lost")
                continue
            r = await h.get(f"/v1/rollouts/{job_id}")
            assert r.status_code == 200, r.text
            t = r.json()
            assert (t["status"], t["usable"], t["error"]["type"]) == ("lost", False, "lost")
    await assert_clean(second)
    await assert_clean(second, tag=old_tag)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.mark.slow
async def test_backend_killed_mid_rollout_fails_over_then_fails_explicitly(root: Path) -> None:
    """Two `rolloutd model-server --backend scripted` processes behind the pool. Killing one
    while rollouts run moves its rollouts to the other (the turn records the retry); with both
    dead a rollout fails explicitly (``NoBackend``, not reward 0); a restarted server is
    probed healthy again and serves."""
    a = ModelServer(RUN_SCRIPT, latency_s=0.4)
    b = ModelServer(RUN_SCRIPT, latency_s=0.4)
    async with trio.open_nursery() as n:
        n.start_soon(a.start)
        n.start_soon(b.start)
    daemon = Daemon(root / "state", n_run=8, health_interval_s=0.5,
                    backends=[{"kind": "vllm", "url": a.url, "id": "ms-a"},
                              {"kind": "vllm", "url": b.url, "id": "ms-b"}])
    try:
        async with running(daemon), daemon.client() as h:
            ids = []
            for _ in range(8):  # separate groups: the pool spreads them over both servers
                ids += (await submit(h, code_task(GOOD), timeout_s=120))["ids"]
            with trio.fail_after(30):
                while not all(x["in_flight"] for x in (await h.get("/v1/backends")).json()["backends"]):
                    await trio.sleep(0.05)
            await a.kill()
            results = await wait_all(h, ids)
            assert {t["status"] for t in results.values()} == {"completed"}
            assert {t["reward"] for t in results.values()} == {1.0}
            turns = [turn for t in results.values() for turn in t["turns"]]
            assert any(turn["retries"] for turn in turns), "no turn recorded the failover"
            assert all(turn["backend"] == "ms-b" for turn in turns if turn["retries"])
            backends = {x["id"]: x for x in (await h.get("/v1/backends")).json()["backends"]}
            assert backends["ms-a"]["healthy"] is False and backends["ms-a"]["failures"] >= 1

            await b.kill()
            failed = (await submit(h, code_task(GOOD), wait=True, timeout_s=60))["rollouts"][0]
            assert (failed["status"], failed["usable"], failed["reward"]) == ("failed", False, None)
            assert failed["error"]["stage"] == "run" and failed["error"]["type"] == "NoBackend"

            await a.start()  # same port: the health loop brings it back
            with trio.fail_after(30):
                while not (await h.get("/v1/backends")).json()["backends"][0]["healthy"]:
                    await trio.sleep(0.1)
            again = (await submit(h, code_task(GOOD), wait=True, timeout_s=60))["rollouts"][0]
            assert (again["status"], again["reward"]) == ("completed", 1.0)
            metrics = (await h.get("/metrics")).text
            assert 'rolloutd_backend_healthy{backend="ms-b"} 0.0' in metrics
            assert 'rolloutd_llm_retries_total{backend=' in metrics
    finally:
        await a.kill()
        await b.kill()
    await assert_clean(daemon)
