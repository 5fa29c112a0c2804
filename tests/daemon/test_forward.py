"""The front's forwarder against real sockets that misbehave: what provably never reached a peer
may run elsewhere; what may have reached it is ``failed`` (``peer_lost``), never run twice."""

from __future__ import annotations

import functools
import json

import pytest
import trio

from rolloutd.daemon.forward import Forwarder, PeerUnavailable, line_id
from rolloutd.federation import Capacity, Federation, Member, MemberState

BODY = {"task": {"kind": "sleep", "run_s": 1}, "n": 2}


class Peer:
    """A TCP server on loopback that misbehaves on purpose (``mode``):

    - ``"hang"``: takes the connection and the request, never answers (a partition);
    - ``"slam"``: closes every connection as soon as the request arrived (a crash);
    - ``"answer"``: answers each request with ``status`` and ``body`` (bytes: sent as they are).
      A ``POST /v1/federation/submit`` (forwarded submits, several at once) is answered 200
      with ``status`` and ``body`` for each submit it carries; unless ``submits_route`` is
      False (an older version): then it is answered 404, like any path that is no route.
    """

    def __init__(self, mode: str, status: int = 200, body: object = None) -> None:
        self.mode, self.status, self.body = mode, status, body
        self.requests: list[bytes] = []
        self.at: list[float] = []  # when each request arrived (trio's clock)
        self.port = 0
        self.gate: trio.Event | None = None  # when set: answers wait for it
        self.hang_streams = False  # a stream request gets no answer
        self.listing: tuple[int, object] | None = None  # when set: answers GET /v1/rollouts?...
        self.submits_route = True
        self.route_answer: tuple[int, object] | None = None  # when set: the submit route's answer
        self.bodies: list[bytes] = []  # each request's body

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive_some()
                if not chunk:
                    return
                data += chunk
            head, _, sent = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.lower().split(b"\r\n")
                           if line.startswith(b"content-length:")), 0)
            while len(sent) < length and self.mode != "slam":
                chunk = await stream.receive_some()
                if not chunk:
                    return
                sent += chunk
            self.requests.append(data)
            self.bodies.append(sent)
            self.at.append(trio.current_time())
            if self.mode == "hang" or (self.hang_streams and b"/v1/rollouts/stream" in data):
                await trio.sleep_forever()
            if self.mode == "answer":
                if self.gate is not None:
                    await self.gate.wait()
                status, body = self.status, self.body
                if self.listing is not None and data.startswith(b"GET /v1/rollouts?"):
                    status, body = self.listing
                if data.startswith(b"POST /v1/federation/submit "):
                    if self.route_answer is not None:
                        status, body = self.route_answer
                    elif self.submits_route:
                        n = len(json.loads(sent)["submits"])
                        status, body = 200, {"answers": [{"status": status, "body": body}] * n}
                    else:
                        status, body = 404, {"error": {"type": "not_found", "message": "no route"}}
                payload = body if isinstance(body, bytes) else json.dumps(body).encode()
                head = (f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n")
                await stream.send_all(head.encode() + payload)

    @property
    def member(self) -> Member:
        return Member(node_id="peer", url=f"http://127.0.0.1:{self.port}")


async def forwarder(nursery) -> Forwarder:
    def capacity() -> Capacity:
        return Capacity(free_slots=0, queued=0, in_flight=0, healthy_backends=1, draining=False)

    fed = Federation("front", "http://127.0.0.1:1", capacity=capacity)
    fwd = Forwarder(fed, token=None)
    await nursery.start(fwd.run)
    return fwd


def meet(fwd: Forwarder, peer: Peer) -> None:
    """The front learns of the peer as alive (as gossip would tell it)."""
    record = peer.member.record()
    record["incarnation"] = record["heartbeat"] = 1
    fwd.federation.handle_gossip({"members": [record]})


async def forwarded(nursery) -> tuple[Forwarder, Peer]:
    """A front that forwarded two rollouts (BODY) to a live peer that took them (202)."""
    fwd = await forwarder(nursery)
    peer = Peer("answer", 202, {"group_id": "g-1", "ids": []})
    await nursery.start(peer.serve)
    meet(fwd, peer)
    await fwd.submit(peer.member, BODY, 2, wait=False)
    return fwd, peer


def closed_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: a connection is refused
    return int(port)


async def test_a_refused_connection_never_reached_the_peer_so_the_front_may_run_it(nursery):
    fwd = await forwarder(nursery)
    member = Member(node_id="peer", url=f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(PeerUnavailable):
        await fwd.submit(member, BODY, 2, wait=True)
    assert len(fwd.live) == 0 and not fwd.statistics()["lost"]


@pytest.mark.parametrize("status", [429, 503])
async def test_a_refusal_by_the_peer_is_proof_it_holds_nothing(nursery, status):
    fwd = await forwarder(nursery)
    peer = Peer("answer", status, {"error": {"type": "queue_full", "message": "full"}})
    await nursery.start(peer.serve)
    with pytest.raises(PeerUnavailable):
        await fwd.submit(peer.member, BODY, 2, wait=False)
    assert len(fwd.live) == 0


async def test_a_peer_that_dies_after_taking_the_request_loses_it_not_the_front(nursery):
    """The request reached the peer (it may run it): after the one retry also goes unanswered,
    both samples are failed/peer_lost, and PeerUnavailable is NOT raised (so the front does
    not run them too)."""
    fwd = await forwarder(nursery)
    peer = Peer("slam")
    await nursery.start(peer.serve)
    answer = await fwd.submit(peer.member, BODY, 2, wait=True)
    assert answer.status == 200
    rollouts = answer.body["rollouts"]
    assert [r["status"] for r in rollouts] == ["failed", "failed"]
    assert {r["error"]["type"] for r in rollouts} == {"peer_lost"}
    assert {r["node_id"] for r in rollouts} == {"peer"}
    assert len(peer.requests) == 2  # the retry carried the same idempotency key and ids
    first, second = (r.decode("latin-1").lower() for r in peer.requests)
    ids_line = next(line for line in first.splitlines() if line.startswith("x-rolloutd-ids"))
    assert ids_line in second
    for r in rollouts:  # and they answer so afterwards
        assert (await fwd.get(r["id"])).body["error"]["type"] == "peer_lost"


async def test_a_partitioned_peer_declared_dead_ends_an_open_wait_as_peer_lost(nursery):
    """A wait=true forward to a peer that took the request and went silent (no answer, no
    reset) returns when the peer is declared dead: failed/peer_lost, not re-run."""
    fwd = await forwarder(nursery)
    peer = Peer("hang")
    await nursery.start(peer.serve)
    answers = []

    async def submit() -> None:
        answers.append(await fwd.submit(peer.member, BODY, 2, wait=True))

    nursery.start_soon(submit)
    with trio.fail_after(5):
        while not peer.requests:
            await trio.sleep(0.01)
    assert len(fwd.live) == 2
    dead = peer.member
    dead.state = MemberState.DEAD
    await fwd.on_dead(dead)
    with trio.fail_after(5):
        while not answers:
            await trio.sleep(0.01)
    [answer] = answers
    assert answer.status == 200
    assert [r["error"]["type"] for r in answer.body["rollouts"]] == ["peer_lost", "peer_lost"]
    assert len(peer.requests) == 1  # no retry to a dead peer, and nothing else ran


async def test_a_peer_that_does_not_know_a_forwarded_id_never_got_it(nursery):
    fwd = await forwarder(nursery)
    peer = Peer("answer", 202, {"group_id": "g-1", "ids": ["x", "y"]})
    await nursery.start(peer.serve)
    meet(fwd, peer)
    answer = await fwd.submit(peer.member, BODY, 2, wait=False)
    assert answer.status == 202
    [job_id, _] = fwd.live.jobs_on("peer")
    peer.status, peer.body = 404, {"error": {"type": "not_found", "message": "no rollout"}}
    data = (await fwd.get(job_id)).body
    assert data["status"] == "failed" and data["error"]["type"] == "peer_lost"
    assert job_id not in fwd.live


async def test_a_peer_answer_that_arrives_after_the_peer_was_declared_dead_does_not_count(nursery):
    """A lookup in flight across a partition: the peer is declared dead (its rollouts
    peer_lost), then the partition heals and the peer's late 'completed' arrives. The first
    terminal answer stands: a trainer never sees two final statuses for one id."""
    fwd, peer = await forwarded(nursery)
    [job_id, _] = fwd.live.jobs_on("peer")
    peer.status, peer.body, peer.gate = 200, {"id": job_id, "status": "completed"}, trio.Event()
    answers = []

    async def look() -> None:
        answers.append((await fwd.get(job_id)).body)

    nursery.start_soon(look)
    with trio.fail_after(5):
        while len(peer.requests) < 2:
            await trio.sleep(0.01)
    dead = peer.member
    dead.state = MemberState.DEAD
    await fwd.on_dead(dead)
    peer.gate.set()  # the partition heals; the peer's answer arrives
    with trio.fail_after(5):
        while not answers:
            await trio.sleep(0.01)
    assert answers[0]["status"] == "failed" and answers[0]["error"]["type"] == "peer_lost"
    assert (await fwd.get(job_id)).body["error"]["type"] == "peer_lost"


async def test_a_result_the_peers_stream_never_delivers_still_arrives_by_lookup(nursery):
    """A relay chain can miss a result (the peer handed the rollout on): while the stream
    stays open and silent, the missing ids are looked up every SWEEP_S."""
    from rolloutd.daemon import forward

    fwd, peer = await forwarded(nursery)
    ids = fwd.live.jobs_on("peer")
    peer.hang_streams = True
    send, recv = trio.open_memory_channel[str](2)
    lines = []

    async def consume() -> None:
        async with recv:
            async for line in recv:
                lines.append(line)

    # every lookup's answer (compact, UTF-8): relayed as it came, not parsed and serialized again
    text = json.dumps({"id": ids[0], "status": "completed", "note": "\u00e9"}, separators=(",", ":"),
                      ensure_ascii=False)
    peer.status, peer.body = 200, text.encode()
    nursery.start_soon(fwd.relay, "peer", ids[:1], send)
    nursery.start_soon(consume)
    with trio.fail_after(forward.SWEEP_S + 5):
        while not lines:
            await trio.sleep(0.05)
    assert lines == [text]
    assert ids[0] not in fwd.live  # a terminal answer: the peer no longer holds it for us


async def test_a_forwarded_wait_s_answer_is_relayed_as_the_peer_sent_it(nursery):
    """The front parses a peer's answer (for its ids) but relays the peer's bytes: parsing and
    serializing again the trajectories of a wait is most of what relaying them costs."""
    fwd = await forwarder(nursery)
    peer = Peer("answer", 200, None)
    await nursery.start(peer.serve)
    meet(fwd, peer)

    def answer(ids: list[str]) -> dict:
        return {"group_id": "g-1", "rollouts": [{"id": i, "status": "completed", "note": "\u00e9"}
                                                for i in ids]}

    peer.body = answer(["r-x", "r-y"])  # the ids an earlier request with the client's key got
    got = await fwd.submit(peer.member, {**BODY, "idempotency_key": "k"}, 2, wait=True)
    assert got.status == 200 and got.raw == json.dumps(peer.body).encode()
    assert got.body == peer.body
    assert fwd.node_of("r-x") == "peer" and fwd.node_of("r-y") == "peer"  # the peer's ids stand


def lookups(peer: Peer) -> list[float]:
    """When the peer's single-rollout lookups (GET /v1/rollouts/<id>) arrived."""
    return [t for r, t in zip(peer.requests, peer.at, strict=True) if r.startswith(b"GET /v1/rollouts/r")]


async def test_the_lookups_of_an_open_stream_back_off(nursery, monkeypatch):
    """The safety net of a silent stream looks up after SWEEP_S, then twice as long after
    each sweep up to SWEEP_MAX_S: a long rollout costs a few lookups, not one every SWEEP_S."""
    from rolloutd.daemon import forward

    monkeypatch.setattr(forward, "SWEEP_S", 0.1)
    monkeypatch.setattr(forward, "SWEEP_MAX_S", 0.4)
    fwd, peer = await forwarded(nursery)
    ids = fwd.live.jobs_on("peer")
    peer.hang_streams = True
    peer.status, peer.body = 200, {"id": ids[0], "status": "run"}  # never finished
    send, recv = trio.open_memory_channel[str](2)
    with recv:
        start = trio.current_time()
        with trio.move_on_after(1.65):
            await fwd.relay("peer", ids[:1], send)
    times = [t - start for t in lookups(peer)]
    # after 0.1, 0.3, 0.7, 1.1 and 1.5 s (a fixed 0.1 s would have made 16); a sweep waits
    # from the end of the one before, so a slow machine makes fewer and longer gaps only
    assert 3 <= len(times) <= 5, times
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps[0] >= 0.2 and all(g >= 0.4 for g in gaps[1:]), gaps


def probes(peer: Peer) -> list[bytes]:
    """The listings by ids the peer was asked for (a sweep's statuses)."""
    return [r for r in peer.requests if r.startswith(b"GET /v1/rollouts?")]


async def test_a_sweep_looks_up_only_what_the_peer_shows_finished(nursery, monkeypatch):
    """A sweep asks the peer's listing for the statuses of every undelivered id in one small
    request, and fetches the whole trajectory (megabytes, for a long agent) only of one the
    listing shows finished or does not hold."""
    from rolloutd.daemon import forward

    monkeypatch.setattr(forward, "SWEEP_S", 0.1)
    fwd, peer = await forwarded(nursery)
    await fwd.submit(peer.member, BODY, 2, wait=False)
    running, finished, unheld, later = fwd.live.jobs_on("peer")
    peer.hang_streams = True
    peer.listing = (200, {"rollouts": [{"id": running, "status": "run"},
                                       {"id": finished, "status": "completed"},
                                       {"id": later, "status": "some-future-status"}], "total": 3})
    peer.status, peer.body = 200, {"status": "run"}  # what every lookup answers (this fake's)
    send, recv = trio.open_memory_channel[str](4)
    with recv:
        nursery.start_soon(fwd.relay, "peer", [running, finished, unheld, later], send)
        with trio.fail_after(5):
            while len(lookups_requests(peer)) < 3:
                await trio.sleep(0.01)
        asked = [r.split(b" ")[1] for r in lookups_requests(peer)[:3]]
        assert asked == [f"/v1/rollouts/{i}".encode() for i in (finished, unheld, later)]
        probe = probes(peer)[0]
        assert all(i.encode() in probe for i in (running, finished, unheld, later))
        assert fwd.statistics()["relay_probes"] >= 1 and fwd.statistics()["relay_lookups"] >= 3


@pytest.mark.parametrize("listing", [(400, {"error": {"type": "bad_request", "message": "unknown ids"}}),
                                     (200, {"id": "r-x", "status": "run"})])
async def test_a_peer_without_the_ids_listing_gets_the_lookups_as_before(nursery, monkeypatch, listing):
    """An older peer refuses the filter (400) or answers something else: the sweep looks up
    the SWEEP_MAX that waited longest, as before the listing existed."""
    from rolloutd.daemon import forward

    monkeypatch.setattr(forward, "SWEEP_S", 0.1)
    fwd, peer = await forwarded(nursery)
    ids = fwd.live.jobs_on("peer")
    peer.hang_streams = True
    peer.listing = listing
    peer.status, peer.body = 200, {"id": ids[1], "status": "completed"}
    send, recv = trio.open_memory_channel[str](2)
    nursery.start_soon(fwd.relay, "peer", ids, send)
    with trio.fail_after(5), recv:
        assert json.loads(await recv.receive())["status"] == "completed"
    assert len(probes(peer)) == 1 and len(lookups_requests(peer)) >= 1


def lookups_requests(peer: Peer) -> list[bytes]:
    return [r for r in peer.requests if r.startswith(b"GET /v1/rollouts/r")]


async def test_the_lookups_of_every_relay_to_one_peer_share_a_rate(nursery, monkeypatch):
    """However many streams are open, sweep lookups to one peer go at most SWEEP_RATE a second."""
    from rolloutd.daemon import forward

    monkeypatch.setattr(forward, "SWEEP_S", 0.05)
    monkeypatch.setattr(forward, "SWEEP_RATE", 20.0)
    fwd, peer = await forwarded(nursery)
    await fwd.submit(peer.member, BODY, 2, wait=False)
    await fwd.submit(peer.member, BODY, 2, wait=False)
    ids = fwd.live.jobs_on("peer")
    assert len(ids) == 6
    peer.hang_streams = True
    peer.status, peer.body = 200, {"id": ids[0], "status": "run"}
    with trio.move_on_after(0.6):
        async with trio.open_nursery() as relays:
            for k in range(3):  # three streams, two rollouts each
                send, recv = trio.open_memory_channel[str](2)
                relays.start_soon(fwd.relay, "peer", ids[2 * k: 2 * k + 2], send)
                relays.start_soon(trio.sleep_forever)  # holds recv open
    times = sorted(lookups(peer))
    assert 6 <= len(times) <= 13, times  # the first sweep of each of the three; 20 a second
    assert times[5] - times[0] >= 0.2, times  # six lookups started 0.05 s apart


@pytest.mark.parametrize("status", [500, 503])
async def test_an_error_answer_of_the_peer_is_unavailable_never_a_trajectory(nursery, status):
    """CI's chaos test once read a 200 without ``status`` from the front: the peer's own
    error body had been relayed as if it were the trajectory."""
    fwd, peer = await forwarded(nursery)
    [job_id, _] = fwd.live.jobs_on("peer")
    peer.status, peer.body = status, {"error": {"type": "unavailable", "message": "ask again"}}
    with pytest.raises(PeerUnavailable, match=f"answered {status}: ask again"):
        await fwd.get(job_id)
    assert job_id in fwd.live  # still the peer's: nothing was decided
    peer.status, peer.body = 200, {"id": job_id, "status": "completed"}
    assert (await fwd.get(job_id)).body["status"] == "completed"
    assert job_id not in fwd.live


async def test_a_relay_whose_lookups_meet_errors_goes_on_until_the_result(nursery, monkeypatch):
    from rolloutd.daemon import forward

    monkeypatch.setattr(forward, "SWEEP_S", 0.2)
    fwd, peer = await forwarded(nursery)
    ids = fwd.live.jobs_on("peer")
    peer.hang_streams = True
    peer.status, peer.body = 503, {"error": {"type": "unavailable", "message": "busy"}}
    send, recv = trio.open_memory_channel[str](2)
    nursery.start_soon(fwd.relay, "peer", ids[:1], send)
    with trio.fail_after(10):
        while len(peer.requests) < 4:  # the submit, the stream, and lookups answered 503
            await trio.sleep(0.05)
    peer.status, peer.body = 200, {"id": ids[0], "status": "completed"}
    with trio.fail_after(10), recv:
        assert json.loads(await recv.receive()) == {"id": ids[0], "status": "completed"}


def test_a_relayed_line_s_id_is_read_without_parsing_the_trajectory():
    """The front relays every trajectory of a peer's stream; it reads only the id, which the
    peer writes first. Other forms are parsed; a line that is no trajectory is refused."""
    from rolloutd.daemon.forward import line_id
    from rolloutd.daemon.trajectory import Trajectory

    line = Trajectory(id="r-1", reward=1.0).model_dump_json()
    assert line.startswith('{"id":"r-1",') and line_id(line) == "r-1"
    assert line_id('{"id":"r-\\u00e9x","status":"completed"}') == "r-\u00e9x"  # escaped: parsed
    assert line_id('{"status":"completed","id":"r-2"}') == "r-2"  # another order: parsed
    with pytest.raises(KeyError):
        line_id('{"error":{"message":"busy"}}')
    with pytest.raises(ValueError):
        line_id('{"id":7}')
    with pytest.raises(ValueError):
        line_id("not json")


async def test_a_relay_of_more_ids_than_a_url_holds_posts_them(nursery):
    """A client's stream of a big batch: the front relays each peer's share in one stream,
    its ids in the body of a POST past GET_STREAM_IDS (a GET of 3,400 ids or more raised
    httpx's InvalidURL in the relay)."""
    from rolloutd.daemon.streams import GET_STREAM_IDS

    fwd = await forwarder(nursery)
    ids = [f"r-{i:016x}" for i in range(GET_STREAM_IDS + 1)]
    lines = b"".join(b'{"id":"%s","status":"completed"}\n' % i.encode() for i in ids)
    peer = Peer("answer", 200, lines)
    await nursery.start(peer.serve)
    meet(fwd, peer)
    for job_id in ids:
        fwd.live.add(job_id, "peer")
        fwd.remember(job_id, "peer")
    send, recv = trio.open_memory_channel[str](len(ids))
    with trio.fail_after(10):
        await fwd.relay("peer", ids, send)
    got = [line_id(recv.receive_nowait()) for _ in ids]
    assert sorted(got) == ids and len(fwd.live) == 0
    assert [r.split(b" ")[:2] for r in peer.requests] == [[b"POST", b"/v1/rollouts/stream"]]


async def test_a_broken_stream_asks_the_listing_not_every_rollout(nursery, monkeypatch):
    """Once a peer's stream broke (a network blip), the relay looked up every undelivered id
    every POLL_INTERVAL_S: thousands of lookups a second under a big batch, each answered with
    a trajectory so far. Now one listing a poll, and lookups only of what it shows finished."""
    from rolloutd.daemon import forward

    monkeypatch.setattr(forward, "POLL_INTERVAL_S", 0.2)
    fwd, peer = await forwarded(nursery)
    for _ in range(19):
        await fwd.submit(peer.member, BODY, 2, wait=False)
    ids = fwd.live.jobs_on("peer")
    assert len(ids) == 40
    done = ids[7]
    # the stream's answer is no trajectory line: the relay's stream breaks at once
    peer.listing = (200, {"rollouts": [{"id": i, "status": "completed" if i == done else "run"}
                                       for i in ids], "total": len(ids)})
    peer.status, peer.body = 200, {"id": "r-none", "status": "run"}  # every lookup's answer
    before = len(peer.requests)
    send, recv = trio.open_memory_channel[str](len(ids))
    with recv:
        with trio.move_on_after(1.1):  # five polls
            await fwd.relay("peer", ids, send)
    asked = [r.split(b" ")[1] for r in peer.requests[before:]]
    found = [a for a in asked if a.startswith(b"/v1/rollouts/r-")]
    listings = [a for a in asked if a.startswith(b"/v1/rollouts?")]
    assert 3 <= len(listings) <= 6, asked
    assert set(found) == {f"/v1/rollouts/{done}".encode()} and len(found) <= len(listings), asked


# ---- the outbox: submits forwarded to one peer meanwhile go in one request ------------------


def submits_of(peer: Peer, k: int) -> list[dict]:
    """The submits that request ``k`` to the peer carried (POST /v1/federation/submit)."""
    assert peer.requests[k].startswith(b"POST /v1/federation/submit ")
    return json.loads(peer.bodies[k])["submits"]


async def test_submits_forwarded_while_a_request_is_open_go_together_in_the_next(nursery):
    """The first goes at once; the five taken in while the peer holds it go in one request,
    each answered on its own with its own ids."""
    fwd = await forwarder(nursery)
    peer = Peer("answer", 202, {"group_id": "g", "ids": []})
    peer.gate = trio.Event()
    await nursery.start(peer.serve)
    meet(fwd, peer)
    answers = []

    async def submit(k: int) -> None:
        answers.append(await fwd.submit(peer.member, {**BODY, "labels": [f"k{k}"]}, 2, wait=False))

    nursery.start_soon(submit, 0)
    with trio.fail_after(5):
        while not peer.requests:
            await trio.sleep(0.01)
    for k in range(1, 6):
        nursery.start_soon(submit, k)
    await trio.sleep(0.1)
    assert len(peer.requests) == 1  # the others wait for the open request
    peer.gate.set()
    with trio.fail_after(5):
        while len(answers) < 6:
            await trio.sleep(0.01)
    assert len(peer.requests) == 2
    first, rest = submits_of(peer, 0), submits_of(peer, 1)
    assert [s["request"]["labels"] for s in first] == [["k0"]]
    assert sorted(s["request"]["labels"][0] for s in rest) == ["k1", "k2", "k3", "k4", "k5"]
    assert all(s["request"]["idempotency_key"].startswith("fwd-") and len(s["ids"]) == 2 for s in rest)
    assert json.loads(peer.bodies[1])["origin"] == "front"
    assert {a.status for a in answers} == {202}
    sent_ids = sorted(i for s in first + rest for i in s["ids"])
    assert sorted(fwd.live.jobs_on("peer")) == sent_ids and len(sent_ids) == 12
    assert fwd.statistics()["submit_requests"] == 2 and fwd.statistics()["forwarded_total"] == 12
    assert all(a.raw == json.dumps(a.body, separators=(",", ":")).encode() for a in answers)


async def test_a_peer_without_the_submits_route_is_sent_one_request_per_submit(nursery):
    """An older peer answers 404 to the route: that request held nothing it took, so its
    submits go the old way (POST /v1/rollouts with the ids in headers), and so does every
    later one to that peer."""
    fwd = await forwarder(nursery)
    peer = Peer("answer", 202, {"group_id": "g", "ids": []})
    peer.submits_route = False
    await nursery.start(peer.serve)
    meet(fwd, peer)
    for _ in range(2):
        assert (await fwd.submit(peer.member, BODY, 2, wait=False)).status == 202
    paths = [r.split(b" ", 2)[1] for r in peer.requests]
    assert paths == [b"/v1/federation/submit", b"/v1/rollouts", b"/v1/rollouts"]
    assert len(fwd.live) == 4 and fwd.statistics()["forwarded_total"] == 4
    peer.submits_route = True  # it comes back (dead, then alive) as a newer version
    await fwd.on_rejoin(peer.member)
    assert (await fwd.submit(peer.member, BODY, 2, wait=False)).status == 202
    assert peer.requests[-1].startswith(b"POST /v1/federation/submit ")


async def test_submits_too_large_together_for_the_peer_go_one_request_each(nursery):
    fwd = await forwarder(nursery)
    peer = Peer("answer", 202, {"group_id": "g", "ids": []})
    peer.route_answer = (413, {"error": {"type": "body_too_large", "message": "too large"}})
    await nursery.start(peer.serve)
    meet(fwd, peer)
    for _ in range(2):
        assert (await fwd.submit(peer.member, BODY, 2, wait=False)).status == 202
    paths = [r.split(b" ", 2)[1] for r in peer.requests]
    assert paths == [b"/v1/federation/submit", b"/v1/rollouts"] * 2  # the route is tried again
    assert len(fwd.live) == 4


async def test_a_submit_whose_client_left_before_it_was_sent_never_leaves(nursery):
    fwd = await forwarder(nursery)
    peer = Peer("answer", 202, {"group_id": "g", "ids": []})
    peer.gate = trio.Event()
    await nursery.start(peer.serve)
    meet(fwd, peer)
    nursery.start_soon(functools.partial(fwd.submit, peer.member, BODY, 2, wait=False))
    with trio.fail_after(5):
        while not peer.requests:
            await trio.sleep(0.01)
    with trio.move_on_after(0.1):  # the client goes away while its submit waits in the outbox
        await fwd.submit(peer.member, {**BODY, "labels": ["gone"]}, 2, wait=False)
    assert len(fwd.live) == 2  # only the first's ids
    peer.gate.set()
    with trio.fail_after(5):
        while fwd.statistics()["forwarded_total"] < 2:
            await trio.sleep(0.01)
    await trio.sleep(0.1)
    assert len(peer.requests) == 1 and len(fwd.live) == 2


@pytest.mark.parametrize("status", [400, 429, 503])
async def test_a_refusal_of_the_whole_request_is_proof_the_peer_holds_none(nursery, status):
    """429, 503 (draining, full): the front may run them itself; a 4xx (the request refused
    as a whole): the client hears it, and the front holds nothing of them either."""
    fwd = await forwarder(nursery)
    peer = Peer("answer")
    peer.route_answer = (status, {"error": {"type": "x", "message": "refused"}})
    await nursery.start(peer.serve)
    meet(fwd, peer)
    if status == 400:
        answer = await fwd.submit(peer.member, BODY, 2, wait=False)
        assert answer.status == 400 and answer.body["error"]["message"] == "refused"
    else:
        with pytest.raises(PeerUnavailable):
            await fwd.submit(peer.member, BODY, 2, wait=False)
    assert len(fwd.live) == 0 and not fwd.statistics()["lost"]


@pytest.mark.parametrize("how", ["slam", "500", "garbled"])
async def test_submits_sent_and_never_answered_are_lost_not_run_twice(nursery, how):
    """The request reached the peer (it may hold them): no answer after the retry, a 500 (a
    bug that may have struck half-way), or a 200 that is not the answers: every submit in it
    is failed/peer_lost, and PeerUnavailable is NOT raised (the front does not run them)."""
    fwd = await forwarder(nursery)
    peer = Peer("slam") if how == "slam" else Peer("answer")
    peer.route_answer = {"500": (500, {"error": {"type": "internal", "message": "bug"}}),
                         "garbled": (200, {"answers": "?"}), "slam": None}[how]
    await nursery.start(peer.serve)
    meet(fwd, peer)
    answer = await fwd.submit(peer.member, BODY, 2, wait=False)
    assert answer.status == 202 and len(answer.body["ids"]) == 2
    for job_id in answer.body["ids"]:
        assert (await fwd.get(job_id)).body["error"]["type"] == "peer_lost"
    assert len(peer.requests) == (2 if how == "slam" else 1)  # the slammed one was retried once
