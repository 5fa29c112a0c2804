"""Placement: run locally or forward to the peer that would finish first (two choices)."""

from __future__ import annotations

import random
from collections import Counter

import trio

from rolloutd.federation import Federation, ForwardedJobs, Member, MemberState, Placement

from .conftest import Cap, open_cluster


def peer(
    name: str,
    free: int,
    *,
    queued: int = 0,
    state: MemberState = MemberState.ALIVE,
    draining: bool = False,
    backends: int = 1,
) -> Member:
    m = Member(node_id=name, url=f"http://{name}:1", state=state)
    m.capacity = Cap(free_slots=free, queued=queued, draining=draining, healthy_backends=backends)()
    return m


def test_local_room_runs_locally_whatever_the_peers():
    p = Placement(rng=random.Random(1))
    assert p.choose(Cap(free_slots=1)(), [peer("b", 100)]) is None


def test_full_node_forwards_to_the_better_of_two_sampled_peers():
    p = Placement(rng=random.Random(1))
    peers = [peer("b", 3), peer("c", 9)]
    assert p.choose(Cap(free_slots=0)(), peers).node_id == "c"


def test_power_of_two_choices_never_picks_the_worst_of_three():
    p = Placement(rng=random.Random(2))
    peers = [peer("b", 1), peer("c", 5), peer("d", 9)]
    picks = Counter(p.choose(Cap(free_slots=0)(), peers).node_id for _ in range(300))
    assert picks["b"] == 0 and picks["d"] > picks["c"] > 0


def test_a_request_of_several_samples_is_compared_against_every_peer():
    """Two choices leave about one request's worth of imbalance per node; for a group
    (n > 1) that is the group's size, so a group goes to the roomiest peer of all."""
    p = Placement(rng=random.Random(2))
    peers = [peer("b", 1), peer("c", 5), peer("d", 9)]
    assert {p.choose(Cap(free_slots=0)(), peers, n=4).node_id for _ in range(100)} == {"d"}
    assert p.choose(Cap(free_slots=0)(), peers, n=1) is not None  # one sample: two choices


async def test_a_batch_of_groups_spreads_evenly_over_equal_peers(autojump_clock):
    """32 groups of 4 placed by one front on 8 equal members (4 workers each), faster than
    any report: 4 groups each. With two choices, such bursts often left one member 5 groups
    and another 3 (bench/federation.py --load batch: every one of four)."""
    async with open_cluster() as c:
        names = [f"n{i}" for i in range(8)]
        nodes = [await c.start(name, cap=Cap(free_slots=4, slots=4)) for name in names]
        await c.wait_converged()
        await trio.sleep(1.5)  # everyone has everyone's current capacity
        front = nodes[0]
        held = Counter(dict.fromkeys(names, 0))
        for _ in range(32):
            mine = held["n0"]
            here = Cap(free_slots=max(0, 4 - mine), in_flight=mine, slots=4)()
            chosen = front.fed.place(here, n=4)
            held[chosen.node_id if chosen is not None else "n0"] += 4
        assert sorted(held.values()) == [16] * 8, held


def test_full_cluster_forwards_ties_and_shorter_queues_and_keeps_longer_ones():
    p = Placement(rng=random.Random(3))
    local = Cap(free_slots=0, queued=4)()
    assert p.choose(local, [peer("b", 0, queued=6)]) is None
    assert p.choose(local, [peer("b", 0, queued=4)]).node_id == "b"
    assert p.choose(local, [peer("b", 0, queued=2)]).node_id == "b"


def test_headroom_counts_every_rollout_a_full_node_holds():
    """A full node holds rollouts past its queue too: in INIT, waiting between stages. Two
    peers with the same queue are not equally loaded when one holds more; free slots minus
    queued (what an older member reports) cannot tell them apart."""
    def full(name: str, holds: int, *, slots: int = 7) -> Member:
        m = Member(node_id=name, url=f"http://{name}:1")
        m.capacity = Cap(free_slots=0, queued=2, in_flight=holds, slots=slots)()
        return m

    p = Placement(rng=random.Random(6))
    assert full("b", 12).headroom == -5 and full("c", 9).headroom == -2
    assert all(p.choose(Cap(free_slots=0, queued=2, in_flight=10, slots=7)(),
                        [full("b", 12), full("c", 9)]).node_id == "c" for _ in range(20))
    # the front holds less than the emptier peer: it keeps the rollout
    assert p.choose(Cap(free_slots=0, queued=2, in_flight=8, slots=7)(), [full("c", 9)]) is None
    # an older member (no slots): free slots minus queued, as before
    assert full("d", 12, slots=0).headroom == -2


