"""Gossip over UDP datagrams: real sockets on loopback, the HTTP fallback in-process."""

from __future__ import annotations

import socket
from functools import partial
from typing import Any

import pytest
import trio

from rolloutd.federation import DatagramError, Federation
from rolloutd.federation._datagram import (
    ANSWER,
    ASK,
    MAX_DATAGRAM,
    REFUSED,
    GossipSocket,
    datagram_key,
    seal,
    unseal,
)
from rolloutd.federation.testing import InProcessNetwork

from .conftest import Cap

NONCE = b"12345678"


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_sealed_datagram_opens_only_under_its_key_and_unaltered():
    key = datagram_key("tok")
    data = seal(key, ASK, NONCE, b'{"a":1}')
    assert unseal(key, data) == (ASK, NONCE, b'{"a":1}')
    for bad in (data[:-1] + b"2", data[:20], b"xxxx" + data[4:]):
        with pytest.raises(DatagramError):
            unseal(key, bad)
    with pytest.raises(DatagramError) as caught:
        unseal(datagram_key("other"), data)
    assert caught.value.nonce == NONCE  # the receiver can answer it REFUSED
    with pytest.raises(DatagramError) as caught:
        unseal(datagram_key("other"), seal(key, ANSWER, NONCE, b"{}"))
    assert caught.value.nonce is None  # an answer is never answered
    assert datagram_key(None) == datagram_key("") == b""
    assert datagram_key("tok") != b"tok"  # derived, never the token itself
    # a refusal carries no MAC: it can only make the sender use HTTP
    assert unseal(key, seal(key, REFUSED, NONCE)) == (REFUSED, NONCE, b"")


async def start(nursery: trio.Nursery, token: str | None, answer: Any) -> tuple[GossipSocket, str]:
    sock = GossipSocket(token, answer)
    host, port = await nursery.start(sock.run, "127.0.0.1", 0)
    return sock, f"http://{host}:{port}"


async def test_an_exchange_carries_the_table_both_ways(nursery):
    seen: list[Any] = []

    def answer(payload: Any) -> dict[str, Any]:
        seen.append(payload)
        return {"members": ["b"]}

    a, _ = await start(nursery, "tok", lambda p: {})
    b, b_url = await start(nursery, "tok", answer)
    with trio.fail_after(5):
        got = await a.exchange(b_url, {"members": ["a"]})
    assert got == {"members": ["b"]} and seen == [{"members": ["a"]}]
    assert (a.asks, b.answers, b.refused) == (1, 1, 0)
    nursery.cancel_scope.cancel()


async def test_another_token_is_refused_at_once_and_never_answered(nursery):
    called: list[Any] = []
    a, _ = await start(nursery, "tok-a", lambda p: {})
    b, b_url = await start(nursery, "tok-b", lambda p: called.append(p) or {})
    with trio.fail_after(5), pytest.raises(DatagramError, match="refused"):
        await a.exchange(b_url, {"members": []})
    assert called == [] and b.refused == 1 and b.answers == 0
    nursery.cancel_scope.cancel()


async def test_a_payload_that_is_no_table_is_refused(nursery):
    def answer(payload: Any) -> dict[str, Any]:
        from rolloutd.federation import GossipPayloadError

        raise GossipPayloadError("not a table")

    a, _ = await start(nursery, None, lambda p: {})
    b, b_url = await start(nursery, None, answer)
    with trio.fail_after(5), pytest.raises(DatagramError, match="refused"):
        await a.exchange(b_url, {"members": 3})
    assert b.refused == 1
    nursery.cancel_scope.cancel()


async def test_json_nested_past_the_parsers_depth_is_refused_not_a_crash(nursery):
    """A datagram with a valid MAC (so from a holder of the token) whose body nests deeper
    than Python's json parser recurses: refused, and the socket keeps serving."""
    a, _ = await start(nursery, "tok", lambda p: {})
    b, b_url = await start(nursery, "tok", lambda p: {"ok": True})
    port = int(b_url.rsplit(":", 1)[1])
    deep = b"[" * 30_000 + b"]" * 30_000
    with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
        await raw.sendto(seal(datagram_key("tok"), ASK, NONCE, deep), ("127.0.0.1", port))
        with trio.fail_after(5):
            assert unseal(b"", await raw.recv(100))[:2] == (REFUSED, NONCE)
    with trio.fail_after(5):
        assert await a.exchange(b_url, {}) == {"ok": True}
    nursery.cancel_scope.cancel()


