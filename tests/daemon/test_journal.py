"""Finished results survive a restart; jobs in flight when a daemon died answer `lost`."""

from __future__ import annotations

import trio

from daemon.client import AsyncClient
from daemon.journal import Journal
from daemon.node import Node
from daemon.pipeline import Services

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
