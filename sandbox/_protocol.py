"""Daemon side of the helper protocol: one Unix-socket connection per request.

A frame is ``>II`` (json length, blob length), the JSON object, then the blob. File
descriptors (pty masters, pipe ends) arrive with SCM_RIGHTS on the reply. Closing the
connection cancels a pending ``wait`` or ``run`` in the helper, so cancelling the Trio
call is enough to cancel the request. A helper gone (its socket removed, the connection
reset or closed before the reply) is SandboxClosed; the Sandbox asks why (_sandbox.py).
"""

from __future__ import annotations

import array
import errno
import json
import os
import socket
import struct
from typing import Any

import trio

from ._exceptions import PathEscapeError, SandboxClosed, SandboxError

HEADER = struct.Struct(">II")
_MAX_FDS = 8
_RECV = 1 << 20


class HelperClient:
    """Sends requests to one sandbox's helper."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    async def call(self, op: str, args: dict[str, Any] | None = None, blob: bytes = b"",
                   ) -> tuple[dict[str, Any], bytes, list[int]]:
        """One request; returns (reply, blob, fds). The caller owns the fds."""
        request = dict(args or {}, op=op)
        body = json.dumps(request).encode()
        data = HEADER.pack(len(body), len(blob)) + body + blob
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        try:
            try:
                await sock.connect(self.socket_path)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise SandboxClosed(f"sandbox helper is gone ({exc.strerror})") from None
            try:
                view = memoryview(data)
                while view:
                    sent = await sock.send(view)
                    view = view[sent:]
                reply, out = await _receive(sock, fds)
            except (ConnectionResetError, BrokenPipeError) as exc:
                # the helper exited with the request queued (its lifetime, its death)
                raise SandboxClosed(f"sandbox helper closed the connection ({exc.strerror})"
                                    ) from None
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        finally:
            sock.close()
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise _error(reply.get("error") or {})
        return reply, out, fds


async def _receive(sock: trio.socket.SocketType, fds: list[int]) -> tuple[dict[str, Any], bytes]:
    buf = bytearray()
    need: int | None = None
    anc_size = socket.CMSG_SPACE(_MAX_FDS * 4)
    while need is None or len(buf) < need:
        data, ancdata, _flags, _addr = await sock.recvmsg(_RECV, anc_size, socket.MSG_CMSG_CLOEXEC)
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        if not data:
            raise SandboxClosed("sandbox helper closed the connection mid-reply")
        buf += data
        if need is None and len(buf) >= HEADER.size:
            jlen, blen = HEADER.unpack_from(buf)
            need = HEADER.size + jlen + blen
    jlen, blen = HEADER.unpack_from(buf)
    reply = json.loads(bytes(buf[HEADER.size : HEADER.size + jlen]))
    return reply, bytes(buf[HEADER.size + jlen : need])


def _error(err: dict[str, Any]) -> Exception:
    kind = err.get("type", "HelperError")
    message = err.get("message", "sandbox helper error")
    code = int(err.get("errno") or 0)
    if kind == "PathEscape":
        return PathEscapeError(errno.EACCES, message)
    if kind in ("OSError", "SpawnError", "NoSuchProcess") and code:
        return OSError(code, message)  # the builtin subclass for the errno
    return SandboxError(f"{kind}: {message}")