async def test_tables_too_large_for_a_datagram_go_over_http(nursery):
    big = {"members": ["x" * 100] * (MAX_DATAGRAM // 100)}
    a, _ = await start(nursery, "tok", lambda p: {})
    b, b_url = await start(nursery, "tok", lambda p: big)
    with trio.fail_after(5), pytest.raises(DatagramError, match="does not fit"):
        await a.exchange(b_url, big)  # never sent
    assert a.asks == 0
    with trio.fail_after(5), pytest.raises(DatagramError, match="does not fit"):
        await a.exchange(b_url, {"members": []})  # b's answer would not fit: it says so
    nursery.cancel_scope.cancel()


async def test_garbage_is_ignored_and_the_socket_keeps_serving(nursery):
    a, _ = await start(nursery, "tok", lambda p: {})
    b, b_url = await start(nursery, "tok", lambda p: {"ok": True})
    port = int(b_url.rsplit(":", 1)[1])
    with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
        for junk in (b"", b"hello", b"rdg1", b"rdg1Z12345678", seal(b"", ANSWER, NONCE, b"{}")):
            await raw.sendto(junk, ("127.0.0.1", port))
        with trio.move_on_after(0.2):
            await raw.recv(100)
            pytest.fail("garbage was answered")
    with trio.fail_after(5):
        assert await a.exchange(b_url, {}) == {"ok": True}
    assert b.refused == 0  # an unknown kind or an unasked answer gets no reply either
    nursery.cancel_scope.cancel()


async def test_federations_gossip_over_udp_and_fall_back_to_http_per_peer(nursery):
    """a and b have datagram sockets on their URLs' ports: they exchange over UDP only. d has
    none, and says so in its record: everyone uses HTTP with it (in-process here) from the
    start. c listens on another port than its URL's (as if a firewall dropped UDP): a and b
    wait for UDP once (request_timeout_s / 2), then use HTTP with c for a while."""
    net = InProcessNetwork()
    ports = [free_udp_port() for _ in range(5)]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:4]]
    binds = [("127.0.0.1", ports[0]), ("127.0.0.1", ports[1]), ("127.0.0.1", ports[4]), None]
    feds = []
    for i, url in enumerate(urls):
        fed = Federation(f"n{i}", url, seeds=urls, capacity=Cap(), token="tok",
                         gossip_interval_s=0.05, suspect_after_s=3.0, dead_after_s=6.0,
                         request_timeout_s=0.4, transport=net.transport(url), datagram_bind=binds[i])
        net.add(fed, token="tok")
        feds.append(fed)
        await nursery.start(fed.run)
    await trio.sleep(1.5)
    a, b, c, d = feds
    for fed in feds:
        assert [m["state"] for m in fed.members()] == ["alive"] * 4
    udp = [fed.statistics().datagram_exchanges for fed in feds]
    assert sum(udp) > 20 and udp[3] == 0 and d.statistics().exchanges > 5
    # c's own asks go out from its socket to a's and b's ports, so they work both ways
    assert udp[2] > 5
    assert [m.datagrams for m in a.peers()] == [True, True, False]  # b, c, d as they say
    assert set(a._http_only) <= {urls[2]} and set(b._http_only) <= {urls[2]}
    assert urls[2] in a._http_only or urls[2] in b._http_only
    failures = [fed.statistics().failures for fed in feds]  # the first round met members not up yet
    http_before = net.requests
    await trio.sleep(0.5)
    assert sum(fed.statistics().datagram_exchanges for fed in feds) > sum(udp)
    assert [fed.statistics().failures for fed in feds] == failures
    assert net.requests > http_before  # with c and d
    nursery.cancel_scope.cancel()


async def test_a_federation_whose_port_is_taken_gossips_over_http(nursery, caplog):
    net = InProcessNetwork()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        fed = Federation("n0", url, capacity=Cap(), transport=net.transport(url),
                         datagram_bind=("127.0.0.1", port))
        net.add(fed)
        await nursery.start(fed.run)
        assert "no gossip datagrams" in caplog.text
        assert fed._datagrams is None
    nursery.cancel_scope.cancel()


async def test_the_socket_closes_with_its_task():
    sock = GossipSocket(None, lambda p: {})
    async with trio.open_nursery() as nursery:
        addr = await nursery.start(partial(sock.run, "127.0.0.1", 0))
        nursery.cancel_scope.cancel()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as again:
        again.bind(addr)  # free again
    with pytest.raises(DatagramError, match="no gossip socket"):
        await sock.exchange("http://127.0.0.1:1", {})