def full_node(name: str, holds: int, rate: float, *, slots: int = 4) -> Member:
    m = Member(node_id=name, url=f"http://{name}:1")
    m.capacity = Cap(free_slots=0, in_flight=holds, slots=slots, rate=rate)()
    return m


def test_measured_rates_weigh_what_each_full_node_holds():
    """With every rate known, the peer that would finish first wins (not the one holding
    fewer), and a slow front forwards where headroom alone would keep the rollout."""
    p = Placement(rng=random.Random(7))
    slow, fast = full_node("b", 10, 0.5), full_node("c", 14, 2.0)  # 22 s against 7.5 s
    assert slow.finish_s == 22.0 and fast.finish_s == 7.5
    assert all(p.choose(Cap(free_slots=0, in_flight=10, slots=4, rate=1.0)(),
                        [slow, fast]).node_id == "c" for _ in range(20))
    # the front holds fewer than c (headroom keeps it) but is four times slower
    front = Cap(free_slots=0, in_flight=12, slots=4, rate=0.5)()
    assert p.choose(front, [fast]).node_id == "c"
    # the same front, as fast as c: it keeps it (13 s against 7.5 s no longer holds)
    assert p.choose(Cap(free_slots=0, in_flight=12, slots=4, rate=2.0)(), [fast]) is None
    # a front with room runs it, however slow
    assert p.choose(Cap(free_slots=1, in_flight=3, slots=4, rate=0.1)(), [fast]) is None


def test_without_every_rate_placement_counts_headroom():
    """A node needs a few finishes while full before it has a rate, an older member never
    reports one: until the front and both sampled peers have one, headroom decides."""
    p = Placement(rng=random.Random(8))
    unmeasured = full_node("b", 10, 0.0)
    fast = full_node("c", 14, 2.0)
    assert unmeasured.finish_s is None
    assert all(p.choose(Cap(free_slots=0, in_flight=12, slots=4, rate=1.0)(),
                        [unmeasured, fast]).node_id == "b" for _ in range(20))
    # the front has no rate: c holds more than the front, so the front keeps it
    assert p.choose(Cap(free_slots=0, in_flight=12, slots=4)(), [fast]) is None


def burst_shares(front_rate: float, peer_rate: float = 1.0) -> tuple[int, list[int]]:
    """Place a burst of 128 from a front (4 workers) over 7 peers (4 workers each), every
    report fresh at every placement: what the front keeps and each peer's share."""
    p = Placement(rng=random.Random(9))
    peers = {f"p{i}": full_node(f"p{i}", 0, peer_rate) for i in range(7)}
    held = Counter[str]()
    front = Cap(free_slots=4, in_flight=0, slots=4, rate=front_rate)
    for _ in range(128):
        for name, m in peers.items():
            m.capacity = Cap(free_slots=max(0, 4 - held[name]), in_flight=held[name],
                             slots=4, rate=peer_rate)()
        chosen = p.choose(front(), list(peers.values()))
        if chosen is None:
            front.in_flight += 1
            front.free_slots = max(0, 4 - front.in_flight)
        else:
            held[chosen.node_id] += 1
    return front.in_flight, sorted(held[name] for name in peers)


def test_a_burst_is_shared_in_proportion_to_measured_speed():
    """A front at half a peer's speed (another CPU, or one busy forwarding and relaying)
    keeps half a share, so it finishes about when they do, not twice as late."""
    kept, shares = burst_shares(0.5)
    assert kept in (8, 9) and 16 <= shares[0] and shares[-1] <= 18
    ends = [kept / 0.5, *shares]
    assert max(ends) - min(ends) <= 2.5  # even shares: the front would end 16 s after them


def test_speeds_closer_than_the_noise_share_evenly():
    """Rates of equal nodes differ by their measurement's noise: below SPEEDS_DIFFER apart
    they are not weighed, and headroom shares the burst evenly."""
    assert burst_shares(0.85) == burst_shares(0.0)  # 0.0: never measured
    kept, shares = burst_shares(0.85)
    assert kept == 16 and 15 <= shares[0] and shares[-1] <= 17


