"""The federation package's exceptions, in one tree.

    FederationError
    ├── GossipPayloadError    a gossip payload we received is malformed (the route answers 400)
    ├── PeerError             a call to a peer failed (unreachable, timeout, bad answer)
    │   ├── PeerAuthError     the peer refused our token (401/403)
    │   └── DatagramError     a gossip datagram could not be exchanged (the exchange uses HTTP)
    ├── DuplicateJobError     a job id is already tracked as forwarded (never two live copies)
    ├── FederationSettingError  a gossip setting is out of range or inconsistent with another
    └── SlurmError            the Slurm allocation could not be read (slurm_seeds)

Foreign errors (httpx, OSError from scontrol) are mapped to these at the edge and chained.
"""

from __future__ import annotations


class FederationError(Exception):
    """Base class of every error the federation package raises."""


class GossipPayloadError(FederationError, ValueError):
    """A received gossip payload does not follow the wire format."""


class PeerError(FederationError):
    """A request to a peer failed: unreachable, timed out, or answered with an error."""

    def __init__(self, message: str, *, peer: str) -> None:
        super().__init__(message)
        self.peer = peer


class PeerAuthError(PeerError):
    """The peer refused our token (HTTP 401 or 403)."""


class DatagramError(PeerError):
    """A gossip exchange over UDP did not happen (no socket or address, too large, refused,
    unreadable): the exchange is tried over HTTP instead. ``nonce``: of the datagram, when
    one was read (the receiver answers it REFUSED)."""

    def __init__(self, message: str, *, nonce: bytes | None = None, peer: str = "") -> None:
        super().__init__(message, peer=peer)
        self.nonce = nonce


class DuplicateJobError(FederationError, KeyError):
    """The job id is already tracked as forwarded to a peer."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class FederationSettingError(FederationError, ValueError):
    """A gossip setting is out of range, or inconsistent with `other` (see GossipSettings)."""

    def __init__(self, setting: str, problem: str, *, other: str | None = None) -> None:
        super().__init__(f"{setting} {problem}")
        self.setting = setting
        self.problem = problem
        self.other = other


class SlurmError(FederationError):
    """The node list of the Slurm allocation could not be read."""
