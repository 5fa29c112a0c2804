"""Real loopback HTTP: hypercorn serving a stub of the daemon's routes, real Federations."""

from __future__ import annotations

import httpx
import trio

from rolloutd.federation import FORWARDED_HEADER, MEMBERS_PATH

from .conftest import open_servers

FAST = {
    "gossip_interval_s": 0.05,
    "suspect_after_s": 2.0,
    "dead_after_s": 4.0,
    "request_timeout_s": 1.0,
}


async def wait_for(predicate, timeout_s: float = 10.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.02)


def alive_view(server) -> set[str]:
    return {m["node_id"] for m in server.stub.fed.members() if m["state"] == "alive"}


async def test_three_daemons_converge_over_http_with_a_token():
    async with open_servers(3, tokens=["s3cret"] * 3, **FAST) as servers:
        t0 = trio.current_time()
        await wait_for(lambda: all(alive_view(s) == {"node0", "node1", "node2"} for s in servers))
        assert trio.current_time() - t0 < 5.0
        async with httpx.AsyncClient() as client:
            resp = await client.get(
                servers[1].url + MEMBERS_PATH, headers={"Authorization": "Bearer s3cret"}
            )
            assert resp.status_code == 200
            assert [m["node_id"] for m in resp.json()["members"]] == ["node0", "node1", "node2"]
            refused = await client.get(servers[1].url + MEMBERS_PATH)
            assert refused.status_code == 401


async def test_a_peer_with_the_wrong_token_is_refused_over_http():
    async with open_servers(3, tokens=["s3cret", "s3cret", "guess"], **FAST) as servers:
        await wait_for(lambda: alive_view(servers[0]) == {"node0", "node1"})
        await wait_for(lambda: servers[2].stub.fed.statistics().auth_failures >= 3)
        await trio.sleep(0.3)
        assert alive_view(servers[0]) == {"node0", "node1"}
        assert alive_view(servers[2]) == {"node2"}
        assert servers[0].stub.fed.statistics().auth_failures == 0


async def test_front_forwards_when_full_and_the_peer_never_forwards_again():
    async with open_servers(2, tokens=["t", "t"], **FAST) as servers:
        front, peer = servers
        front.stub.cap.free_slots = 0
        peer.stub.cap.free_slots = 0  # full too: a forwarded job still runs there
        peer.stub.cap.queued = 0
        front.stub.cap.queued = 5  # front's queue is longer: forward
        await wait_for(lambda: alive_view(front) == {"node0", "node1"})
        await trio.sleep(0.2)  # fresh capacity reports
        async with httpx.AsyncClient(headers={"Authorization": "Bearer t"}) as client:
            answers = [
                (await client.post(front.url + "/v1/rollouts", json={"id": f"j{i}"})).json()
                for i in range(4)
            ]
            # A forwarded request arriving at a node is never forwarded again, even from a
            # node that would otherwise place it elsewhere.
            direct = await client.post(
                front.url + "/v1/rollouts", json={"id": "fwd"}, headers={FORWARDED_HEADER: "1"}
            )
        assert direct.json()["ran_on"] == "node0"
        assert all(a["ran_on"] == "node1" and a["via"] == "node0" for a in answers)
        executed = front.stub.executed + peer.stub.executed
        assert sorted(executed) == ["fwd", "j0", "j1", "j2", "j3"]  # each exactly once


async def test_a_stopped_daemon_is_seen_as_left_over_http():
    async with open_servers(3, tokens=[None] * 3, **FAST) as servers:
        await wait_for(lambda: all(len(alive_view(s)) == 3 for s in servers))
        servers[2].scope.cancel()
        await wait_for(
            lambda: (
                {m["node_id"]: m["state"] for m in servers[0].stub.fed.members()}["node2"] == "left"
            ),
            timeout_s=3.0,
        )
