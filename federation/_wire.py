"""The wire format of gossip: constants, the capacity record, payload validation, auth."""

from __future__ import annotations

import hmac
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final, NotRequired, TypedDict, TypeGuard

from ._exceptions import GossipPayloadError

GOSSIP_PATH: Final = "/v1/federation/gossip"
"""Route a member POSTs its view to; the answer is the peer's view."""
MEMBERS_PATH: Final = "/v1/federation/members"
"""Route that lists the members as JSON."""
FORWARDED_HEADER: Final = "X-Rolloutd-Forwarded"
"""Header on a forwarded rollout; a node that receives it never forwards the job again."""
FORWARDED_VALUE: Final = "1"
IDS_HEADER: Final = "X-Rolloutd-Ids"
"""On a forwarded rollout: the ids its samples get (comma-separated), chosen by the sender, so
that it can answer for them whatever becomes of the request (the peer honours them)."""
MAX_FORWARDED_IDS: Final = 10_000
"""The most ids one forwarded request may carry in ``IDS_HEADER``: the largest group a daemon
of a federation can hand to a peer (``max_samples_per_request`` is capped at it)."""
ORIGIN_HEADER: Final = "X-Rolloutd-Origin"
"""On a forwarded rollout: the node id of the member that forwarded it (it never takes the
rollout back by work stealing: it would then relay it from the peer that relays it from it)."""
TOOK_AT_HEADER: Final = "X-Rolloutd-Took-At"
"""On a peer's answer to a forwarded rollout: its version (``incarnation.heartbeat``) when it
took the rollout. Its capacity reports from a later heartbeat count the rollout; earlier ones,
even if they reach the front later (relayed by gossip), do not."""
PROTOCOL_VERSION: Final = 1
MAX_PAYLOAD_MEMBERS: Final = 10_000
STATES: Final = ("alive", "suspect", "dead", "left")


class Capacity(TypedDict):
    """What a node can take now; the daemon's capacity callback returns one."""

    free_slots: int  # rollouts it can start now without queueing
    queued: int  # accepted, waiting for a worker
    waiting: int  # through INIT, waiting for a RUN worker (work stealing may move these too)
    in_flight: int  # accepted and not finished: queued, waiting and at work
    healthy_backends: int  # LLM backends that pass their health check
    draining: bool  # shutting down: takes no new work
    slots: NotRequired[int]  # its workers, INIT + RUN + EVAL (0 or absent: an older member)
    rate: NotRequired[float]  # rollouts it finishes per second while full (0 or absent: unmeasured)


def headroom(capacity: Capacity) -> int:
    """How many more rollouts a node can take before one of them waits for a worker: its
    workers minus every rollout it holds, negative when it holds more (the rollouts a full
    node holds past its queue, in INIT or waiting between stages, count too: a node whose
    workers run ahead holds more than its queue shows). From a member that does not report
    its workers (an older version), free slots minus queued."""
    slots = capacity.get("slots", 0)
    if slots > 0:
        return slots - capacity["in_flight"]
    return capacity["free_slots"] - capacity["queued"]


def finish_s(capacity: Capacity, pending: int = 0) -> float | None:
    """Seconds until a node would have finished every rollout it holds, the ``pending`` ones
    sent to it since its report, and one more, at the rate it measured while full; None when
    it has no rate yet (or reports no workers: an older member). Where nodes differ in speed
    (other CPUs, a node that also forwards and relays for the others), this, not headroom,
    is what evens out the end of a burst."""
    rate = capacity.get("rate", 0.0)
    if rate <= 0 or capacity.get("slots", 0) <= 0:
        return None
    return (capacity["in_flight"] + pending + 1) / rate


class MemberRecord(TypedDict):
    """One member as it travels in a gossip payload."""

    node_id: str
    url: str
    incarnation: int
    heartbeat: int
    capacity: Capacity
    updated_at: float  # the owner's wall clock (time.time()) at its last heartbeat
    state: str  # one of STATES
    datagrams: NotRequired[bool]  # it answers gossip datagrams (absent: an older member, no)


