"""The daemon's side of the helper protocol when the helper goes away mid-request."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import pytest
import trio
import trio.testing

from rolloutd.sandbox import SandboxClosed
from rolloutd.sandbox._protocol import HelperClient


async def test_a_helper_that_exits_with_the_request_queued_is_closed():
    """A request the helper had not accepted yet when it exited (its lifetime ran out, it
    died) is reset by the kernel: that is a closed sandbox, not a stray OSError. Stand-in
    for the helper: a listening socket that never accepts, closed as the helper's exit
    closes it."""
    with tempfile.TemporaryDirectory(prefix="rld", dir="/tmp") as tmp:
        path = str(Path(tmp) / "h.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        try:
            async with trio.open_nursery() as nursery:
                async def call() -> None:
                    with pytest.raises(SandboxClosed, match="closed the connection"):
                        await HelperClient(path).call("ping")

                nursery.start_soon(call)
                await trio.testing.wait_all_tasks_blocked()  # connected, sent, waiting
                listener.close()
        finally:
            listener.close()
