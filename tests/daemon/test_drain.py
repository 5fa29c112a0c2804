"""SIGTERM drain of a real `rolloutd serve` process with rollouts in flight."""

from __future__ import annotations

import os
import signal
import socket
import sys

import httpx
import pytest
import trio

from rolloutd.daemon.client import AsyncClient

from .conftest import sleep_task


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_daemon(tmp_path, port: int, nursery: trio.Nursery, **env: str) -> trio.Process:
    environ = dict(os.environ, ROLLOUTD_STATE_DIR=str(tmp_path / "state"), ROLLOUTD_LOG_LEVEL="warning",
                   ROLLOUTD_SANDBOX_BACKEND="local", **env)
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "rolloutd.daemon.cli", "serve", "--port", str(port)], env=environ
    )
    url = f"http://127.0.0.1:{port}"
    with trio.fail_after(30):
        while True:
            try:
                async with httpx.AsyncClient() as h:
                    if (await h.get(f"{url}/readyz")).status_code == 200:
                        return proc
            except httpx.HTTPError:
                await trio.sleep(0.1)


@pytest.mark.slow
async def test_sigterm_drains_in_flight_and_exits_zero(tmp_path, nursery):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = await start_daemon(tmp_path, port, nursery, ROLLOUTD_DRAIN_TIMEOUT_S="2")
    try:
        async with AsyncClient(url) as c:
            quick = (await c.submit(sleep_task(run_s=0.05))).ids
            await c.wait(quick)
            medium = (await c.submit(sleep_task(run_s=0.5))).ids
            slow = (await c.submit(sleep_task(run_s=100), n=2)).ids
            seen: dict[str, str] = {}

            async def watch() -> None:
                async for t in c.stream(medium + slow):
                    seen[t.id] = t.status.value

            async with trio.open_nursery() as watchers:
                watchers.start_soon(watch)
                await trio.sleep(0.2)
                proc.send_signal(signal.SIGTERM)
                await trio.sleep(0.3)
                async with httpx.AsyncClient(base_url=url) as h:
                    assert (await h.get("/readyz")).status_code == 503
                    assert (await h.get("/healthz")).status_code == 200
                    r = await h.post("/v1/rollouts", json={"task": sleep_task()})
                    assert r.status_code == 503
                    assert (await h.get(f"/v1/rollouts/{quick[0]}")).json()["status"] == "completed"
            assert seen[medium[0]] == "completed"
            assert {seen[i] for i in slow} == {"cancelled"}
        with trio.fail_after(20):
            rc = await proc.wait()
        assert rc == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    # A new daemon on the same state dir still answers for the old ids.
    proc = await start_daemon(tmp_path, port, nursery)
    try:
        async with AsyncClient(url) as c:
            assert (await c.get(quick[0])).status.value == "completed"
            assert (await c.get(slow[0])).status.value == "cancelled"
        proc.send_signal(signal.SIGINT)
        with trio.fail_after(20):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