_CAPACITY_INTS: Final = ("free_slots", "queued", "in_flight", "healthy_backends")
#: Absent from a member older than the field: read as 0.
_CAPACITY_NEWER_INTS: Final = ("waiting", "slots")


def empty_capacity() -> Capacity:
    return Capacity(free_slots=0, queued=0, in_flight=0, waiting=0, healthy_backends=0, draining=False)


def check_capacity(value: Any, *, what: str = "capacity") -> Capacity:
    """Return a clean Capacity from `value`; raise GossipPayloadError when it is malformed."""
    if not isinstance(value, Mapping):
        raise GossipPayloadError(f"{what} must be an object")
    ints: dict[str, int] = {}
    for key in (*_CAPACITY_INTS, *_CAPACITY_NEWER_INTS):
        v = value.get(key, 0) if key in _CAPACITY_NEWER_INTS else value.get(key)
        if not _is_int(v) or v < 0:
            raise GossipPayloadError(f"{what}.{key} must be a non-negative integer, got {v!r}")
        ints[key] = v
    rate = value.get("rate", 0.0)
    if not isinstance(rate, int | float) or isinstance(rate, bool) or not math.isfinite(rate) or rate < 0:
        raise GossipPayloadError(f"{what}.rate must be a finite non-negative number, got {rate!r}")
    draining = value.get("draining")
    if not isinstance(draining, bool):
        raise GossipPayloadError(f"{what}.draining must be a boolean, got {draining!r}")
    return Capacity(
        free_slots=ints["free_slots"],
        queued=ints["queued"],
        in_flight=ints["in_flight"],
        waiting=ints["waiting"],
        healthy_backends=ints["healthy_backends"],
        draining=draining,
        slots=ints["slots"],
        rate=float(rate),
    )


def parse_payload(payload: Any) -> list[MemberRecord]:
    """Validate a gossip payload `{"protocol": 1, "members": [...]}` and return its records."""
    if not isinstance(payload, Mapping):
        raise GossipPayloadError("gossip payload must be a JSON object")
    protocol = payload.get("protocol", PROTOCOL_VERSION)
    if protocol != PROTOCOL_VERSION:
        raise GossipPayloadError(f"unsupported gossip protocol {protocol!r}")
    members = payload.get("members")
    if not isinstance(members, list):
        raise GossipPayloadError("gossip payload needs a 'members' list")
    if len(members) > MAX_PAYLOAD_MEMBERS:
        raise GossipPayloadError(f"too many members ({len(members)} > {MAX_PAYLOAD_MEMBERS})")
    return [_parse_record(m, i) for i, m in enumerate(members)]


def _parse_record(raw: Any, index: int) -> MemberRecord:
    where = f"members[{index}]"
    if not isinstance(raw, Mapping):
        raise GossipPayloadError(f"{where} must be an object")
    node_id, url, state = raw.get("node_id"), raw.get("url"), raw.get("state")
    if not isinstance(node_id, str) or not 0 < len(node_id) <= 256:
        raise GossipPayloadError(f"{where}.node_id must be a non-empty string")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > 2048:
        raise GossipPayloadError(f"{where}.url must be an http(s) URL")
    if state not in STATES:
        raise GossipPayloadError(f"{where}.state must be one of {', '.join(STATES)}")
    for key in ("incarnation", "heartbeat"):
        v = raw.get(key)
        if not _is_int(v) or v < 0:
            raise GossipPayloadError(f"{where}.{key} must be a non-negative integer")
    updated_at = raw.get("updated_at")
    if not isinstance(updated_at, int | float) or isinstance(updated_at, bool):
        raise GossipPayloadError(f"{where}.updated_at must be a number")
    if not math.isfinite(updated_at):
        raise GossipPayloadError(f"{where}.updated_at must be finite")
    datagrams = raw.get("datagrams", False)
    if not isinstance(datagrams, bool):
        raise GossipPayloadError(f"{where}.datagrams must be a boolean")
    return MemberRecord(
        node_id=node_id,
        url=normalize_url(url),
        incarnation=raw["incarnation"],
        heartbeat=raw["heartbeat"],
        capacity=check_capacity(raw.get("capacity"), what=f"{where}.capacity"),
        updated_at=float(updated_at),
        state=state,
        datagrams=datagrams,
    )


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def normalize_url(url: str) -> str:
    """The base URL of a daemon without a trailing slash, so URLs compare equal."""
    return url.rstrip("/")