def test_peers_that_take_no_work_are_never_chosen():
    p = Placement(rng=random.Random(4))
    peers = [
        peer("s", 9, state=MemberState.SUSPECT),
        peer("d", 9, state=MemberState.DEAD),
        peer("l", 9, state=MemberState.LEFT),
        peer("x", 9, draining=True),
        peer("n", 9, backends=0),
    ]
    assert p.choose(Cap(free_slots=0)(), peers) is None


def test_draining_or_backendless_node_forwards_even_to_a_busier_peer():
    p = Placement(rng=random.Random(5))
    busy = [peer("b", 0, queued=10)]
    assert p.choose(Cap(free_slots=8, draining=True)(), busy).node_id == "b"
    assert p.choose(Cap(free_slots=8, healthy_backends=0)(), busy).node_id == "b"


async def test_front_forwards_a_burst_evenly_when_local_capacity_is_full(autojump_clock):
    async with open_cluster() as c:
        a = await c.start("a", cap=Cap(free_slots=2))
        await c.start("b", cap=Cap(free_slots=3))
        await c.start("c", cap=Cap(free_slots=3))
        await c.wait_converged()
        await trio.sleep(1.5)  # everyone has everyone's current capacity

        placed: Counter[str] = Counter()
        for _ in range(10):
            m = a.fed.place()
            if m is not None:
                placed[m.node_id] += 1
                continue
            placed["a"] += 1  # the daemon runs it here: a slot less, or a longer queue
            if a.cap.free_slots:
                a.cap.free_slots -= 1
            else:
                a.cap.queued += 1
        # 2 run here while there is room; b and c then take 3 each (their headroom, debited
        # per placement since their gossip is not fresh yet); with everyone at 0 the ties
        # go to the peers (headroom -1 each), so the front queues no more than they do.
        assert placed["a"] == 2
        assert placed["b"] + placed["c"] == 8
        assert abs(placed["b"] - placed["c"]) <= 1


async def full_front_and_peer(c, peer_free: int):
    """A front with no room ("a") and one peer ("b", ``peer_free`` slots), each knowing the
    other's current capacity."""
    a = await c.start("a", cap=Cap(free_slots=0))
    b = await c.start("b", cap=Cap(free_slots=peer_free))
    await c.wait_converged()
    await trio.sleep(1.5)
    return a, b


async def test_a_capacity_report_replaces_the_debit_of_what_it_counts(autojump_clock):
    async with open_cluster() as c:
        a, b = await full_front_and_peer(c, 1)
        assert a.fed.place().node_id == "b"
        assert a.fed.member("b").headroom == 0  # b's slot is spent while the forward is open
        a.fed.forwarded("b", b.fed.version, taken=True)  # b took it, at its version now
        assert a.fed.member("b").headroom == 0
        await trio.sleep(1.5)  # b's next heartbeat counts it (b's callback still says 1)
        assert a.fed.member("b").headroom == 1
        assert a.fed.place().node_id == "b"
        a.fed.forwarded("b", b.fed.version, taken=True)
        b.cap.free_slots = 0
        b.cap.queued = 2
        await trio.sleep(1.5)
        assert a.fed.member("b").headroom == -2
        assert a.fed.place() is None  # a (headroom 0) is now the emptier node


async def test_a_report_from_before_the_peer_took_a_rollout_keeps_its_debit(autojump_clock):
    """A report that reaches the front after the forward but was made before the peer took
    the rollout (relayed by a third member, or simply slow) must not wipe the debit: the
    front would then send the peer a second helping on a stale view."""
    async with open_cluster() as c:
        a, _ = await full_front_and_peer(c, 2)
        seen = a.fed.member("b").version
        assert a.fed.place().node_id == "b"
        assert a.fed.place().node_id == "b"
        # b took both after a heartbeat that a has not heard of yet
        incarnation, heartbeat = seen
        a.fed.forwarded("b", (incarnation, heartbeat + 1), taken=True)
        a.fed.forwarded("b", (incarnation, heartbeat + 1), taken=True)
        stale = a.fed.member("b").record()
        stale["heartbeat"] = heartbeat + 1  # b's report of that heartbeat: free_slots 2
        a.fed.handle_gossip({"protocol": 1, "members": [stale]})
        assert a.fed.member("b").headroom == 0
        stale["heartbeat"] = heartbeat + 2  # a later one counts them (here: b still says 2)
        a.fed.handle_gossip({"protocol": 1, "members": [stale]})
        assert a.fed.member("b").headroom == 2


