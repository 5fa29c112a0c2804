"""systemd's readiness protocol (sd_notify) without libsystemd: one datagram to $NOTIFY_SOCKET.

Under ``Type=notify`` systemd counts the service as started when it receives ``READY=1``, and
``STOPPING=1`` tells it the service is shutting down (the drain). ``$NOTIFY_SOCKET`` is a
filesystem path, or a Linux abstract socket name when it starts with ``@``. Sending never
blocks and never raises: without ``$NOTIFY_SOCKET`` (not under systemd) it does nothing, and
a failure is logged, since readiness reporting must not take the daemon down.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import MutableMapping

__all__ = ["Notifier"]

log = logging.getLogger(__name__)

ENV = "NOTIFY_SOCKET"


class Notifier:
    """Sends sd_notify states to one address; ``Notifier()`` (no address) does nothing."""

    def __init__(self, address: str | None = None) -> None:
        self.address = address or None

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """Take ``$NOTIFY_SOCKET`` out of the environment, as sd_notify's ``unset_environment``
        does: the daemon's children (a supervised vLLM) must not speak for it."""
        environ = os.environ if environ is None else environ
        return cls(environ.pop(ENV, None))

    def notify(self, *states: str) -> bool:
        """Send ``KEY=value`` states in one datagram; True when it was sent."""
        if self.address is None:
            return False
        if self.address.startswith("@"):
            target = "\0" + self.address[1:]
        elif self.address.startswith("/"):
            target = self.address
        else:  # e.g. vsock:, which only virtual machines' managers use
            log.warning("sd_notify: unsupported %s=%r; not notifying", ENV, self.address)
            self.address = None
            return False
        message = "\n".join(states).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.setblocking(False)  # a full receive queue must not stall the event loop
                sock.sendto(message, target)
        except OSError as exc:
            log.warning("sd_notify: sending %s to %s failed: %s", states[0] if states else "",
                        self.address, exc)
            return False
        return True