def auth_headers(token: str | None) -> dict[str, str]:
    """`Authorization: Bearer <token>` when a token is set, else nothing."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def forward_headers(token: str | None) -> dict[str, str]:
    """Headers for a rollout forwarded to a peer: auth plus the no-re-forwarding mark."""
    return {**auth_headers(token), FORWARDED_HEADER: FORWARDED_VALUE}


def is_forwarded(headers: Mapping[str, str]) -> bool:
    """True when a request carries the forwarded mark (never forward it again).

    `headers` must be case-insensitive (quart, httpx and starlette headers are)."""
    return headers.get(FORWARDED_HEADER) == FORWARDED_VALUE


def ids_headers(ids: Sequence[str], origin: str | None = None) -> dict[str, str]:
    """The headers that hand a peer the ids of the samples it is sent (and who sends them)."""
    headers = {IDS_HEADER: ",".join(ids)}
    if origin is not None:
        headers[ORIGIN_HEADER] = origin
    return headers


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """The value of header ``name`` in ``headers`` (any mapping), looked up case-insensitively."""
    wanted = name.lower()
    return next((v for k, v in headers.items() if k.lower() == wanted), None)


def took_at_headers(version: tuple[int, int]) -> dict[str, str]:
    """The header a peer answers a forwarded rollout with: its version when it took it."""
    return {TOOK_AT_HEADER: f"{version[0]}.{version[1]}"}


def took_at(headers: Mapping[str, str]) -> tuple[int, int] | None:
    """The version in a peer's `TOOK_AT_HEADER`, or None (no header, or a malformed one: an
    older peer). Looked up case-insensitively."""
    raw = _header(headers, TOOK_AT_HEADER)
    if raw is None:
        return None
    incarnation, _, heartbeat = raw.partition(".")
    if not (incarnation.isdigit() and heartbeat.isdigit()) or len(raw) > 40:
        return None
    return int(incarnation), int(heartbeat)


def forwarded_origin(headers: Mapping[str, str]) -> str | None:
    """The member that forwarded a request (`ORIGIN_HEADER`), looked up case-insensitively."""
    raw = _header(headers, ORIGIN_HEADER)
    return raw[:200] if raw else None


_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


def forwarded_ids(headers: Mapping[str, str]) -> list[str] | None:
    """The ids a forwarded request carries (`IDS_HEADER`), or None without the header.

    Looked up case-insensitively. Raises ValueError for a malformed list (an empty or bad id,
    a repeated one, more than MAX_FORWARDED_IDS)."""
    raw = _header(headers, IDS_HEADER)
    if raw is None:
        return None
    ids = raw.split(",")
    if len(ids) > MAX_FORWARDED_IDS:
        raise ValueError(f"{IDS_HEADER} holds {len(ids)} ids, more than {MAX_FORWARDED_IDS}")
    bad = next((i for i in ids if not _ID.fullmatch(i)), None)
    if bad is not None:
        raise ValueError(f"{IDS_HEADER} holds a malformed id: {bad[:140]!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{IDS_HEADER} repeats an id")
    return ids


def check_token(authorization: str | None, token: str | None) -> bool:
    """Whether an `Authorization` header value carries `token`. True when no token is set.

    Compares in constant time (hmac.compare_digest)."""
    if not token:
        return True
    if not authorization:
        return False
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())