async def test_open_forwards_stay_debited_and_refused_ones_are_given_back(autojump_clock):
    async with open_cluster() as c:
        a, _ = await full_front_and_peer(c, 3)
        for _ in range(3):
            assert a.fed.place().node_id == "b"
        await trio.sleep(3.0)  # reports arrive; none can count a rollout b was not sent yet
        assert a.fed.member("b").headroom == 0
        a.fed.forwarded("b", None, taken=False)  # refused (429/503) or never sent
        assert a.fed.member("b").headroom == 1
        a.fed.forwarded("b", None, taken=True)  # an older peer: no version in its answer
        assert a.fed.member("b").headroom == 1
        await trio.sleep(1.5)  # its next report counts it (as before versions were sent)
        assert a.fed.member("b").headroom == 2
        a.fed.forwarded("gone", None, taken=True)  # a member it no longer knows: ignored


async def test_a_dead_peer_turns_its_forwarded_jobs_into_failures_once(autojump_clock):
    """No double execution: the front fails the dead peer's jobs and never re-runs them;
    if the peer was only presumed dead, its orphans are handed back for cancelling."""
    tracker = ForwardedJobs()
    failed: list[str] = []
    orphans: list[str] = []

    async def on_dead(m: Member) -> None:
        failed.extend(tracker.fail_node(m.node_id))

    async def on_rejoin(m: Member) -> None:
        orphans.extend(tracker.take_orphans(m.node_id))

    async with open_cluster() as c:
        a_url = "http://a:8000"
        net = c.net
        a = Federation(
            "a",
            a_url,
            capacity=Cap(free_slots=0),
            transport=net.transport(a_url),
            on_dead=on_dead,
            on_rejoin=on_rejoin,
            **c.defaults,
        )
        net.add(a)
        c.nursery.start_soon(a.run)
        await c.start("b", seeds=[a_url], cap=Cap(free_slots=5))
        while a.member("b") is None or a.member("b").capacity["free_slots"] != 5:
            await trio.sleep(0.1)

        for i in range(3):
            m = a.place()
            assert m is not None and m.node_id == "b"
            tracker.add(f"job-{i}", m.node_id)
        tracker.discard("job-0")  # its result came back through the front

        c.kill("b")
        while not failed:
            await trio.sleep(0.1)
        assert failed == ["job-1", "job-2"]
        assert tracker.jobs_on("b") == [] and len(tracker) == 0

        await c.start("b", seeds=[a_url], cap=Cap(free_slots=5))
        while not orphans:
            await trio.sleep(0.1)
        assert orphans == ["job-1", "job-2"]
        assert tracker.take_orphans("b") == []


async def test_a_group_is_debited_by_its_samples(autojump_clock):
    """A forwarded request of n samples takes n of the peer's slots, as its report will say."""
    async with open_cluster() as c:
        a, b = await full_front_and_peer(c, 8)
        assert a.fed.place(n=6).node_id == "b"
        assert a.fed.member("b").headroom == 2
        a.fed.forwarded("b", b.fed.version, taken=True, n=6)
        assert a.fed.member("b").headroom == 2
        assert a.fed.place(n=6).node_id == "b"  # 2 >= 0 (a's): ties and better go to the peer
        a.fed.forwarded("b", None, taken=False, n=6)  # refused: all six given back
        assert a.fed.member("b").headroom == 2
        b.cap.free_slots = 2  # b's report now counts the six it took
        await trio.sleep(1.5)
        assert a.fed.member("b").headroom == 2


# ---- image homes -------------------------------------------------------------------------


def test_an_images_homes_are_the_same_from_every_front_and_spread_over_the_members():
    from rolloutd.federation import IMAGE_HOMES, image_homes

    nodes = [f"node{i:02d}:8400" for i in range(8)]
    homes = image_homes("swe:django-11099", nodes)
    assert len(homes) == IMAGE_HOMES == 2
    assert image_homes("swe:django-11099", list(reversed(nodes))) == homes  # order-free
    # Over many images every member is a home of about its share (2/8 of 2,000 = 500).
    count = Counter(h for i in range(2000) for h in image_homes(f"img{i}", nodes))
    assert set(count) == set(nodes) and all(400 < c < 600 for c in count.values())
    # A member that leaves moves only the images it was a home of; one that joins takes
    # only images it becomes a home of.
    gone = nodes[3]
    for i in range(300):
        before = image_homes(f"img{i}", nodes)
        after = image_homes(f"img{i}", [n for n in nodes if n != gone])
        assert [h for h in before if h != gone] == [h for h in after if h in before]
        if gone not in before:
            assert after == before


