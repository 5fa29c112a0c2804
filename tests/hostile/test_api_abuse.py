"""Slow clients against the daemon's real hypercorn socket (the rest of the API abuse list,
auth on every route and oversized or deeply nested bodies, is in tests/daemon/test_api.py;
schemathesis in test_schemathesis.py)."""

from __future__ import annotations

import os

import httpx
import pytest
import trio

import rolloutd.daemon.node  # noqa: F401
from rolloutd import daemon
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services
from tests.daemon.conftest import make_settings

TRICKLERS = 100


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_slowloris_does_not_block_others_and_is_cut_off(tmp_path, monkeypatch) -> None:
    """Clients that send their headers a byte at a time hold a connection each, but others are
    answered at once, and hypercorn's idle timer (``KEEP_ALIVE_TIMEOUT_S``, which runs until a
    request's headers are complete) closes every trickler. No read timeout is set: a
    ``wait=true`` request or a stream sends nothing for as long as its rollouts take."""
    monkeypatch.setattr(daemon.node, "KEEP_ALIVE_TIMEOUT_S", 1.5)
    fds = _fds()
    node = Node(make_settings(tmp_path, token="tok"), services=Services())
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        host, port = node.urls[0].removeprefix("http://").split(":")
        closed_after: list[float] = []
        head = b"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\nX-Slow: " + b"a" * 500

        async def trickle() -> None:
            stream = await trio.open_tcp_stream(host, int(port))
            t0 = trio.current_time()
            async with stream:
                try:
                    for i in range(len(head)):
                        await stream.send_all(head[i:i + 1])
                        with trio.move_on_after(0.1):
                            if await stream.receive_some(1024) == b"":
                                break
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            closed_after.append(trio.current_time() - t0)

        latencies: list[float] = []
        async with trio.open_nursery() as attack:
            for _ in range(TRICKLERS):
                attack.start_soon(trickle)
            await trio.sleep(0.3)
            async with httpx.AsyncClient(base_url=node.urls[0], headers={"Authorization": "Bearer tok"},
                                         timeout=5) as h:
                for _ in range(20):
                    t0 = trio.current_time()
                    assert (await h.get("/v1/status")).status_code == 200
                    assert (await h.get("/healthz")).status_code == 200
                    latencies.append(trio.current_time() - t0)
        assert max(latencies) < 1.0, latencies
        assert len(closed_after) == TRICKLERS
        # cut off by the server, long before the 500 header bytes were sent (50 s)
        assert max(closed_after) < 1.5 + 3.0, max(closed_after)
        node.request_stop()
    with trio.fail_after(5):
        while _fds() > fds:
            await trio.sleep(0.05)


@pytest.mark.parametrize("size", [256 * 1024, 4 * 1024 * 1024])
async def test_huge_headers_are_refused(tmp_path, size: int) -> None:
    """A header block past the bound on an incomplete request head (MAX_REQUEST_HEAD_BYTES,
    200 KiB, checked per read of up to 64 KiB) is an error answer or a closed connection, never
    an unbounded buffer."""
    node = Node(make_settings(tmp_path), services=Services())
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        host, port = node.urls[0].removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n"
            answer = b""
            with trio.move_on_after(10):
                try:
                    await stream.send_all(request)
                except trio.BrokenResourceError:
                    pass
                try:
                    answer = await stream.receive_some(4096)
                except trio.BrokenResourceError:
                    pass
        assert not answer.startswith(b"HTTP/1.1 200"), answer[:200]
        async with httpx.AsyncClient(base_url=node.urls[0]) as h:
            assert (await h.get("/healthz")).status_code == 200
        node.request_stop()


async def test_a_long_head_that_comes_in_pieces_is_read_whole(tmp_path) -> None:
    """A forwarded group of 1,000 carries its ids in a 19 kB header, and a stream's URL can
    hold as many. Sent in network-sized pieces, such a head outgrew h11's 16 KiB buffer before
    it was complete and the server closed the connection without an answer (a loopback client
    that sends it in one write never saw it): the front then counted the group as lost."""
    from rolloutd.federation import forward_headers, ids_headers

    node = Node(make_settings(tmp_path, token="tok", queue_size=2048), services=Services())
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        host, port = node.urls[0].removeprefix("http://").split(":")
        ids = [f"r-{i:016x}" for i in range(1000)]
        body = b'{"task": {"kind": "sleep", "run_s": 0}, "n": 1000}'
        headers = {**forward_headers("tok"), **ids_headers(ids, "front"), "Host": "x",
                   "Content-Type": "application/json", "Content-Length": str(len(body)),
                   "Connection": "close"}
        stream_url = "/v1/rollouts/stream?ids=" + ",".join(f"r-{i:016x}" for i in range(5000, 6000))
        for head in ("POST /v1/rollouts HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()),
                     f"GET {stream_url} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\nConnection: close\r\n"):
            request = head.encode() + b"\r\n" + (body if head.startswith("POST") else b"")
            assert len(request) > 16 * 1024
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                for i in range(0, len(request), 1400):  # one Ethernet segment's worth at a time
                    await stream.send_all(request[i:i + 1400])
                    await trio.sleep(0.002)
                with trio.fail_after(10):
                    answer = await stream.receive_some(4096)
            if head.startswith("POST"):
                assert answer.startswith(b"HTTP/1.1 202"), answer[:300]
            else:  # heard whole: none of these ids is known here
                assert answer.startswith(b"HTTP/1.1 404"), answer[:300]
        with trio.fail_after(30):
            while node.service.store.get(ids[-1]) is None or not node.service.store.get(ids[-1]).done.is_set():
                await trio.sleep(0.05)
        node.request_stop()
