"""Gossip membership on virtual time (autojump_clock) over the in-process network."""

from __future__ import annotations

import math

import pytest
import trio

from rolloutd.federation import Federation, MemberState
from rolloutd.federation.testing import InProcessNetwork

from .conftest import Cap, open_cluster


async def test_three_members_converge_within_two_intervals(autojump_clock):
    async with open_cluster() as c:
        t0 = trio.current_time()
        for name in ("a", "b", "c"):
            await c.start(name)  # each seeded with "a" only
        done = await c.wait_converged()
        # b and c meet a in their first exchange; a passes each on in its next round.
        assert done - t0 <= 2 * 1.1
        views = [n.view() for n in c.nodes.values()]
        assert all(v == {"a": "alive", "b": "alive", "c": "alive"} for v in views)


async def test_32_members_from_one_seed_converge_in_logarithmic_rounds(autojump_clock):
    # The daemon's suspicion timing (5 s, 15 s), not this module's fast 3 s: a member whose
    # heartbeat news is 3 rounds old is suspected, and at 32 members with fanout 3 (less the
    # exchanges peers started) that happens now and then, which would be counted as slow
    # dissemination (10 of 150 runs took 4.8-7.8 s that way; 0 of 300 with 5 s).
    async with open_cluster(fanout=3, suspect_after_s=5.0, dead_after_s=15.0) as c:
        t0 = trio.current_time()
        for i in range(32):
            await c.start(f"n{i:02d}")
        done = await c.wait_converged(step=0.1)
        rounds = (done - t0) / 1.0
        # Push-pull with fanout 3 spreads a view in about log_3(n) rounds.
        assert rounds <= math.log(32, 3) + 1, rounds  # measured: 2.05


async def test_an_exchange_a_peer_started_counts_towards_the_fanout(autojump_clock):
    """Push-pull syncs both tables, so a member contacts `fanout` less the peers that
    contacted it since its last round: each still takes part in about `fanout` exchanges a
    round, with about half the requests (every member contacting 3 would make 6 a round)."""
    async with open_cluster(fanout=3) as c:
        for i in range(8):
            await c.start(f"n{i}")
        await c.wait_converged(step=0.1)
        before = {name: n.fed.statistics() for name, n in c.nodes.items()}
        await trio.sleep(20.0)
        after = {name: n.fed.statistics() for name, n in c.nodes.items()}
        rounds = sum(after[k].rounds - before[k].rounds for k in after)
        started = sum(after[k].exchanges - before[k].exchanges for k in after)
        answered = sum(after[k].answered - before[k].answered for k in after)
        assert started == answered  # every exchange has one side that started it
        assert 1.0 <= started / rounds <= 2.0, started / rounds  # measured: 1.66
        assert 2 * started / rounds >= 2.5  # exchanges each member takes part in, a round
        assert all(v == "alive" for n in c.nodes.values() for v in n.view().values())


async def test_killed_peer_is_suspected_then_declared_dead(autojump_clock):
    async with open_cluster(gossip_interval_s=1.0, suspect_after_s=3.0, dead_after_s=6.0) as c:
        a = await c.start("a")
        await c.start("b")
        await c.start("c")
        await c.wait_converged()
        await trio.sleep(2.5)
        t_kill = trio.current_time()
        c.kill("c")

        seen: dict[str, float] = {}
        while "dead" not in seen:
            state = a.view()["c"]
            seen.setdefault(state, trio.current_time())
            await trio.sleep(0.05)

        # Its last heartbeat reached a at most one gossip interval (+jitter) before the kill,
        # or up to one round after it, through b (a heard it from b, not from c).
        assert t_kill + 3.0 - 1.15 <= seen["suspect"] <= t_kill + 3.0 + 1.15
        assert t_kill + 6.0 - 1.15 <= seen["dead"] <= t_kill + 6.0 + 1.15
        assert seen["suspect"] < seen["dead"]
        # on_dead ran once, at the tick that noticed it (or earlier, through b's gossip).
        [(t_dead, member)] = a.dead
        assert member.node_id == "c" and member.state is MemberState.DEAD
        assert t_kill + 6.0 - 1.15 <= t_dead <= t_kill + 6.0 + 1.15
        # b agrees within a round (it may have heard c's last heartbeat a round after a
        # did: members take part in about `fanout` exchanges a round, not all of them),
        # and neither places work on c any more.
        with trio.fail_after(1.15):
            while c.nodes["b"].view()["c"] != "dead":
                await trio.sleep(0.05)
        for _ in range(20):
            a.cap.free_slots = 0
            peer = a.fed.place()
            assert peer is None or peer.node_id == "b"


async def test_graceful_stop_is_announced_as_left_at_once(autojump_clock):
    async with open_cluster() as c:
        a = await c.start("a")
        await c.start("b")
        await c.wait_converged()
        t_stop = trio.current_time()
        c.stop("b")
        await trio.sleep(0.01)
        assert a.view()["b"] == "left"
        [(t, member)] = a.dead
        assert member.state is MemberState.LEFT and t - t_stop < 0.01


