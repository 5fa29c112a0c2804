"""Membership with capacity gossip: push-pull to a few random peers per interval.

Every member keeps a table of all members it knows. Each interval it bumps its own
heartbeat, refreshes its capacity from the daemon's callback, and POSTs its whole table to
`fanout` random live peers (plus a seed it has not met yet, plus one dead member to notice
rejoins); each peer merges the table and answers with its own, which the sender merges in
turn (push-pull). An exchange a peer started with us since our last round counts towards
our `fanout` (it synced both tables as ours would have): we contact `fanout` minus those, at
least one. So every member still takes part in about `fanout` exchanges a round, with half
the requests of everyone contacting `fanout` (the HTTP of gossip is what it costs). With a
datagram address (`datagram_bind`, the daemon's own host and port) an exchange goes in one
UDP datagram each way (`_datagram`), and over HTTP only when a peer does not answer one.

Merging compares (incarnation, heartbeat, state rank): only the owner advances its
heartbeat, so a newer version is proof of life and makes the member ALIVE again. A member
whose version has not advanced for `suspect_after_s` becomes SUSPECT, after `dead_after_s`
DEAD. Suspicion and death travel in gossip too (at an equal version, suspect beats alive and
dead beats suspect, as in SWIM); a member that hears itself suspected or dead refutes it by
bumping its incarnation. A restarted member starts from a new incarnation (the wall clock in
milliseconds), and bumps past any higher one it hears about itself. On shutdown a member
announces LEFT to its peers, so they stop placing work on it at once.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import trio

from ._datagram import GossipSocket
from ._exceptions import DatagramError, GossipPayloadError, PeerAuthError, PeerError
from ._member import Member, MemberState
from ._placement import Placement, homes_among, local_headroom
from ._settings import GossipSettings
from ._wire import (
    GOSSIP_PATH,
    PROTOCOL_VERSION,
    Capacity,
    MemberRecord,
    auth_headers,
    check_capacity,
    normalize_url,
    parse_payload,
)

log = logging.getLogger(__name__)

MemberCallback = Callable[[Member], Awaitable[None]]

_JITTER = 0.1  # each sleep is gossip_interval_s * (1 +- _JITTER), so members do not sync up
_LEAVE_TIMEOUT_S = 1.0  # bound on the LEFT announcement at shutdown
_CLOSE_TIMEOUT_S = 1.0
_HTTP_ONLY_S = 60.0  # a peer that answered HTTP but not a datagram gets HTTP this long
_DEFAULTS = GossipSettings()


@dataclass(frozen=True, slots=True)
class FederationStatistics:
    rounds: int  # gossip rounds started
    exchanges: int  # push-pull exchanges this node started that succeeded
    datagram_exchanges: int  # of those, the ones that went over UDP (the rest over HTTP)
    answered: int  # exchanges peers started with this node
    failures: int  # exchanges that failed (unreachable, timeout, bad answer)
    auth_failures: int  # exchanges a peer refused (401/403)
    refutations: int  # times this node bumped its incarnation to refute suspicion
    members: dict[str, int]  # state -> number of members (this node included)
    placements: dict[str, int]  # tasks with an image: "image_home" (on a home), "image_spilled"


class Federation:
    """This node's membership in the federation: gossip, failure detection, placement.

    `capacity` is called (synchronously; it must not block) once per gossip interval and by
    `place()`; it returns this node's Capacity. `on_dead` is awaited when a known member
    becomes DEAD or LEFT (fail its forwarded jobs), `on_rejoin` when such a member is ALIVE
    again (cancel its orphans); both run one at a time, in order, in the Federation's own
    task, and an exception from one propagates out of `run()` (a daemon bug). The gossip
    settings must make a valid GossipSettings (else FederationSettingError). `transport`
    replaces the HTTP transport of the one httpx.AsyncClient that `run()` owns (tests route
    it in-process); the Federation closes it. `datagram_bind` (host, port): where `run()`
    listens for gossip datagrams and sends its own from (the port of this node's URL, over
    UDP); None gossips over HTTP only.
    """

    def __init__(
        self,
        node_id: str,
        url: str,
        *,
        seeds: Sequence[str] = (),
        capacity: Callable[[], Capacity],
        token: str | None = None,
        gossip_interval_s: float = _DEFAULTS.gossip_interval_s,
        fanout: int = _DEFAULTS.fanout,
        suspect_after_s: float = _DEFAULTS.suspect_after_s,
        dead_after_s: float = _DEFAULTS.dead_after_s,
        request_timeout_s: float = _DEFAULTS.request_timeout_s,
        transport: httpx.AsyncBaseTransport | None = None,
        datagram_bind: tuple[str, int] | None = None,
        on_dead: MemberCallback | None = None,
        on_rejoin: MemberCallback | None = None,
        incarnation: int | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if isinstance(seeds, str):
            raise TypeError("seeds must be a sequence of URLs, not one string")
        if not node_id:
            raise ValueError("node_id must not be empty")
        gossip = GossipSettings(  # raises FederationSettingError naming the bad setting
            gossip_interval_s=gossip_interval_s,
            fanout=fanout,
            suspect_after_s=suspect_after_s,
            dead_after_s=dead_after_s,
            request_timeout_s=request_timeout_s,
        )
        self._url = normalize_url(url)
        self._seeds = tuple(dict.fromkeys(normalize_url(s) for s in seeds if s.strip()))
        self._capacity = capacity
        self._token = token or None
        self._gossip = gossip
        self._transport = transport
        self._datagram_bind = datagram_bind
        self._datagrams: GossipSocket | None = None
        self._http_only: dict[str, float] = {}  # url -> until when its exchanges use HTTP
        self._on_dead = on_dead
        self._on_rejoin = on_rejoin
        self._rng = rng or random.Random()
        self._placement = Placement(rng=self._rng)
        if incarnation is None:
            incarnation = time.time_ns() // 1_000_000
        self._me = Member(node_id=node_id, url=self._url, incarnation=incarnation)
        self._peers: dict[str, Member] = {}
        self._events: deque[tuple[Literal["dead", "rejoin"], Member]] = deque()
        self._wake = trio.Event()
        self._news = trio.Event()  # set (and replaced) when a peer's report or state changes
        self._in_flight: set[str] = set()
        self._heard: set[str] = set()  # peers that exchanged with us since our last round
        self._warned: set[str] = set()
        self._started = False
        self._leaving = False
        self._rounds = self._exchanges = self._failures = self._answered = 0
        self._datagram_exchanges = 0
        self._auth_failures = self._refutations = 0

    # ---- reading -------------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self._me.node_id

    @property
    def url(self) -> str:
        return self._me.url

    @property
    def incarnation(self) -> int:
        return self._me.incarnation

    @property
    def version(self) -> tuple[int, int]:
        """(incarnation, heartbeat) now: a capacity report of a later heartbeat was sampled
        after this moment."""
        return self._me.version

    @property
    def gossip(self) -> GossipSettings:
        """The gossip settings this member runs with."""
        return self._gossip

    def members(self) -> list[dict[str, Any]]:
        """Every known member, this node included, sorted by node id (GET .../members)."""
        now = trio.current_time()
        self._detect(now)
        rows = [self._me.to_dict(now=now, is_self=True)]
        rows += [m.to_dict(now=now) for m in self._peers.values()]
        return sorted(rows, key=lambda r: r["node_id"])

    def member(self, node_id: str) -> Member | None:
        """A copy of a member (this node included), or None when unknown."""
        if node_id == self._me.node_id:
            return self._me.copy()
        m = self._peers.get(node_id)
        return m.copy() if m is not None else None

    def image_homes(self, image: str) -> list[str]:
        """``image``'s homes as placement's rule 0 sees them now: among the peers that
        accept work, and this node when it does."""
        here = local_headroom(check_capacity(self._capacity()))
        return homes_among(image, self._peers.values(), self.node_id,
                           local_accepts=here is not None)

    def peers(self) -> list[Member]:
        """Copies of every other known member, in any state."""
        return [m.copy() for m in self._peers.values()]

    async def wait_for_news(self) -> None:
        """Return at the next change in what ``peers()`` shows but for heartbeats: a member met,
        a peer's capacity report that differs from its last, a peer's state. A heartbeat that
        reports the same capacity is not news, so an idle federation wakes no one."""
        await self._news.wait()

    def _tell_news(self) -> None:
        self._news.set()
        self._news = trio.Event()

    def statistics(self) -> FederationStatistics:
        counts = {s.value: 0 for s in MemberState}
        for m in (self._me, *self._peers.values()):
            counts[m.state.value] += 1
        return FederationStatistics(
            rounds=self._rounds,
            exchanges=self._exchanges,
            datagram_exchanges=self._datagram_exchanges,
            answered=self._answered,
            failures=self._failures,
            auth_failures=self._auth_failures,
            refutations=self._refutations,
            members=counts,
            placements={"image_home": self._placement.image_home,
                        "image_spilled": self._placement.image_spilled},
        )

    # ---- placement -----------------------------------------------------------------------

    def place(self, local: Capacity | None = None, *, n: int = 1,
              image: str | None = None) -> Member | None:
        """Where a new rollout submitted here should run: None = here, else a copy of the peer.

        `local` is this node's capacity now (default: ask the capacity callback); `n`, the
        request's samples; `image`, its task's image ref (its homes come first). Power of
        two choices over the peers' headroom, every peer for a request of several samples
        (see Placement).
        The chosen peer's headroom is debited by `n` until a capacity report of it counts
        them (see forwarded()), so a burst spreads out instead of piling on the peer that
        looked emptiest. Never call it for a request that carries
        the forwarded header: such a job always runs where it arrived.
        """
        self._detect(trio.current_time())
        here = check_capacity(self._capacity() if local is None else local)
        chosen = self._placement.choose(here, list(self._peers.values()), image=image,
                                        local_id=self.node_id, n=n)
        if chosen is None:
            return None
        chosen.in_flight += n
        return chosen.copy()

    def forwarded(
        self, node_id: str, took_at: tuple[int, int] | None, *, taken: bool, n: int = 1
    ) -> None:
        """A forward of `n` samples that place() chose `node_id` for has its answer: the peer
        took them (`taken`; at version `took_at` when its answer says) or provably did not.
        Taken samples stay debited from the peer's headroom until a capacity report of a
        later heartbeat counts them, however late that report (or an older one) arrives."""
        m = self._peers.get(node_id)
        if m is None:
            return
        m.in_flight = max(0, m.in_flight - n)
        if not taken:
            return
        incarnation, heartbeat = took_at if took_at is not None else m.version  # an older peer
        if incarnation == m.incarnation and heartbeat >= m.heartbeat:
            m.unreported += [heartbeat] * n

    # ---- the gossip route ----------------------------------------------------------------

    def handle_gossip(self, payload: Any) -> dict[str, Any]:
        """What POST /v1/federation/gossip does: merge the peer's view, return ours.

        Raises GossipPayloadError (answer 400) when the payload is malformed; merges nothing
        in that case. The route checks the bearer token before calling this."""
        records = parse_payload(payload)
        self._merge(records, trio.current_time())
        self._answered += 1
        if records and records[0]["node_id"] in self._peers:  # the sender's own record comes first
            self._heard.add(records[0]["node_id"])
        return self._payload()

    # ---- the loop ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Gossip until cancelled; started() after the first exchange with seeds was tried.

        On cancellation announces LEFT to the live peers (shielded, bounded)."""
        if self._started:
            raise RuntimeError("Federation.run() can only be called once")
        self._started = True
        client = httpx.AsyncClient(
            transport=self._transport,
            timeout=httpx.Timeout(self._gossip.request_timeout_s),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64, keepalive_expiry=60.0),
        )
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._dispatch_events)
                await self._open_datagrams(nursery)
                self._tick()
                async with trio.open_nursery() as first:  # the first round, awaited
                    for url in self._targets():
                        first.start_soon(self._exchange, client, url)
                log.info(
                    "federation: %s joined at %s (incarnation %d, %d members known)",
                    self.node_id,
                    self.url,
                    self.incarnation,
                    len(self._peers) + 1,
                )
                task_status.started()
                while True:
                    await trio.sleep(self._gossip.gossip_interval_s * self._rng.uniform(1 - _JITTER, 1 + _JITTER))
                    self._tick()
                    for url in self._targets():
                        if url not in self._in_flight:
                            nursery.start_soon(self._exchange, client, url)
        finally:
            with trio.move_on_after(_LEAVE_TIMEOUT_S, shield=True):
                await self._leave(client)
            with trio.move_on_after(_CLOSE_TIMEOUT_S, shield=True):
                await client.aclose()

    async def _open_datagrams(self, nursery: trio.Nursery) -> None:
        if self._datagram_bind is None:
            return
        sock = GossipSocket(self._token, self.handle_gossip)
        host, port = self._datagram_bind
        try:
            await nursery.start(sock.run, host, port)
        except OSError as exc:
            log.warning("federation: no gossip datagrams on %s port %d (%s); gossiping over HTTP",
                        host, port, exc)
            return
        self._datagrams = sock
        self._me.datagrams = True  # our record says so from the first round on

    def _tick(self) -> None:
        """One heartbeat: advance our version, refresh capacity, update suspicions."""
        self._rounds += 1
        me = self._me
        me.heartbeat += 1
        me.updated_at = time.time()
        try:
            me.capacity = check_capacity(self._capacity())
        except GossipPayloadError as exc:
            raise TypeError(f"the capacity callback returned a bad Capacity: {exc}") from exc
        self._detect(trio.current_time())

    def _targets(self) -> list[str]:
        """Peers to gossip with this round: `fanout` live ones less those that exchanged with
        us since the last round (at least one, none of those), an unmet seed, a dead one."""
        live = [m for m in self._peers.values() if not m.state.gone]
        gone = [m.url for m in self._peers.values() if m.state.gone]
        known = {m.url for m in self._peers.values()} | {self._url}
        unmet = [s for s in self._seeds if s not in known]
        heard = {m.node_id for m in live} & self._heard
        self._heard = set()
        others = [m.url for m in live if m.node_id not in heard] or [m.url for m in live]
        k = max(1, self._gossip.fanout - len(heard))
        targets = self._rng.sample(others, min(k, len(others)))
        n_seeds = 1 if live else self._gossip.fanout
        targets += self._rng.sample(unmet, min(n_seeds, len(unmet)))
        if gone:
            targets.append(self._rng.choice(gone))
        return list(dict.fromkeys(targets))

    async def _exchange(self, client: httpx.AsyncClient, url: str) -> None:
        """One push-pull with `url`, bounded by request_timeout_s; failures are counted."""
        self._in_flight.add(url)
        try:
            with trio.move_on_after(self._gossip.request_timeout_s) as scope:
                records = await self._push_pull(client, url, self._payload())
                self._merge(records, trio.current_time())
                self._exchanges += 1
                self._warned.discard(url)
            if scope.cancelled_caught:
                self._failures += 1
                log.debug("federation: gossip to %s timed out", url)
        except PeerAuthError as exc:
            self._auth_failures += 1
            self._warn_once(url, "federation: %s", exc)
        except (PeerError, GossipPayloadError) as exc:
            self._failures += 1
            log.debug("federation: gossip to %s failed: %s", url, exc)
        finally:
            self._in_flight.discard(url)

    async def _push_pull(
        self, client: httpx.AsyncClient, url: str, payload: dict[str, Any]
    ) -> list[MemberRecord]:
        """One exchange's answer: by datagram when this node has a socket, the peer's record
        says it has one (so a seed not met yet, or an older member, gets HTTP), and `url` has
        not been put on HTTP lately, given half the exchange's time; else, or when that
        fails, over HTTP. A peer that then answers HTTP gets HTTP for `_HTTP_ONLY_S` (UDP
        blocked on the way, or lost)."""
        sock, now = self._datagrams, trio.current_time()
        if (sock is None or self._http_only.get(url, 0.0) > now
                or not any(m.url == url and m.datagrams for m in self._peers.values())):
            return await self._post(client, url, payload)
        answer: Any = None
        with trio.move_on_after(self._gossip.request_timeout_s / 2):
            try:
                answer = await sock.exchange(url, payload)
            except DatagramError as exc:
                log.debug("federation: gossip datagram to %s: %s", url, exc)
        if answer is not None:
            records = parse_payload(answer)
            self._datagram_exchanges += 1
            return records
        records = await self._post(client, url, payload)
        if url not in self._http_only:
            log.info("federation: %s answers gossip over HTTP, not UDP; using HTTP with it "
                     "(UDP is tried again every %g s)", url, _HTTP_ONLY_S)
        self._http_only[url] = trio.current_time() + _HTTP_ONLY_S
        return records

    async def _post(
        self, client: httpx.AsyncClient, url: str, payload: dict[str, Any]
    ) -> list[MemberRecord]:
        try:
            resp = await client.post(
                url + GOSSIP_PATH, json=payload, headers=auth_headers(self._token)
            )
        except httpx.HTTPError as exc:
            raise PeerError(f"gossip to {url} failed: {exc!r}", peer=url) from exc
        if resp.status_code in (401, 403):
            raise PeerAuthError(
                f"peer {url} refused our token (HTTP {resp.status_code}); "
                "every daemon of a federation needs the same token",
                peer=url,
            )
        if resp.status_code != 200:
            raise PeerError(f"gossip to {url} answered HTTP {resp.status_code}", peer=url)
        try:
            body = resp.json()
        except ValueError as exc:
            raise PeerError(f"gossip answer from {url} is not JSON", peer=url) from exc
        return parse_payload(body)

    async def _leave(self, client: httpx.AsyncClient) -> None:
        """Tell the live peers we are leaving, so they stop placing work here."""
        self._leaving = True
        self._me.state = MemberState.LEFT
        self._me.heartbeat += 1
        self._me.updated_at = time.time()
        live = [m.url for m in self._peers.values() if not m.state.gone]
        if not live:
            return
        payload = self._payload()
        async with trio.open_nursery() as nursery:
            for url in live[: 3 * self._gossip.fanout]:
                nursery.start_soon(self._announce, client, url, payload)

    async def _announce(self, client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> None:
        try:
            await self._post(client, url, payload)
        except (PeerError, GossipPayloadError) as exc:
            log.debug("federation: leave announcement to %s failed: %s", url, exc)

    async def _dispatch_events(self) -> None:
        """Run on_dead/on_rejoin callbacks one at a time, in the order the changes happened."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._events:
                kind, member = self._events.popleft()
                callback = self._on_dead if kind == "dead" else self._on_rejoin
                if callback is not None:
                    await callback(member)

    # ---- merging -------------------------------------------------------------------------

    def _payload(self) -> dict[str, Any]:
        members = [self._me.record(), *(m.record() for m in self._peers.values())]
        return {"protocol": PROTOCOL_VERSION, "members": members}

    def _merge(self, records: list[MemberRecord], now: float) -> None:
        for r in records:
            if r["node_id"] == self._me.node_id:
                self._refute(r)
            else:
                self._merge_peer(r, now)

    def _merge_peer(self, r: MemberRecord, now: float) -> None:
        state = MemberState(r["state"])
        m = self._peers.get(r["node_id"])
        if m is None:
            if r["url"] == self._url:
                self._warn_once(
                    r["url"], "federation: %s claims our URL %s", r["node_id"], r["url"]
                )
                return
            self._peers[r["node_id"]] = Member(
                node_id=r["node_id"],
                url=r["url"],
                incarnation=r["incarnation"],
                heartbeat=r["heartbeat"],
                capacity=r["capacity"],
                updated_at=r["updated_at"],
                state=state,
                datagrams=r.get("datagrams", False),
                last_heard=now,
            )
            log.info("federation: met %s at %s (%s)", r["node_id"], r["url"], state.value)
            self._tell_news()
            return
        if (r["incarnation"], r["heartbeat"], state.rank) <= (*m.version, m.state.rank):
            return
        before = m.state
        if (r["incarnation"], r["heartbeat"]) > m.version:
            m.last_heard = now
            m.reported(r["incarnation"], r["heartbeat"])  # what its report counts of ours
        if r["capacity"] != m.capacity:
            self._tell_news()
        m.url, m.incarnation, m.heartbeat = r["url"], r["incarnation"], r["heartbeat"]
        m.capacity, m.updated_at, m.state = r["capacity"], r["updated_at"], state
        m.datagrams = r.get("datagrams", False)
        self._changed(m, before)

    def _refute(self, r: MemberRecord) -> None:
        """A record about ourselves: refute suspicion/death, and outrun a former self."""
        me = self._me
        if r["url"] != me.url:
            self._warn_once(
                r["url"], "federation: node id %s is used by %s too", me.node_id, r["url"]
            )
            return
        if self._leaving:
            return
        newer = (r["incarnation"], r["heartbeat"]) > me.version
        doubted = r["incarnation"] == me.incarnation and r["state"] != MemberState.ALIVE.value
        if newer or doubted:
            me.incarnation = max(me.incarnation, r["incarnation"]) + 1
            me.updated_at = time.time()
            self._refutations += 1
            log.info(
                "federation: refuting %s about us; incarnation now %d", r["state"], me.incarnation
            )

    def _detect(self, now: float) -> None:
        """Members whose version has not advanced for long become SUSPECT, then DEAD."""
        for m in self._peers.values():
            if m.state.gone:
                continue
            silent = now - m.last_heard
            before = m.state
            if silent >= self._gossip.dead_after_s:
                m.state = MemberState.DEAD
            elif silent >= self._gossip.suspect_after_s:
                m.state = MemberState.SUSPECT
            self._changed(m, before)

    def _changed(self, m: Member, before: MemberState) -> None:
        if m.state is before:
            return
        self._tell_news()
        log.info("federation: %s is %s (was %s)", m.node_id, m.state.value, before.value)
        if m.state.gone and not before.gone:
            self._events.append(("dead", m.copy()))
            self._wake.set()
        elif before.gone and not m.state.gone:
            self._events.append(("rejoin", m.copy()))
            self._wake.set()

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)
