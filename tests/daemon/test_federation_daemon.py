"""Three real daemons (in one process, real loopback HTTP) federated: placement, forwarding,
results and cancels through the front, and a dying peer's rollouts failing explicitly."""

from __future__ import annotations

import socket
from collections import Counter

import httpx
import trio

from rolloutd.daemon.client import AsyncClient
from rolloutd.daemon.llm.pool import BackendPool, make_backend
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services
from rolloutd.daemon.trajectory import Stage
from rolloutd.federation import (
    TOOK_AT_HEADER,
    auth_headers,
    forward_headers,
    ids_headers,
    image_homes,
    took_at,
)

from .conftest import make_settings, sleep_task


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


async def start_cluster(tmp_path, nursery, n: int = 3, *, stealing: bool = True,
                        gossip_interval_s: float = 0.1) -> list[tuple[Node, trio.CancelScope]]:
    ports = free_ports(n)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    nodes = []
    for i, port in enumerate(ports):
        settings = make_settings(
            tmp_path / f"n{i}", port=port, node_id=f"node{i}", url=urls[i], seeds=urls, token="fedtok",
            n_init=1, n_run=1, n_eval=1, gossip_interval_s=gossip_interval_s, work_stealing=stealing,
        )
        # Placement only sends work to peers with a healthy LLM backend: give each one.
        pool = BackendPool(health_interval_s=0.5)
        await nursery.start(pool.run)
        pool.add(make_backend({"kind": "scripted", "replies": ["unused"]}), backend_id="scripted")
        node = Node(settings, services=Services(pool=pool))
        scope_holder: list[trio.CancelScope] = []

        async def run_scoped(node: Node = node, holder=scope_holder, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as scope:
                holder.append(scope)
                await node.run(task_status=task_status)

        await nursery.start(run_scoped)
        nodes.append((node, scope_holder[0]))
    with trio.fail_after(10):
        while not all(
            sum(m["state"] == "alive" for m in node.federation.members()) == n for node, _ in nodes
        ):
            await trio.sleep(0.05)
    return nodes


def executed(node: Node) -> int:
    return node.pipeline.stats[Stage.eval].finished


async def test_forwarding_runs_each_rollout_once_and_results_go_through_the_front(tmp_path, nursery):
    cluster = await start_cluster(tmp_path, nursery)
    front = cluster[0][0]
    async with AsyncClient(front.urls[0], token="fedtok") as c:
        ids = []
        for _ in range(30):
            ids += (await c.submit(sleep_task(run_s=0.2))).ids
        trajs = await c.wait(ids)
        assert [t.status.value for t in trajs] == ["completed"] * 30
        assert front.forwarder is not None and front.forwarder.forwarded_total > 0
        ran = [executed(node) for node, _ in cluster]
        assert sum(ran) == 30, ran
        assert all(r > 0 for r in ran), ran  # every daemon took a share
        # Each trajectory names the daemon that ran it.
        assert Counter(t.node_id for t in trajs) == {n.node_id: executed(n) for n, _ in cluster}
        remote = [i for i in ids if front.forwarder.node_of(i)]
        assert remote
        one = await c.get(remote[0])
        assert one.status.value == "completed"
        long = []
        for _ in range(6):
            long += (await c.submit(sleep_task(run_s=60))).ids
        remote_long = [i for i in long if front.forwarder.node_of(i)]
        assert remote_long
        await c.cancel(remote_long[0])
        [t] = await c.wait(remote_long[:1])
        assert t.status.value == "cancelled"
        for i in long:
            await c.cancel(i)
    for node, _ in cluster:
        node.request_stop()


async def test_a_dying_peer_fails_its_forwarded_rollouts_explicitly(tmp_path, nursery):
    cluster = await start_cluster(tmp_path, nursery)
    front = cluster[0][0]
    async with AsyncClient(front.urls[0], token="fedtok") as c:
        ids = []
        for _ in range(9):
            ids += (await c.submit(sleep_task(run_s=60))).ids
        victim, victim_scope = cluster[2]
        on_victim = [i for i in ids if front.forwarder.node_of(i) == victim.node_id]
        assert on_victim
        victim_scope.cancel()  # the peer goes away abruptly (its jobs die with it)
        with trio.fail_after(20):
            lost = [t async for t in c.stream(on_victim)]
        assert {t.status.value for t in lost} == {"failed"}
        assert {t.error.type for t in lost} == {"peer_lost"}
        assert all(not t.usable for t in lost)
        for i in ids:
            if i not in on_victim:
                await c.cancel(i)
    for node, _ in cluster[:2]:
        node.request_stop()


async def test_peers_with_the_wrong_token_do_not_join(tmp_path, nursery):
    ports = free_ports(2)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    nodes = []
    for i, (port, token) in enumerate(zip(ports, ["a", "b"], strict=True)):
        node = Node(make_settings(tmp_path / f"w{i}", port=port, node_id=f"w{i}", url=urls[i], seeds=urls,
                                  token=token, gossip_interval_s=0.1), services=Services())
        await nursery.start(node.run)
        nodes.append(node)
    await trio.sleep(1.0)
    for node in nodes:
        assert [m["node_id"] for m in node.federation.members() if m["state"] == "alive"] == [node.node_id]
        node.request_stop()


async def test_status_federation_prints_the_member_table(tmp_path, nursery, monkeypatch, capsys):
    from rolloutd.daemon.cli import main

    cluster = await start_cluster(tmp_path, nursery)
    front = cluster[0][0]
    monkeypatch.setenv("ROLLOUTD_TOKEN", "fedtok")
    rc = await trio.to_thread.run_sync(main, ["status", "--federation", "--url", front.urls[0]])
    out = capsys.readouterr().out
    assert rc == 0
    for node, _ in cluster:
        assert node.node_id in out
    assert "alive" in out
    text = " ".join(out.split())  # the gossip line may wrap at the terminal's width
    assert "gossip:" in text and "0 refused" in text and "over UDP)" in text
    for node, _ in cluster:
        node.request_stop()


async def test_status_and_metrics_show_gossip_counters_and_members_by_state(tmp_path, nursery):
    """An operator sees the gossip (rounds, exchanges, failures, refused tokens) and the
    members by state in GET /v1/status and /metrics, not only in the logs."""
    from prometheus_client.parser import text_string_to_metric_families

    cluster = await start_cluster(tmp_path, nursery)
    front = cluster[0][0]
    async with httpx.AsyncClient(base_url=front.urls[0], headers=auth_headers("fedtok")) as http:
        await trio.sleep(0.5)  # a few rounds at 0.1 s
        fed = (await http.get("/v1/status")).json()["federation"]
        assert fed["states"] == {"alive": 3, "suspect": 0, "dead": 0, "left": 0}
        gossip = fed["gossip"]
        assert set(gossip) == {"rounds", "exchanges", "datagram_exchanges", "answered", "failures",
                               "auth_failures", "refutations"}
        assert gossip["rounds"] >= 3 and gossip["exchanges"] >= 1 and gossip["answered"] >= 1
        assert gossip["datagram_exchanges"] >= 1  # real daemons on loopback gossip over UDP
        assert gossip["auth_failures"] == 0
        metrics = (await http.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    members = {s.labels["state"]: s.value for s in families["rolloutd_federation_members"].samples}
    assert members == {"alive": 3, "suspect": 0, "dead": 0, "left": 0}
    for name in ("gossip_rounds", "gossip_exchanges", "gossip_datagram_exchanges", "gossip_answered"):
        (sample,) = [s for s in families[f"rolloutd_federation_{name}"].samples if s.name.endswith("_total")]
        assert sample.value >= 1, name
    for name in ("gossip_auth_failures", "forwarded", "relay_probes", "taken_over", "handed_over"):
        assert f"rolloutd_federation_{name}" in families, name
    assert "rolloutd_federation_forwarded_open" in families
    for node, _ in cluster:
        node.request_stop()


async def test_a_peer_with_another_token_shows_as_refused_gossip(tmp_path, nursery):
    """A member started with another token: the refused exchanges are counted, so the
    operator's alert (`rolloutd_federation_gossip_auth_failures_total`) fires."""
    port, other = free_ports(2)
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{other}"]
    nodes = []
    for i, (p, token) in enumerate(((port, "tok-a"), (other, "tok-b"))):
        settings = make_settings(tmp_path / f"t{i}", port=p, node_id=f"t{i}", url=urls[i], seeds=urls,
                                 token=token, gossip_interval_s=0.1)
        node = Node(settings, services=Services())
        await nursery.start(node.run)
        nodes.append(node)
    await trio.sleep(0.6)
    async with httpx.AsyncClient(base_url=urls[0], headers=auth_headers("tok-a")) as http:
        gossip = (await http.get("/v1/status")).json()["federation"]["gossip"]
    assert gossip["auth_failures"] >= 1 and gossip["exchanges"] == 0
    for node in nodes:
        node.request_stop()


async def test_a_daemon_with_gossip_udp_off_federates_over_http(tmp_path, nursery):
    """gossip_udp = false: that daemon opens no UDP socket and says so in its record, so its
    peer gossips with it over HTTP from the start, and over UDP with the others."""
    ports = free_ports(3)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    nodes = []
    for i, port in enumerate(ports):
        settings = make_settings(tmp_path / f"u{i}", port=port, node_id=f"u{i}", url=urls[i], seeds=urls,
                                 token="fedtok", gossip_interval_s=0.1, gossip_udp=i != 2)
        node = Node(settings, services=Services())
        await nursery.start(node.run)
        nodes.append(node)
    with trio.fail_after(10):
        while not all(sum(m["state"] == "alive" for m in n.federation.members()) == 3 for n in nodes):
            await trio.sleep(0.05)
    before = [n.federation.statistics().failures for n in nodes]  # seeds not up yet at the start
    await trio.sleep(0.5)
    stats = [n.federation.statistics() for n in nodes]
    assert stats[0].datagram_exchanges + stats[1].datagram_exchanges >= 1
    assert stats[2].datagram_exchanges == 0 and stats[2].exchanges >= 1
    rows = {m["node_id"]: m for m in nodes[0].federation.members()}
    assert (rows["u0"]["datagrams"], rows["u1"]["datagrams"], rows["u2"]["datagrams"]) == (True, True, False)
    assert [st.failures for st in stats] == before  # no datagram waited on u2 and timed out
    for node in nodes:
        node.request_stop()


async def test_every_gossip_setting_reaches_the_federation(tmp_path, nursery):
    """fanout, suspect_after_s, dead_after_s and request_timeout_s were rejected as unknown
    settings, and only gossip_interval_s was handed to the Federation (issue 15, 18)."""
    port, silent = free_ports(2)
    settings = make_settings(tmp_path, port=port, node_id="g", seeds=[f"http://127.0.0.1:{silent}"],
                             gossip_interval_s=0.2, fanout=7, suspect_after_s=0.9, dead_after_s=2.5,
                             request_timeout_s=0.4)
    node = Node(settings, services=Services())
    await nursery.start(node.run)
    assert node.federation is not None
    assert node.federation.gossip == settings.gossip
    assert (node.federation.gossip.fanout, node.federation.gossip.request_timeout_s) == (7, 0.4)
    node.request_stop()


async def test_a_forwarded_wait_whose_peer_dies_is_lost_and_never_rerun_on_the_front(tmp_path, nursery):
    """Issue 22: a wait=true rollout forwarded to a peer that then dies answers failed/peer_lost;
    the front never runs a copy (it used to re-run it when the open request broke)."""
    import httpx

    cluster = await start_cluster(tmp_path, nursery)
    front = cluster[0][0]
    assert front.forwarder is not None
    async with AsyncClient(front.urls[0], token="fedtok") as c:
        busy = []
        for _ in range(9):  # every slot of the three daemons (1 + 1 + 1 each) taken
            busy += (await c.submit(sleep_task(run_s=60))).ids
        before = set(front.forwarder.live.jobs_on(cluster[1][0].node_id)) | set(
            front.forwarder.live.jobs_on(cluster[2][0].node_id))
        answers: list[httpx.Response] = []

        async def wait_for_one() -> None:
            async with httpx.AsyncClient(timeout=60, headers={"Authorization": "Bearer fedtok"}) as http:
                answers.append(await http.post(f"{front.urls[0]}/v1/rollouts?wait=true",
                                               json={"task": sleep_task(run_s=60), "n": 2}))

        nursery.start_soon(wait_for_one)
        with trio.fail_after(10):
            while True:
                new = {node.node_id: set(front.forwarder.live.jobs_on(node.node_id)) - before
                       for node, _ in cluster[1:]}
                if any(new.values()):
                    break
                await trio.sleep(0.05)
        [(peer_id, waiting)] = [(k, v) for k, v in new.items() if v]
        peer, peer_scope = next((n, s) for n, s in cluster if n.node_id == peer_id)
        peer_scope.cancel()  # the peer dies with the request open
        with trio.fail_after(20):
            while not answers:
                await trio.sleep(0.05)
        [resp] = answers
        assert resp.status_code == 200, resp.text
        rollouts = resp.json()["rollouts"]
        assert {r["id"] for r in rollouts} == waiting
        assert {(r["status"], r["error"]["type"]) for r in rollouts} == {("failed", "peer_lost")}
        for job_id in waiting:  # no copy on the front, and it answers the same later
            assert front.service.store.get(job_id) is None
            assert (await c.get(job_id)).error.type == "peer_lost"
        for i in busy:
            if front.forwarder.node_of(i) != peer_id:
                await c.cancel(i)
    for node, _ in cluster:
        if node is not peer:
            node.request_stop()


async def submit_here(node: Node, task: dict, n: int) -> list[str]:
    """Submit to ``node`` itself (the forwarded mark: no placement), as a front would."""
    import httpx

    async with httpx.AsyncClient(headers={"Authorization": "Bearer fedtok",
                                          "X-Rolloutd-Forwarded": "1"}) as http:
        resp = await http.post(f"{node.urls[0]}/v1/rollouts", json={"task": task, "n": n})
        assert resp.status_code == 202, resp.text
        return list(resp.json()["ids"])


async def test_idle_daemons_steal_queued_rollouts_exactly_once_keeping_their_ids(tmp_path, nursery):
    """Issue 22: 12 rollouts queued on one daemon (1 slot each) are taken over by the idle
    peers under the same ids; each runs once, and the daemon that had them answers for them
    with the trajectory of the node that ran it."""
    cluster = await start_cluster(tmp_path, nursery)
    busy = cluster[1][0]
    ids = await submit_here(busy, sleep_task(run_s=0.3), 12)
    async with AsyncClient(busy.urls[0], token="fedtok") as c:
        with trio.fail_after(30):
            trajs = await c.wait(ids)
    assert [t.id for t in trajs] == ids
    assert {t.status.value for t in trajs} == {"completed"}
    ran = {n.node_id: executed(n) for n, _ in cluster}
    assert sum(ran.values()) == 12, ran  # none ran twice
    by_node = Counter(t.node_id for t in trajs)
    assert by_node == {k: v for k, v in ran.items() if v}, (by_node, ran)
    assert by_node[busy.node_id] < 12 and len(by_node) >= 2  # the idle peers took some
    assert busy.front.stealer is not None
    stats = busy.front.stealer.statistics()
    assert stats["handed_over"] == 12 - ran[busy.node_id]
    assert sum(n.front.stealer.statistics()["taken_over"] for n, _ in cluster) == stats["handed_over"]
    thief = next(n for n, _ in cluster if n is not busy and ran[n.node_id])
    stolen = next(t.id for t in trajs if t.node_id == thief.node_id)
    async with AsyncClient(thief.urls[0], token="fedtok") as c:  # it has it under the same id
        assert (await c.get(stolen)).status.value == "completed"
    async with AsyncClient(busy.urls[0], token="fedtok") as c:  # so does the daemon that had it
        assert (await c.get(stolen)).node_id == thief.node_id
    for node, _ in cluster:
        node.request_stop()


async def test_a_thief_that_dies_loses_what_it_took_and_nobody_reruns_it(tmp_path, nursery):
    cluster = await start_cluster(tmp_path, nursery, n=2)
    (busy, _), (thief, thief_scope) = cluster
    ids = await submit_here(busy, sleep_task(run_s=60), 4)
    assert busy.front.stealer is not None and busy.forwarder is not None
    with trio.fail_after(10):
        while not busy.forwarder.live.jobs_on(thief.node_id):
            await trio.sleep(0.05)
    taken = busy.forwarder.live.jobs_on(thief.node_id)
    thief_scope.cancel()  # the thief dies abruptly while it runs them
    async with AsyncClient(busy.urls[0], token="fedtok") as c:
        with trio.fail_after(30):
            lost = await c.wait(taken)
        assert {(t.status.value, t.error.type) for t in lost} == {("failed", "peer_lost")}
        assert {t.node_id for t in lost} == {thief.node_id}
        assert executed(busy) == 0  # not re-run where it came from
        for i in ids:
            await c.cancel(i)
    busy.request_stop()


async def busy_with_a_ghost(tmp_path, nursery) -> Node:
    """One daemon that knows a live member "ghost" whose address refuses connections: a
    thief whose hand-overs provably never reach it."""
    [(busy, _)] = await start_cluster(tmp_path, nursery, n=1)
    [ghost_port] = free_ports(1)  # nothing listens there
    busy.federation.handle_gossip({"members": [{
        "node_id": "ghost", "url": f"http://127.0.0.1:{ghost_port}", "incarnation": 1, "heartbeat": 1,
        "capacity": {"free_slots": 8, "queued": 0, "in_flight": 0, "healthy_backends": 1,
                     "draining": False},
        "updated_at": 0.0, "state": "alive"}]})
    return busy


async def test_a_hand_over_that_never_reached_the_thief_queues_the_rollouts_again(tmp_path, nursery):
    """A 'thief' whose address refuses connections: the withdrawn rollouts provably never left,
    so they are queued again where they were (same ids), and nothing is lost."""
    from rolloutd.daemon.steal import StealRequest

    busy = await busy_with_a_ghost(tmp_path, nursery)
    ids = await submit_here(busy, sleep_task(run_s=60), 6)
    with trio.fail_after(10):  # 1 slot per stage: 1 runs, 2 wait through INIT, 3 queued
        while (busy.pipeline.statistics()["queued"], busy.pipeline.waiting) != (3, 2):
            await trio.sleep(0.05)
    assert busy.front.stealer is not None
    answer = await busy.front.stealer.give(StealRequest(node_id="ghost", max=8))
    assert answer == {"moved": []}
    stats = busy.pipeline.statistics()
    assert (stats["queued"], stats["waiting"], stats["handed_over"]) == (3, 2, 0)
    # half of the 5 unstarted, rounded up, the queued ones first
    assert busy.front.stealer.statistics()["taken_back"] == 3
    async with AsyncClient(busy.urls[0], token="fedtok") as c:
        for i in ids:
            assert (await c.get(i)).status.value in ("queued", "init", "run")
            await c.cancel(i)
    busy.request_stop()


async def test_a_thief_gets_no_rollout_whose_image_it_does_not_hold(tmp_path, nursery):
    """A rollout whose task names an image is handed only to a thief that says it holds the
    image: one that would unpack it first is no faster than the victim's next free worker.
    (The 'thief' refuses connections, so whatever is withdrawn is queued again and counted
    as taken back: that count is what the victim withdrew.)"""
    from rolloutd.daemon.steal import StealRequest

    busy = await busy_with_a_ghost(tmp_path, nursery)
    image = "oci:/nowhere/layout:t"  # a sleep task opens no sandbox: the image is never read
    ids = await submit_here(busy, sleep_task(run_s=60, image=image), 6)
    with trio.fail_after(10):  # 1 slot per stage: 1 runs, 2 wait through INIT, 3 queued
        while (busy.pipeline.statistics()["queued"], busy.pipeline.waiting) != (3, 2):
            await trio.sleep(0.05)
    stealer = busy.front.stealer
    assert stealer is not None
    for held in ([], ["oci:/elsewhere/layout:t"]):
        assert await stealer.give(StealRequest(node_id="ghost", max=8, images=held)) == {"moved": []}
        assert stealer.statistics()["taken_back"] == 0  # nothing was withdrawn
    answer = await stealer.give(StealRequest(node_id="ghost", max=8, images=[image]))
    assert answer == {"moved": []}
    assert stealer.statistics()["taken_back"] == 3  # half of the 5 unstarted, rounded up
    async with AsyncClient(busy.urls[0], token="fedtok") as c:
        for i in ids:
            await c.cancel(i)
    busy.request_stop()


async def test_only_a_thief_that_holds_a_task_s_image_steals_its_rollouts(tmp_path, nursery):
    """End to end: each thief's ask carries the image refs it holds (here node1 is made to
    hold the tasks' image; node2 holds none, its prefetch of the made-up ref fails), so the
    queued rollouts move to node1 only."""
    cluster = await start_cluster(tmp_path, nursery)
    (busy, _), (holder, _), (other, _) = cluster
    image = "oci:/nowhere/layout:t"  # a sleep task opens no sandbox: the image is never read
    assert holder.front.stealer is not None
    holder.front.stealer._held_images = lambda: [image]
    ids = await submit_here(busy, sleep_task(run_s=0.3, image=image), 10)
    async with AsyncClient(busy.urls[0], token="fedtok") as c:
        with trio.fail_after(30):
            trajs = await c.wait(ids)
    assert {t.status.value for t in trajs} == {"completed"}
    by_node = Counter(t.node_id for t in trajs)
    assert by_node[holder.node_id] > 0 and by_node[other.node_id] == 0, by_node
    assert other.images.held() == []
    for node, _ in cluster:
        node.request_stop()


async def test_a_peer_that_gave_nothing_is_asked_again_only_once_its_report_changes(tmp_path, nursery):
    """An idle thief asks a busy peer; one that gave nothing (here: its rollouts name an image
    the thief does not hold) is asked again only once its capacity report differs, not at
    each heartbeat with the same report (that was one ask a second, and a poll 5 times a
    second before it). The asks go to the busiest daemons, and each takes some of their CPU."""
    cluster = await start_cluster(tmp_path, nursery, n=2, gossip_interval_s=1.0)
    (busy, _), (thief, _) = cluster
    task = sleep_task(run_s=60, image="oci:/nowhere/layout:t")
    ids = await submit_here(busy, task, 6)
    assert thief.front.stealer is not None
    stats = thief.front.stealer.statistics
    with trio.fail_after(10):
        while not stats()["steal_asks"]:
            await trio.sleep(0.05)
    await trio.sleep(2.0)  # the busy daemon's jobs settle where they wait (a report or two)
    first = stats()["steal_asks"]
    await trio.sleep(3.0)  # three heartbeats of the busy daemon, each with the same report
    assert stats()["steal_asks"] == first
    ids += await submit_here(busy, task, 1)  # its next report counts one more queued
    with trio.fail_after(10):
        while stats()["steal_asks"] == first:
            await trio.sleep(0.05)
    await trio.sleep(2.0)
    assert stats()["steal_asks"] == first + 1
    assert busy.front.stealer is not None and busy.front.stealer.statistics()["taken_back"] == 0
    async with AsyncClient(busy.urls[0], token="fedtok") as c:
        for i in ids:
            await c.cancel(i)
    for node, _ in cluster:
        node.request_stop()


class StepCounter(trio.abc.Instrument):
    """Counts the steps of the tasks whose name contains ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.name in task.name:
            self.steps += 1


async def test_an_idle_thief_sleeps(tmp_path, nursery):
    """The thief's loop runs only when this daemon has room and a peer's report changed: in
    an idle federation (every report the same) it does not wake at all, where polling every
    steal_interval_s (0.2 s) woke it 15 times in 3 s, about 2 ms of CPU a second."""
    cluster = await start_cluster(tmp_path, nursery, n=2, gossip_interval_s=0.5)
    (a, _), _ = cluster
    await trio.sleep(1.5)  # the first reports settle
    counter = StepCounter("Stealer.run")
    trio.lowlevel.add_instrument(counter)
    try:
        await trio.sleep(3.0)  # six heartbeats each
    finally:
        trio.lowlevel.remove_instrument(counter)
    assert counter.steps <= 2, counter.steps
    assert a.front.stealer is not None and a.front.stealer.statistics()["steal_asks"] == 0
    for node, _ in cluster:
        node.request_stop()


async def test_the_stealing_routes_answer_bad_input_with_a_clear_4xx(tmp_path, nursery):
    import httpx

    [(node, _)] = await start_cluster(tmp_path, nursery, n=1)
    alone = Node(make_settings(tmp_path / "alone", port=free_ports(1)[0]), services=Services())
    await nursery.start(alone.run)
    async with httpx.AsyncClient(headers={"Authorization": "Bearer fedtok"}) as http:
        url = node.urls[0]
        for path, body in [("steal", {"node_id": "x"}), ("steal", {"node_id": "x", "max": 0}),
                           ("steal", {"node_id": "x", "max": 1, "images": [""]}),
                           ("steal", {"node_id": "x", "max": 1, "images": ["a"] * 1025}),
                           ("adopt", {"origin": "x", "rollouts": [{"id": "r-1"}]}),
                           ("adopt", {"origin": "x", "rollouts": "no"})]:
            resp = await http.post(f"{url}/v1/federation/{path}", json=body)
            assert resp.status_code in (400, 422), (path, body, resp.status_code)
            assert resp.json()["error"]["message"]
        resp = await http.post(f"{url}/v1/federation/steal", json={"node_id": "stranger", "max": 3})
        assert resp.json() == {"moved": []}  # not a member: nothing moves
        # X-Rolloutd-Ids is honoured on a forwarded request only, and must be well formed
        resp = await http.post(f"{url}/v1/rollouts", json={"task": sleep_task(run_s=0), "n": 2},
                               headers={"X-Rolloutd-Forwarded": "1", "X-Rolloutd-Ids": "a,a"})
        assert resp.status_code == 400 and "repeats" in resp.json()["error"]["message"]
        resp = await http.post(f"{url}/v1/rollouts", json={"task": sleep_task(run_s=0), "n": 2},
                               headers={"X-Rolloutd-Forwarded": "1", "X-Rolloutd-Ids": "r-a1"})
        assert resp.status_code == 422 and "n=2" in resp.json()["error"]["message"]
        resp = await http.post(f"{url}/v1/rollouts", json={"task": sleep_task(run_s=0), "n": 1},
                               headers={"X-Rolloutd-Ids": "r-mine"})
        assert resp.status_code == 202 and resp.json()["ids"] != ["r-mine"]  # a client's: ignored
        resp = await http.post(f"{alone.urls[0]}/v1/federation/steal", json={"node_id": "x", "max": 1})
        assert resp.status_code == 404
    node.request_stop()
    alone.request_stop()


async def test_a_front_never_steals_back_what_it_forwarded(tmp_path, nursery):
    """The front forwards what it has no room for; when it is idle first it must not take
    those rollouts back (it would relay them from the peer that relays them from it: the
    bench's stream through the front never ended). Everything ends, through a stream."""
    cluster = await start_cluster(tmp_path, nursery, n=2)
    (front, _), (peer, _) = cluster
    async with AsyncClient(front.urls[0], token="fedtok") as c:
        ids = []
        for run_s in (0.1, 0.1, 0.1, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6):
            ids += (await c.submit(sleep_task(run_s=run_s))).ids
        assert front.forwarder is not None and front.forwarder.forwarded_total > 0
        with trio.fail_after(30):
            trajs = [t async for t in c.stream(ids)]
    assert sorted(t.id for t in trajs) == sorted(ids)
    assert {t.status.value for t in trajs} == {"completed"}
    assert front.front.stealer is not None and front.front.stealer.statistics()["taken_over"] == 0
    assert executed(front) + executed(peer) == 9
    for node, _ in cluster:
        node.request_stop()


async def test_a_peer_answers_a_forward_with_its_version_and_the_front_settles_every_placement(
    tmp_path, nursery
):
    """The version a peer took a forwarded rollout at is what lets the front keep debiting it
    from the peer's headroom until a report that counts it (tests/federation/test_placement.py)."""
    cluster = await start_cluster(tmp_path, nursery)
    front, peer = cluster[0][0], cluster[1][0]
    assert front.federation is not None and peer.federation is not None
    url = peer.urls[0] + "/v1/rollouts"
    async with httpx.AsyncClient() as http:
        before = peer.federation.version
        headers = {**forward_headers("fedtok"), **ids_headers(["r-took-at-1"], front.node_id)}
        resp = await http.post(url, json={"task": sleep_task(run_s=0.05)}, headers=headers)
        assert resp.status_code == 202, resp.text
        at = took_at(resp.headers)
        assert at is not None and before <= at <= peer.federation.version
        plain = await http.post(url, json={"task": sleep_task(run_s=0.05)}, headers=auth_headers("fedtok"))
        assert plain.status_code == 202 and TOOK_AT_HEADER not in plain.headers
    async with AsyncClient(front.urls[0], token="fedtok") as c:
        ids = []
        for _ in range(6):
            ids += (await c.submit(sleep_task(run_s=0.05), n=2)).ids  # groups of 2
        await c.wait(ids)
    assert front.forwarder is not None and front.forwarder.forwarded_total > 0
    assert [m.in_flight for m in front.federation.peers()] == [0, 0]  # every forward answered
    for node, _ in cluster:
        node.request_stop()


async def test_a_tasks_image_sends_its_rollouts_to_the_images_homes(tmp_path, nursery):
    """The front has room, but the task names an image whose homes are the two peers: the
    rollouts go there (a forward, not an unpack on one more node); a task without an image
    stays on the front while it has room. Stealing is off, so nothing moves afterwards.
    (The image ref is never opened: a sleep task has no sandbox.)"""
    cluster = await start_cluster(tmp_path, nursery, stealing=False)
    front = cluster[0][0]
    names = [node.node_id for node, _ in cluster]
    image = next(f"oci:/images/task{i}:latest" for i in range(1000)
                 if front.node_id not in image_homes(f"oci:/images/task{i}:latest", names))
    async with AsyncClient(front.urls[0], token="fedtok") as c:
        ids = []
        for _ in range(4):
            ids += (await c.submit(sleep_task(run_s=0.05, image=image))).ids
        trajs = await c.wait(ids)
        assert [t.status.value for t in trajs] == ["completed"] * 4
        assert {t.node_id for t in trajs} <= set(image_homes(image, names))
        [plain] = await c.wait((await c.submit(sleep_task(run_s=0.05))).ids)
        assert plain.node_id == front.node_id
    async with httpx.AsyncClient(base_url=front.urls[0], headers=auth_headers("fedtok")) as http:
        fed = (await http.get("/v1/status")).json()["federation"]
        assert fed["placements"] == {"image_home": 4, "image_spilled": 0}
        metrics = (await http.get("/metrics")).text
    assert "rolloutd_federation_image_home_placements_total 4.0" in metrics
    assert "rolloutd_federation_image_spilled_placements_total 0.0" in metrics
    for node, _ in cluster:
        node.request_stop()


def mixed_prompt(run_s: float, **kw) -> dict:
    """A sleep task whose group of 2 has rewards 0 and 1 (kept by the DAPO rule)."""
    return sleep_task(run_s=run_s, rewards=[0, 1], **kw)


async def test_a_batchs_groups_are_placed_across_the_federation(tmp_path, nursery):
    """A batch sent to one daemon of three (1 slot per stage each, stealing off) runs its
    groups where placement puts them, as a client's submits would be: the front while it
    has room, the peers after. Each group runs whole on one node, once; the front judges
    and streams every group, and counts what it placed."""
    cluster = await start_cluster(tmp_path, nursery, stealing=False)
    front = cluster[0][0]
    prompts = [mixed_prompt(0.3) for _ in range(9)]
    async with AsyncClient(front.urls[0], token="fedtok") as c:
        with trio.fail_after(30):
            groups = [g async for g in c.sample_batch(prompts, group_size=2, keep=9,
                                                      max_in_flight_groups=9)]
        assert len(groups) == 9
        trajs = [t for g in groups for t in g.rollouts]
        assert {t.status.value for t in trajs} == {"completed"}
        assert all(len({t.node_id for t in g.rollouts}) == 1 for g in groups)  # whole groups
        ran = {node.node_id: executed(node) for node, _ in cluster}
        assert sum(ran.values()) == 18, ran  # none ran twice
        assert Counter(t.node_id for t in trajs) == {k: v for k, v in ran.items() if v}
        assert all(ran.values()), ran  # every daemon took a share
        assert {t.batch_id for t in trajs} == {groups[0].rollouts[0].batch_id}
        remote = next(t for t in trajs if t.node_id != front.node_id)
        assert (await c.get(remote.id)).node_id == remote.node_id  # the front answers for it
    assert front.front.stealer is not None
    placed = 18 - ran[front.node_id]
    assert front.front.stealer.statistics()["batch_placed"] == placed
    assert sum(n.front.stealer.statistics()["taken_over"] for n, _ in cluster) == placed
    async with httpx.AsyncClient(base_url=front.urls[0], headers=auth_headers("fedtok")) as http:
        assert (await http.get("/v1/status")).json()["federation"]["batch_placed"] == placed
        metrics = (await http.get("/metrics")).text
    assert f"rolloutd_federation_batch_placed_total {placed}.0" in metrics
    for node, _ in cluster:
        node.request_stop()


async def test_a_batchs_groups_with_an_image_go_to_the_images_homes(tmp_path, nursery):
    """The front has room, but the batch's tasks name an image whose homes are the two
    peers: every group runs there, and the front prefetches nothing for them. (The image
    ref is never opened: a sleep task has no sandbox.)"""
    cluster = await start_cluster(tmp_path, nursery, stealing=False)
    front = cluster[0][0]
    names = [node.node_id for node, _ in cluster]
    image = next(f"oci:/images/task{i}:latest" for i in range(1000)
                 if front.node_id not in image_homes(f"oci:/images/task{i}:latest", names))
    prompts = [mixed_prompt(0.05, image=image) for _ in range(4)]
    async with AsyncClient(front.urls[0], token="fedtok") as c:
        with trio.fail_after(30):  # one group at a time: the sampler prefetches the next one's
            groups = [g async for g in c.sample_batch(prompts, group_size=2, keep=4,
                                                      max_in_flight_groups=1)]
    nodes = {t.node_id for g in groups for t in g.rollouts}
    assert len(groups) == 4 and nodes <= set(image_homes(image, names)), nodes
    assert executed(front) == 0
    assert front.federation is not None
    assert front.federation.statistics().placements == {"image_home": 4, "image_spilled": 0}
    assert front.images.statistics()["prefetched"] + front.images.statistics()["prefetch_failed"] == 0
    for node, _ in cluster:
        node.request_stop()


async def test_a_batch_group_on_a_peer_that_dies_is_filtered_never_rerun(tmp_path, nursery):
    """Groups placed on a peer that is then killed end failed/peer_lost there: the batch
    filters them (reason infrastructure, never reward 0) and runs on; nothing runs twice."""
    cluster = await start_cluster(tmp_path, nursery, n=2, stealing=False)
    (front, _), (peer, peer_scope) = cluster
    prompts = [mixed_prompt(60) for _ in range(4)]
    async with AsyncClient(front.urls[0], token="fedtok") as c:
        batch = await c.create_batch(prompts, group_size=2, keep=4)
        assert front.front.stealer is not None
        with trio.fail_after(10):
            while not (front.forwarder is not None and front.forwarder.live.jobs_on(peer.node_id)):
                await trio.sleep(0.05)
        on_peer = set(front.forwarder.live.jobs_on(peer.node_id))
        peer_scope.cancel()  # the peer dies abruptly while it runs them
        with trio.fail_after(30):
            while True:
                status = await c.batch_status(batch["id"])
                if status["filtered_reasons"].get("infrastructure", 0) * 2 >= len(on_peer):
                    break
                await trio.sleep(0.1)
        assert status["kept"] == 0
        lost = [t for t in (await c.wait(sorted(on_peer)))]
        assert {(t.status.value, t.error.type) for t in lost} == {("failed", "peer_lost")}
        assert all(g["reason"] == "infrastructure" and "peer_lost" in g["detail"]
                   for g in status["filtered_groups"])
        assert executed(front) == 0  # not re-run on the front
        await c.cancel_batch(batch["id"])
    front.request_stop()


async def test_a_batch_asks_the_homes_of_a_coming_groups_image_to_fetch_it_ahead(tmp_path, nursery):
    """One group at a time: while the first runs (no image), the sampler prefetches the next
    prompt's image, which lives on the two peers: the front asks them (POST
    /v1/federation/prefetch) and fetches nothing itself. The batch is cancelled before that
    group starts, so only the ask can have made the peers try. (The ref names no real image:
    each try fails, and is counted.)"""
    cluster = await start_cluster(tmp_path, nursery, stealing=False)
    front = cluster[0][0]
    names = [node.node_id for node, _ in cluster]
    image = next(f"oci:/images/task{i}:latest" for i in range(1000)
                 if front.node_id not in image_homes(f"oci:/images/task{i}:latest", names))
    prompts = [mixed_prompt(60), mixed_prompt(0.05, image=image)]
    async with AsyncClient(front.urls[0], token="fedtok") as c:
        batch = await c.create_batch(prompts, group_size=2, keep=2, max_in_flight_groups=1)
        peers = [node for node, _ in cluster if node is not front]
        with trio.fail_after(10):
            while not all(p.images.statistics()["prefetch_failed"] for p in peers):
                await trio.sleep(0.05)
        assert (await c.batch_status(batch["id"]))["tried"] == 1  # the image's group never started
        await c.cancel_batch(batch["id"])
    assert front.images.statistics()["prefetch_failed"] == 0
    for node, _ in cluster:
        node.request_stop()


async def test_the_prefetch_route_answers_bad_input_with_a_clear_4xx(tmp_path, nursery):
    cluster = await start_cluster(tmp_path, nursery, n=2)
    peer = cluster[1][0]
    async with httpx.AsyncClient(base_url=peer.urls[0], headers=auth_headers("fedtok")) as http:
        for body in ({}, {"images": []}, {"images": [""]}, {"images": ["x"], "more": 1},
                     {"images": ["x"] * 257}):
            resp = await http.post("/v1/federation/prefetch", json=body)
            assert resp.status_code in (400, 422) and "error" in resp.json(), (body, resp.text)
        resp = await http.post("/v1/federation/prefetch", json={"images": ["oci:/nowhere:1"]})
        assert resp.status_code == 202 and resp.json() == {"prefetching": 1}
    async with httpx.AsyncClient(base_url=peer.urls[0]) as http:  # no token
        resp = await http.post("/v1/federation/prefetch", json={"images": ["oci:/nowhere:1"]})
        assert resp.status_code == 401
    for node, _ in cluster:
        node.request_stop()


async def test_a_peer_takes_forwarded_submits_in_one_request_each_answered_on_its_own(tmp_path, nursery):
    """POST /v1/federation/submit: each submit is taken (or refused) as a forwarded POST
    /v1/rollouts of it would be, under the ids the front chose; a retry of the request makes
    no second copy; the answer carries the peer's version after it took them."""
    cluster = await start_cluster(tmp_path, nursery)
    front, peer = cluster[0][0], cluster[1][0]
    assert peer.federation is not None
    url = peer.urls[0] + "/v1/federation/submit"
    body = {"origin": front.node_id, "submits": [
        {"ids": ["r-fs-1"], "request": {"task": sleep_task(run_s=0.05), "idempotency_key": "fwd-1"}},
        {"ids": ["r-fs-2"], "request": {"task": sleep_task(), "n": "two"}},
        {"ids": ["r-fs-3", "r-fs-4"], "request": {"task": sleep_task(run_s=0.05), "n": 2,
                                                  "idempotency_key": "fwd-2"}},
        {"ids": ["r-fs-5"], "request": {"task": {"kind": "nope"}}},
        {"ids": ["r-fs-6"], "request": {"task": sleep_task(run_s=0.05), "n": 2}},  # 2 samples, 1 id
    ]}
    async with httpx.AsyncClient(headers=forward_headers("fedtok")) as http:
        before = peer.federation.version
        resp = await http.post(url, json=body)
        assert resp.status_code == 200, resp.text
        at = took_at(resp.headers)
        assert at is not None and before <= at <= peer.federation.version
        answers = resp.json()["answers"]
        assert [a["status"] for a in answers] == [202, 422, 202, 422, 422]
        assert answers[0]["body"]["ids"] == ["r-fs-1"] and answers[0]["body"]["replayed"] is False
        assert answers[2]["body"]["ids"] == ["r-fs-3", "r-fs-4"]
        assert [answers[k]["body"]["error"]["type"] for k in (1, 3, 4)] == [
            "invalid_request", "invalid_task", "invalid_task"]
        for job_id in ("r-fs-1", "r-fs-3"):
            assert peer.service.get(job_id).forwarded_from == front.node_id
        again = (await http.post(url, json=body)).json()["answers"]  # the front's retry
        assert [a["status"] for a in again] == [202, 422, 202, 422, 422]
        assert again[0]["body"]["replayed"] and again[2]["body"]["ids"] == ["r-fs-3", "r-fs-4"]
        taken = {"ids": ["r-fs-1"], "request": {"task": sleep_task(run_s=0.05)}}  # id in use
        [used] = (await http.post(url, json={"origin": "x", "submits": [taken]})).json()["answers"]
        assert used["status"] == 409 and used["body"]["error"]["type"] == "idempotency_conflict"
        for bad in ({"origin": "x", "submits": []},
                    {"origin": "x", "submits": [taken, taken]},  # an id twice
                    {"origin": "x", "submits": [{"ids": ["bad id"], "request": {}}]},
                    {"origin": "x", "submits": [{"ids": ["r-fs-9"], "request": {}}] * 65}):
            r = await http.post(url, json=bad)
            assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request", r.text
    for node, _ in cluster:
        node.request_stop()


async def test_a_burst_of_submits_reaches_each_peer_in_a_few_requests(tmp_path, nursery):
    """A front with its slots full forwards a burst of single submits; those it takes in while
    a request to a peer is open go to that peer together. Each runs once, under its id."""
    cluster = await start_cluster(tmp_path, nursery)
    front = cluster[0][0]
    assert front.forwarder is not None
    async with AsyncClient(front.urls[0], token="fedtok") as c:
        ids: list[str] = []

        async def submit() -> None:
            ids.extend((await c.submit(sleep_task(run_s=0.05))).ids)

        async with trio.open_nursery() as burst:
            for _ in range(40):
                burst.start_soon(submit)
        trajs = await c.wait(ids)
    assert sorted(t.id for t in trajs) == sorted(ids) and len(ids) == 40
    assert {t.status.value for t in trajs} == {"completed"}
    assert sum(executed(node) for node, _ in cluster) == 40
    stats = front.forwarder.statistics()
    assert stats["forwarded_total"] > stats["submit_requests"] > 0, stats
    for node, _ in cluster:
        node.request_stop()