async def test_restarted_member_rejoins_with_a_higher_incarnation(autojump_clock):
    async with open_cluster() as c:
        a = await c.start("a")
        old = await c.start("b", incarnation=7)
        await c.wait_converged()
        c.kill("b")
        while a.view()["b"] != "dead":
            await trio.sleep(0.1)
        # Same node id and URL, and (clock trouble) the same starting incarnation: it
        # hears its former self from a and outruns it.
        new = await c.start("b", incarnation=7)
        t_restart = trio.current_time()
        await c.wait_converged()
        assert trio.current_time() - t_restart <= 2 * 1.1
        assert new.fed.incarnation > 7
        assert old.fed.incarnation == 7
        row = next(m for m in a.fed.members() if m["node_id"] == "b")
        assert row["incarnation"] == new.fed.incarnation
        [(_, member)] = a.rejoined
        assert member.node_id == "b" and member.state is MemberState.ALIVE


async def test_a_member_refutes_suspicion_by_bumping_its_incarnation():
    fed = Federation("c", "http://c:1", capacity=Cap(), incarnation=5)
    me = next(m for m in fed.members() if m["self"])
    rumour = {**me, "state": "suspect"}
    del rumour["self"], rumour["last_heard_s"]
    answer = fed.handle_gossip({"protocol": 1, "members": [rumour]})
    [mine] = answer["members"]
    assert mine["incarnation"] == 6 and mine["state"] == "alive"
    assert fed.statistics().refutations == 1
    # A stale rumour (older incarnation) changes nothing.
    fed.handle_gossip({"protocol": 1, "members": [{**rumour, "state": "dead"}]})
    assert fed.incarnation == 6


async def test_suspicion_spreads_at_equal_version_and_a_new_heartbeat_clears_it():
    fed = Federation("a", "http://a:1", capacity=Cap())
    rec = {
        "node_id": "b",
        "url": "http://b:1",
        "incarnation": 1,
        "heartbeat": 10,
        "capacity": Cap()(),
        "updated_at": 0.0,
        "state": "alive",
    }
    fed.handle_gossip({"members": [rec]})
    assert fed.member("b").state is MemberState.ALIVE
    fed.handle_gossip({"members": [{**rec, "state": "suspect"}]})
    assert fed.member("b").state is MemberState.SUSPECT
    fed.handle_gossip({"members": [{**rec, "state": "alive"}]})  # same version: no effect
    assert fed.member("b").state is MemberState.SUSPECT
    fed.handle_gossip({"members": [{**rec, "heartbeat": 11}]})
    assert fed.member("b").state is MemberState.ALIVE


async def test_members_with_different_tokens_never_meet(autojump_clock):
    async with open_cluster() as c:
        a = await c.start("a", token="right")
        b = await c.start("b", token="right")
        x = await c.start("x", token="wrong", seeds=[a.fed.url])
        await trio.sleep(5)
        assert a.view() == {"a": "alive", "b": "alive"}
        assert b.view() == {"a": "alive", "b": "alive"}
        assert x.view() == {"x": "alive"}
        assert x.fed.statistics().auth_failures >= 5
        assert a.fed.statistics().auth_failures == 0


async def test_seed_that_starts_late_is_found(autojump_clock):
    async with open_cluster() as c:
        a = await c.start("a", seeds=["http://b:8000"])  # b is not up yet
        await trio.sleep(3)
        assert a.view() == {"a": "alive"}
        await c.start("b", seeds=[])
        await c.wait_converged()


async def test_run_starts_after_the_first_exchange_with_seeds(autojump_clock):
    net = InProcessNetwork(latency_s=0.25)
    a = Federation("a", "http://a:1", capacity=Cap(), transport=net.transport("http://a:1"))
    b = Federation(
        "b",
        "http://b:1",
        seeds=["http://a:1"],
        capacity=Cap(),
        transport=net.transport("http://b:1"),
    )
    net.add(a)
    net.add(b)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        t0 = trio.current_time()
        await nursery.start(b.run)
        assert trio.current_time() - t0 == pytest.approx(0.25)  # one exchange, then started()
        assert {m["node_id"] for m in b.members()} == {"a", "b"}
        nursery.cancel_scope.cancel()


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        Federation("a", "http://a:1", capacity=Cap(), suspect_after_s=0.5)
    with pytest.raises(ValueError):
        Federation("a", "http://a:1", capacity=Cap(), suspect_after_s=5, dead_after_s=5)
    with pytest.raises(ValueError):
        Federation("a", "http://a:1", capacity=Cap(), fanout=0)
    with pytest.raises(TypeError):
        Federation("a", "http://a:1", capacity=Cap(), seeds="http://b:1")  # type: ignore[arg-type]


async def test_news_is_a_changed_report_or_state_not_a_heartbeat(autojump_clock):
    """``wait_for_news`` (what a daemon with room for stolen work sleeps on) returns when a
    peer's capacity report changes or a peer's state does, and not at heartbeats that
    report the same capacity: an idle federation wakes no one."""
    async with open_cluster() as c:
        a = await c.start("a")
        b = await c.start("b")
        await c.wait_converged()
        await trio.sleep(2.0)  # the first reports settle

        async def news_within(seconds: float) -> bool:
            with trio.move_on_after(seconds):
                await a.fed.wait_for_news()
                return True
            return False

        assert not await news_within(5.0)  # five heartbeats of b, each the same report
        b.cap.queued = 3
        t0 = trio.current_time()
        assert await news_within(5.0)  # b's next report, within about a round
        assert trio.current_time() - t0 <= 2 * 1.1
        assert not await news_within(3.0)
        c.kill("b")
        assert await news_within(10.0)  # b suspected (3 s of silence), then dead