def homes_and_others(image: str) -> tuple[list[str], list[str]]:
    from rolloutd.federation import image_homes

    names = ["a", "b", "c", "d", "e"]
    homes = image_homes(image, names)
    return homes, [n for n in names if n not in homes]


def image_whose_homes(want_local: bool) -> str:
    """An image ref whose homes among a..e include the front "a" (or do not)."""
    return next(f"img{i}" for i in range(1000)
                if ("a" in homes_and_others(f"img{i}")[0]) == want_local)


def test_a_task_with_an_image_goes_to_a_home_with_room_even_when_the_front_has_room():
    image = image_whose_homes(want_local=False)
    homes, others = homes_and_others(image)
    p = Placement(rng=random.Random(7))
    peers = [peer(n, 4 if n in homes else 9) for n in "bcde"]
    for _ in range(20):
        assert p.choose(Cap(free_slots=5)(), peers, image=image, local_id="a").node_id in homes
    assert (p.image_home, p.image_spilled) == (20, 0)
    # the home with more headroom first
    peers = [peer(n, {homes[0]: 1, homes[1]: 3}.get(n, 9)) for n in "bcde"]
    assert p.choose(Cap(free_slots=5)(), peers, image=image, local_id="a").node_id == homes[1]
    # without the image, the front's room keeps it here as always
    assert p.choose(Cap(free_slots=5)(), peers, local_id="a") is None


def test_a_front_that_is_a_home_with_room_keeps_the_task():
    image = image_whose_homes(want_local=True)
    homes, _ = homes_and_others(image)
    p = Placement(rng=random.Random(8))
    peers = [peer(n, 9) for n in "bcde"]
    assert p.choose(Cap(free_slots=1)(), peers, image=image, local_id="a") is None
    # a full front that is a home gives it to the other home while that one has room
    other = next(h for h in homes if h != "a")
    assert p.choose(Cap(free_slots=0)(), peers, image=image, local_id="a").node_id == other


def test_when_no_home_has_room_the_usual_rules_decide():
    image = image_whose_homes(want_local=False)
    homes, others = homes_and_others(image)
    p = Placement(rng=random.Random(9))
    peers = [peer(n, 0 if n in homes else 6, queued=3 if n in homes else 0) for n in "bcde"]
    assert p.choose(Cap(free_slots=2)(), peers, image=image, local_id="a") is None  # room here
    assert (p.image_home, p.image_spilled) == (0, 1)
    # a full front: the same choices as for a task without an image (same random draws)
    with_image, without = Placement(rng=random.Random(10)), Placement(rng=random.Random(10))
    full = Cap(free_slots=0, queued=1)()
    for _ in range(20):
        x = with_image.choose(full, peers, image=image, local_id="a")
        y = without.choose(full, peers, local_id="a")
        assert (x and x.node_id) == (y and y.node_id)
    # homes that take no work are no homes: the image's homes are among those that do
    peers = [peer(n, 9, draining=n in homes) for n in "bcde"]
    chosen = p.choose(Cap(free_slots=0)(), peers, image=image, local_id="a")
    assert chosen.node_id in others


async def test_a_federation_places_a_burst_of_one_images_groups_on_its_homes(autojump_clock):
    from rolloutd.federation import image_homes

    async with open_cluster() as c:
        a = await c.start("a", cap=Cap(free_slots=4))
        for name in "bcd":
            await c.start(name, cap=Cap(free_slots=3))
        await c.wait_converged()
        await trio.sleep(1.5)
        image = next(f"img{i}" for i in range(1000) if "a" not in image_homes(f"img{i}", "abcd"))
        homes = image_homes(image, "abcd")
        placed = Counter((m.node_id if (m := a.fed.place(image=image)) else "a") for _ in range(6))
        # the homes' 3 + 3 slots first (debited per placement), then the usual rules
        assert placed == Counter({homes[0]: 3, homes[1]: 3})
        assert a.fed.place(image=image) is None  # homes full: the front's own room
