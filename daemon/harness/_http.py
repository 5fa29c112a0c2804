"""A small HTTP/1.1 server on h11 for one rollout's endpoint (DESIGN section 13).

One per harness-driven rollout, accepting on a loopback port of the sandbox's own network
namespace (a socket the sandbox's helper opened there and handed to the daemon). It is h11 (the HTTP state machine that
hypercorn and httpx use) driven by Trio, not a second Quart app: a call through it costs well
under a millisecond, where the proxy's budget is 2 ms per call (bench/agent_proxy.py).

The app is ``async (Request) -> Response``. A :class:`Response` has a JSON body or an async
iterator of chunks (server-sent events, sent with chunked transfer encoding). Connections are
kept alive; a request body over ``max_body`` gets 413; a malformed request 400; the server
never answers 500 for a client's mistake.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

log = logging.getLogger(__name__)

MAX_BODY = 32 * 1024 * 1024
READ_CHUNK = 65536


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Response:
    status: int
    body: Any = None  # a JSON value
    stream: AsyncIterator[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)


App = Callable[[Request], Awaitable[Response]]


def _head(status: int, headers: dict[str, str], ctype: str, length: int | None) -> h11.Response:
    items = [("content-type", ctype), *headers.items()]
    if length is None:
        items.append(("transfer-encoding", "chunked"))
    else:
        items.append(("content-length", str(length)))
    return h11.Response(status_code=status, headers=items)


async def _send(stream: trio.abc.Stream, conn: h11.Connection, event: Any) -> None:
    data = conn.send(event)
    if data:
        await stream.send_all(data)


async def _read_request(stream: trio.abc.Stream, conn: h11.Connection,
                        max_body: int) -> Request | Response | None:
    """The next request, a :class:`Response` to send for a bad one, or None at EOF."""
    head: h11.Request | None = None
    body = bytearray()
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            return Response(400, {"error": {"type": "invalid_request_error",
                                            "message": f"malformed HTTP request: {exc}"}})
        if event is h11.NEED_DATA:
            data = await stream.receive_some(READ_CHUNK)
            if not data and conn.their_state is h11.IDLE:
                return None
            conn.receive_data(bytes(data))
        elif isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_body:
                return Response(413, {"error": {"type": "invalid_request_error",
                                                "message": f"request body over {max_body} bytes"}})
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in head.headers}
            path = head.target.decode("latin-1").split("?", 1)[0]
            return Request(head.method.decode("ascii", "replace"), path, headers, bytes(body))
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def serve_connection(stream: trio.abc.Stream, app: App, *, max_body: int = MAX_BODY) -> None:
    """Answer requests on ``stream`` until the client closes it (or a protocol error)."""
    conn = h11.Connection(h11.SERVER)
    async with stream:
        while True:
            req = await _read_request(stream, conn, max_body)
            if req is None:
                return
            keep = True
            if isinstance(req, Response):
                resp, keep = req, False
            else:
                try:
                    resp = await app(req)
                except Exception as exc:  # a bug of ours: answered, logged, never a hang
                    log.exception("endpoint: %s %s failed", req.method, req.path)
                    resp, keep = Response(500, {"error": {
                        "type": "server_error", "message": f"{type(exc).__name__}: {exc}"}}), False
            try:
                await _respond(stream, conn, resp)
            except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
                return
            if not keep or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return


async def _respond(stream: trio.abc.Stream, conn: h11.Connection, resp: Response) -> None:
    if resp.stream is None:
        payload = json.dumps(resp.body, separators=(",", ":")).encode()
        await stream.send_all(conn.send(_head(resp.status, resp.headers, "application/json",
                                              len(payload))) + conn.send(h11.Data(data=payload))
                              + conn.send(h11.EndOfMessage()))
        return
    await _send(stream, conn, _head(resp.status, resp.headers, "text/event-stream", None))
    async for chunk in resp.stream:
        if chunk:
            await _send(stream, conn, h11.Data(data=chunk))
    await _send(stream, conn, h11.EndOfMessage())


async def serve_socket(sock: trio.socket.SocketType, app: App, *,
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on the listening socket ``sock`` until cancelled; ``sock`` is closed at
    the end."""
    listener = trio.SocketListener(sock)

    async def handler(stream: trio.SocketStream) -> None:
        try:
            await serve_connection(stream, app)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async with listener, trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handler, [listener])
        task_status.started()
