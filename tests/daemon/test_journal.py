"""Finished results survive a restart; jobs in flight when a daemon died answer `lost`."""

from __future__ import annotations

import sqlite3

import httpx
import trio
import trio.testing

from rolloutd.daemon.client import AsyncClient
from rolloutd.daemon.journal import Journal
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services

from .conftest import make_settings, sleep_task


async def test_results_survive_restart_and_crashed_jobs_are_lost(tmp_path):
    settings = make_settings(tmp_path)
    # First daemon: one job finishes, then a clean stop.
    node = Node(settings, services=Services())
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        async with AsyncClient(node.urls[0]) as c:
            done = (await c.submit(sleep_task(), n=1)).ids[0]
            await c.wait([done])
        node.request_stop()

    # A daemon that "crashed": its journal says a job was queued and never finished.
    crashed = Journal(settings.state_dir / "journal.sqlite3", boot_id="boot-dead", ttl_s=60)
    async with trio.open_nursery() as nursery:
        await nursery.start(crashed.run)

        class Fake:
            id, group_id = "r-crashed", "g-crashed"

            class status:  # noqa: N801
                value = "run"

        crashed.record_submitted([Fake()])  # type: ignore[list-item]
        await trio.sleep(0.3)
        nursery.cancel_scope.cancel()

    node2 = Node(settings, services=Services())
    async with trio.open_nursery() as nursery:
        await nursery.start(node2.run)
        assert node2.journal.lost_at_start == 1
        async with AsyncClient(node2.urls[0]) as c:
            old = await c.get(done)
            assert old.status.value == "completed" and old.reward == 1.0
            lost = await c.get("r-crashed")
            assert lost.status.value == "lost" and lost.usable is False
            assert lost.error is not None and lost.error.type == "lost"
            streamed = [t.status.value async for t in c.stream([done, "r-crashed"])]
            assert sorted(streamed) == ["completed", "lost"]
            assert await c.cancel("r-crashed") == "lost"
        node2.request_stop()


async def test_sync_makes_submitted_jobs_durable_at_once(tmp_path, autojump_clock):
    """``sync`` writes at once (not after the flush interval) and returns only when the rows
    are in the file another process would read; later changes stay batched."""
    from rolloutd.daemon.journal import FLUSH_INTERVAL_S

    path = tmp_path / "journal.sqlite3"
    journal = Journal(path, boot_id="boot-a", ttl_s=60)

    def rows() -> list[tuple[str, str]]:
        with sqlite3.connect(path) as db:
            return db.execute("SELECT id, status FROM jobs ORDER BY id").fetchall()

    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await journal.sync()  # nothing recorded: returns at once
        jobs = [_FakeJob(f"r-{i}") for i in range(3)]
        journal.record_submitted(jobs)  # type: ignore[arg-type]
        start = trio.current_time()
        await journal.sync()
        assert trio.current_time() - start < FLUSH_INTERVAL_S
        assert await trio.to_thread.run_sync(rows) == [("r-0", "queued"), ("r-1", "queued"), ("r-2", "queued")]
        # A sync that finds its records already being written waits for that write (held up
        # here by another connection's lock, for less than sqlite's busy timeout).
        other = sqlite3.connect(path, isolation_level=None)
        try:
            other.execute("BEGIN EXCLUSIVE")
            journal.record_submitted([_FakeJob("r-3")])  # type: ignore[list-item]
            async with trio.open_nursery() as waiters:
                waiters.start_soon(journal.sync)
                await trio.testing.wait_all_tasks_blocked()  # the flusher waits on its write
                with trio.move_on_after(1) as waited:
                    await journal.sync()
                assert waited.cancelled_caught
                other.close()
        finally:
            other.close()
        await journal.sync()
        assert len(await trio.to_thread.run_sync(rows)) == 4
        nursery.cancel_scope.cancel()


class _FakeJob:
    """A TEST DOUBLE of a Job: the fields the journal records."""

    def __init__(self, job_id: str) -> None:
        self.id, self.group_id = job_id, "g-fake"

    class status:  # noqa: N801
        value = "queued"


async def test_batches_outlive_a_restart_with_their_last_status(tmp_path):
    """A batch that ended, and one that a drain stopped, answer their last status from the
    journal after a restart (not 404, and not ``lost``: the earlier daemon stopped cleanly)."""
    settings = make_settings(tmp_path, drain_timeout_s=0.2)
    node = Node(settings, services=Services())
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        async with AsyncClient(node.urls[0]) as c:
            done = await c.create_batch([sleep_task(rewards=[0, 1])], group_size=2, keep=1)
            with trio.fail_after(10):
                while (await c.batch_status(done["id"]))["state"] == "running":
                    await trio.sleep(0.01)
            stopped = await c.create_batch([sleep_task(init_s=600)] * 3, group_size=2, keep=1)
            with trio.fail_after(10):
                while (await c.batch_status(stopped["id"]))["tried"] == 0:
                    await trio.sleep(0.01)
        node.request_stop()

    node2 = Node(settings, services=Services())
    async with trio.open_nursery() as nursery:
        await nursery.start(node2.run)
        async with AsyncClient(node2.urls[0]) as c:
            old = await c.batch_status(done["id"])
            assert (old["state"], old["kept"], old["tried"]) == ("completed", 1, 1)
            old = await c.batch_status(stopped["id"])
            assert old["state"] in {"cancelled", "exhausted"} and old["in_flight"] == 0
            assert old["tried"] >= 1
            assert (await c.cancel_batch(stopped["id"]))["state"] == old["state"]
        node2.request_stop()


async def test_a_submit_the_journal_cannot_record_is_refused_not_forgotten(tmp_path):
    """While another process holds the journal's write lock past sqlite's busy timeout, a
    submit answers 503 (its jobs withdrawn), never a 202 for ids a crash would forget; once
    the lock is gone the same request (same idempotency key) is accepted afresh."""
    settings = make_settings(tmp_path)
    node = Node(settings, services=Services())
    body = {"task": sleep_task(init_s=600), "idempotency_key": "once"}
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        async with httpx.AsyncClient(base_url=node.urls[0], timeout=30) as h:
            other = sqlite3.connect(settings.state_dir / "journal.sqlite3", isolation_level=None)
            try:
                other.execute("BEGIN EXCLUSIVE")
                r = await h.post("/v1/rollouts", json=body)
            finally:
                other.close()
            assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable"
            assert "journal" in r.json()["error"]["message"] and "Retry-After" in r.headers
            assert node.service.store.counts() == {"cancelled": 1}
            r = await h.post("/v1/rollouts", json=body)
            assert r.status_code == 202 and r.json()["replayed"] is False
            await h.delete(f"/v1/rollouts/{r.json()['ids'][0]}")
        node.request_stop()
