"""The daemon over a real hypercorn socket (port 0), driven by the async client."""

from __future__ import annotations

import pytest
import trio

from rolloutd.daemon.client import AsyncClient, RolloutdError
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services

from .conftest import make_settings, sleep_task


@pytest.fixture
async def served(nursery, tmp_path):
    node = Node(make_settings(tmp_path, token="tok"), services=Services())
    await nursery.start(node.run)
    yield node
    node.request_stop()


async def test_client_round_trip_over_http(served):
    url = served.urls[0]
    async with AsyncClient(url, token="tok") as c:
        sub = await c.submit(sleep_task(run_s=0.01), n=3, group_id="grp")
        trajs = await c.wait(sub.ids)
        assert [t.status.value for t in trajs] == ["completed"] * 3
        assert {t.group_id for t in trajs} == {"grp"}
        one = await c.get(sub.ids[0])
        assert one.reward == 1.0
        st = await c.status()
        assert st["ready"] is True and st["rollouts"]["completed"] == 3
        streamed = [t.id async for t in c.stream(sub.ids)]
        assert sorted(streamed) == sorted(sub.ids)
        long = await c.submit(sleep_task(run_s=60))
        assert await c.cancel(long.ids[0]) in {"queued", "init", "run", "cancelled"}
        [t] = await c.wait(long.ids)
        assert t.status.value == "cancelled"
        with pytest.raises(RolloutdError) as err:
            await c.get("r-missing")
        assert err.value.status == 404 and err.value.type == "not_found"
    async with AsyncClient(url, token="bad") as c:
        with pytest.raises(RolloutdError) as err:
            await c.status()
        assert err.value.status == 401


async def test_the_clients_wait_on_more_ids_than_a_url_holds(nursery, tmp_path):
    """A batch of thousands of rollouts: the ids went in the stream's URL, which httpx refuses
    past 64 kB (about 3,400 ids: `InvalidURL`, no RolloutdError) and proxies past 8 kB. Past
    GET_STREAM_IDS the clients POST them; past MAX_STREAM_IDS they stream in turns."""
    from rolloutd.daemon.client import Client
    from rolloutd.daemon.streams import GET_STREAM_IDS, MAX_STREAM_IDS

    node = Node(make_settings(tmp_path, token="tok", queue_size=1024, n_init=4, n_run=8, n_eval=4),
                services=Services())
    await nursery.start(node.run)
    async with AsyncClient(node.urls[0], token="tok") as c:
        ids = []
        while len(ids) <= GET_STREAM_IDS + 40:
            ids += (await c.submit(sleep_task(run_s=0), n=16)).ids
        trajs = await c.wait([*ids, ids[0]])  # a repeated id is one rollout
        assert [t.id for t in trajs] == [*ids, ids[0]]
        assert {t.status.value for t in trajs} == {"completed"}
        unknown = [f"r-{i:016x}" for i in range(MAX_STREAM_IDS + 1)]
        with pytest.raises(RolloutdError) as err:
            await c.wait(unknown)
        assert err.value.status == 404 and err.value.type == "not_found"

    def blocking() -> None:
        with Client(node.urls[0], token="tok") as sync:
            assert [t.id for t in sync.wait(ids)] == ids
            with pytest.raises(RolloutdError) as err:
                sync.wait(unknown[:5000])
            assert err.value.status == 404

    await trio.to_thread.run_sync(blocking)
    node.request_stop()


async def test_unreachable_daemon_is_a_clear_error():
    async with AsyncClient("http://127.0.0.1:9") as c:
        with pytest.raises(RolloutdError) as err:
            await c.status()
        assert err.value.status == 0 and err.value.type == "unreachable"


async def test_request_stop_drains_and_returns(tmp_path):
    node = Node(make_settings(tmp_path, drain_timeout_s=0.5), services=Services())
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        async with AsyncClient(node.urls[0]) as c:
            quick = await c.submit(sleep_task(run_s=0.05))
            slow = await c.submit(sleep_task(run_s=30))
            await trio.sleep(0.2)
            node.request_stop()
            with trio.fail_after(15):
                trajs = {t.id: t async for t in c.stream(quick.ids + slow.ids)}
    assert trajs[quick.ids[0]].status.value == "completed"
    assert trajs[slow.ids[0]].status.value == "cancelled"
    assert node.draining and not node.ready


async def test_keep_alive_survives_early_error_answers(nursery, tmp_path):
    """A 401/405/413 answered before the body is read must not wedge the connection."""
    node = Node(make_settings(tmp_path, token="tok", max_body_bytes=4096), services=Services())
    await nursery.start(node.run)
    import httpx

    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=node.urls[0], limits=limits, timeout=5) as h:
        auth = {"Authorization": "Bearer tok"}
        with trio.fail_after(20):
            assert (await h.request("TRACE", "/v1/policy_version", json={"version": 1}, headers=auth)).status_code == 405
            assert (await h.put("/v1/policy_version", json={"version": 1})).status_code == 401
            assert (await h.request("OPTIONS", "/v1/status", json={"x": 1}, headers=auth)).status_code == 200
            assert (await h.post("/v1/rollouts", content=b"x" * 100_000, headers=auth)).status_code == 413
            for _ in range(3):
                assert (await h.get("/v1/status", headers=auth)).status_code == 200
    node.request_stop()
