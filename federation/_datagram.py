"""Gossip over UDP: the push-pull exchange of `_federation`, one datagram each way.

Over HTTP an exchange costs each side about 2.3 ms of CPU (an httpx request on one, Quart on
hypercorn on the other, for a 2 kB table), and a member takes part in about `fanout`
exchanges a second: on a small CPU share that is a few percent of everything it has. A
datagram carries the same payload for a fraction of that. HTTP stays: a member falls back to
it, per exchange, when a peer does not answer a datagram (no UDP listener, a firewall, an
older daemon), refuses one, or when the table is too large for one datagram; and it uses HTTP
for that peer for a while after.

Every datagram starts with `MAGIC`, a kind, and a random 8-byte nonce that pairs an answer
with its ask. An ask and an answer carry an HMAC-SHA256 of all of it under a key derived from
the federation's token, then the JSON payload; the MAC is checked (in constant time) before
the payload is parsed. A datagram that fails the check, or an ask whose payload is malformed,
is answered with a bare `REFUSED`, which only makes the sender retry over HTTP (whose answer,
401 or 400, says what is wrong). A bare `TOO_BIG` says the answer would not fit; the sender
retries over HTTP too. Without a token (a loopback-only daemon) the MAC uses an empty key:
it checks integrity, not authenticity, as the HTTP route then checks nothing either. A
replayed ask or answer can only repeat versions of member records that merging already
ignores, and an answer is one datagram of about the ask's size, so nothing is amplified.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket as _stdlib_socket
from collections.abc import Callable
from typing import Any, Final
from urllib.parse import urlsplit

import trio

from ._exceptions import DatagramError, GossipPayloadError

log = logging.getLogger(__name__)

MAGIC: Final = b"rdg1"
ASK: Final = b"Q"
ANSWER: Final = b"A"
REFUSED: Final = b"R"
TOO_BIG: Final = b"B"
_NONCE = 8
_MAC = 32
_HEAD = len(MAGIC) + 1 + _NONCE
MAX_DATAGRAM: Final = 65_000
"""The largest datagram sent or accepted (UDP's limit over IPv4 is 65,507 bytes of payload).
A table of about 200 members fits; a larger one goes over HTTP."""
_RESOLVE_TTL_S = 30.0

Answer = Callable[[Any], dict[str, Any]]


def datagram_key(token: str | None) -> bytes:
    """The MAC key of a federation's datagrams: derived from its token (empty without one)."""
    if not token:
        return b""
    return hashlib.sha256(b"rolloutd gossip datagram\0" + token.encode()).digest()


def seal(key: bytes, kind: bytes, nonce: bytes, body: bytes = b"") -> bytes:
    """A datagram: MAGIC, kind, nonce, then for an ask or answer the MAC and the body."""
    head = MAGIC + kind + nonce
    if kind not in (ASK, ANSWER):
        return head
    return head + hmac.new(key, head + body, hashlib.sha256).digest() + body


def unseal(key: bytes, data: bytes) -> tuple[bytes, bytes, bytes]:
    """(kind, nonce, body) of a datagram; DatagramError when it is not one of ours or its MAC
    does not match. For an ask the error carries its ``nonce`` (the receiver answers it
    REFUSED); nothing else is ever answered, so two members cannot bounce datagrams."""
    if len(data) < _HEAD or not data.startswith(MAGIC):
        raise DatagramError("not a gossip datagram")
    kind, nonce = data[len(MAGIC):len(MAGIC) + 1], data[len(MAGIC) + 1:_HEAD]
    if kind in (REFUSED, TOO_BIG):
        return kind, nonce, b""
    if kind not in (ASK, ANSWER):
        raise DatagramError(f"gossip datagram of unknown kind {kind!r}")
    asked = nonce if kind == ASK else None
    if len(data) < _HEAD + _MAC:
        raise DatagramError("gossip datagram cut short", nonce=asked)
    mac, body = data[_HEAD:_HEAD + _MAC], data[_HEAD + _MAC:]
    if not hmac.compare_digest(mac, hmac.new(key, data[:_HEAD] + body, hashlib.sha256).digest()):
        raise DatagramError("gossip datagram failed its MAC (another token?)", nonce=asked)
    return kind, nonce, body


class _Pending:
    __slots__ = ("body", "done", "kind")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.kind = b""
        self.body = b""


class GossipSocket:
    """One UDP socket: answers peers' asks with ``answer(payload)`` and carries this member's.

    ``run`` binds it (``task_status.started()`` with the bound address) and serves until
    cancelled; ``exchange`` sends an ask and waits for its answer (the caller bounds it)."""

    def __init__(self, token: str | None, answer: Answer) -> None:
        self._key = datagram_key(token)
        self._answer = answer
        self._sock: trio.socket.SocketType | None = None
        self._pending: dict[bytes, _Pending] = {}
        self._resolved: dict[str, tuple[float, Any]] = {}
        self.asks = self.answers = self.refused = 0

    async def run(self, host: str, port: int, *,
                  task_status: trio.TaskStatus[tuple[Any, ...]] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind ``host``:``port`` (UDP) and answer asks until cancelled. OSError when the
        address cannot be bound (the caller then gossips over HTTP only)."""
        family = _stdlib_socket.AF_INET6 if ":" in host else _stdlib_socket.AF_INET
        with trio.socket.socket(family, _stdlib_socket.SOCK_DGRAM) as sock:
            await sock.bind((host, port))
            self._sock = sock
            try:
                task_status.started(sock.getsockname())
                while True:
                    try:
                        data, addr = await sock.recvfrom(MAX_DATAGRAM + 1)
                    except (ConnectionRefusedError, ConnectionResetError):  # an ICMP error
                        continue  # of a datagram we sent: its exchange times out
                    await self._receive(data, addr)
            finally:
                self._sock = None
                for slot in self._pending.values():
                    slot.done.set()  # kind b"": the exchange fails and falls back

    async def exchange(self, url: str, payload: dict[str, Any]) -> Any:
        """Send ``payload`` to the member at ``url`` and return its answer's payload (JSON).

        DatagramError when there is no socket, the peer's address cannot be had, the payload
        is too large, or the peer refused the ask or said its answer is too big: each a reason
        to use HTTP instead. Waits for the answer unbounded: the caller sets the bound."""
        sock = self._sock
        if sock is None:
            raise DatagramError("no gossip socket")
        body = json.dumps(payload, separators=(",", ":")).encode()
        if _HEAD + _MAC + len(body) > MAX_DATAGRAM:
            raise DatagramError(f"a table of {len(body)} bytes does not fit a datagram")
        addr = await self._address(url, sock.family)
        nonce = os.urandom(_NONCE)
        slot = self._pending[nonce] = _Pending()
        try:
            try:
                await sock.sendto(seal(self._key, ASK, nonce, body), addr)
            except OSError as exc:
                raise DatagramError(f"sending to {url}: {exc}") from exc
            self.asks += 1
            await slot.done.wait()
        finally:
            del self._pending[nonce]
        if slot.kind != ANSWER:
            raise DatagramError({REFUSED: f"{url} refused the datagram",
                                 TOO_BIG: f"{url}'s answer does not fit a datagram"}.get(
                                     slot.kind, "the gossip socket closed"))
        try:
            return json.loads(slot.body)
        except (ValueError, RecursionError) as exc:
            raise DatagramError(f"the answer from {url} is not JSON") from exc

    async def _address(self, url: str, family: int) -> Any:
        now = trio.current_time()
        cached = self._resolved.get(url)
        if cached is not None and cached[0] > now:
            return cached[1]
        parts = urlsplit(url)
        if parts.hostname is None:
            raise DatagramError(f"no host in {url}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            infos = await trio.socket.getaddrinfo(parts.hostname, port, family=family,
                                                  type=_stdlib_socket.SOCK_DGRAM)
        except OSError as exc:
            raise DatagramError(f"resolving {parts.hostname}: {exc}") from exc
        if not infos:
            raise DatagramError(f"{parts.hostname} has no address of this socket's family")
        addr = infos[0][4]
        self._resolved[url] = (now + _RESOLVE_TTL_S, addr)
        return addr

    async def _receive(self, data: bytes, addr: Any) -> None:
        try:
            kind, nonce, body = unseal(self._key, data)
        except DatagramError as exc:
            if exc.nonce is not None:
                self.refused += 1
                await self._send(seal(self._key, REFUSED, exc.nonce), addr)
            return
        if kind != ASK:
            slot = self._pending.get(nonce)
            if slot is not None and not slot.done.is_set():
                slot.kind, slot.body = kind, body
                slot.done.set()
            return
        try:
            answer = self._answer(json.loads(body))
        except (ValueError, RecursionError, GossipPayloadError):  # not JSON (or nested past
            # the parser's depth), or not a table: HTTP will say
            self.refused += 1
            await self._send(seal(self._key, REFUSED, nonce), addr)
            return
        self.answers += 1
        out = json.dumps(answer, separators=(",", ":")).encode()
        if _HEAD + _MAC + len(out) > MAX_DATAGRAM:
            await self._send(seal(self._key, TOO_BIG, nonce), addr)
        else:
            await self._send(seal(self._key, ANSWER, nonce, out), addr)

    async def _send(self, data: bytes, addr: Any) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            await sock.sendto(data, addr)
        except OSError as exc:  # the peer's network is gone: its ask times out there
            log.debug("gossip datagram to %s not sent: %s", addr, exc)
