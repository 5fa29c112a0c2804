"""A member of the federation as one node sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ._wire import Capacity, MemberRecord, empty_capacity, finish_s, headroom


class MemberState(enum.Enum):
    """Where a member stands in this node's view.

    ALIVE -> SUSPECT (silent for suspect_after_s) -> DEAD (silent for dead_after_s).
    LEFT is announced by the member itself when it shuts down. A newer heartbeat or
    incarnation makes a SUSPECT, DEAD or LEFT member ALIVE again (rejoin).
    """

    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"

    @property
    def rank(self) -> int:
        """At equal (incarnation, heartbeat), the higher rank wins a merge (SWIM)."""
        return _RANK[self]

    @property
    def gone(self) -> bool:
        """DEAD or LEFT: its forwarded jobs are lost."""
        return self in (MemberState.DEAD, MemberState.LEFT)


_RANK = {MemberState.ALIVE: 0, MemberState.SUSPECT: 1, MemberState.DEAD: 2, MemberState.LEFT: 3}


@dataclass(slots=True)
class Member:
    """One node of the federation, as this node knows it.

    The Federation owns the live objects; what it hands out (members(), place(), the
    on_dead/on_rejoin callbacks) are copies, so reading them is safe and mutating them
    changes nothing.
    """

    node_id: str
    url: str
    incarnation: int = 0
    heartbeat: int = 0
    capacity: Capacity = field(default_factory=empty_capacity)
    updated_at: float = 0.0
    """The member's own wall clock (time.time()) at its last heartbeat."""
    state: MemberState = MemberState.ALIVE
    datagrams: bool = False
    """It answers gossip datagrams on its URL's port (UDP): it says so in its record."""
    last_heard: float = 0.0
    """This node's trio clock when the member's version last advanced."""
    in_flight: int = 0
    """Rollouts placed on it here whose forward it has not answered yet."""
    unreported: list[int] = field(default_factory=list)
    """The heartbeat at which it took each rollout we forwarded that no capacity report we
    have counts yet (a report counts those taken before its heartbeat)."""

    @property
    def pending(self) -> int:
        """Rollouts placed on it here that its last capacity report does not count."""
        return self.in_flight + len(self.unreported)

    def reported(self, incarnation: int, heartbeat: int) -> None:
        """A capacity report from version (incarnation, heartbeat) arrived: forget what it
        counts. A new incarnation (a restarted node) counts nothing we sent before."""
        if incarnation != self.incarnation:
            self.unreported.clear()
        else:
            self.unreported = [h for h in self.unreported if h >= heartbeat]

    @property
    def version(self) -> tuple[int, int]:
        return (self.incarnation, self.heartbeat)

    @property
    def headroom(self) -> int:
        """Its reported headroom (see ``headroom`` in _wire.py) minus what we forwarded
        since its last report."""
        return headroom(self.capacity) - self.pending

    @property
    def finish_s(self) -> float | None:
        """When it would finish what it holds plus one more (see ``finish_s`` in _wire.py),
        counting what we forwarded since its last report; None without a measured rate."""
        return finish_s(self.capacity, self.pending)

    @property
    def accepts_work(self) -> bool:
        """Alive, not draining, and with at least one healthy LLM backend."""
        c = self.capacity
        return self.state is MemberState.ALIVE and not c["draining"] and c["healthy_backends"] > 0

    def record(self) -> MemberRecord:
        """The member as it travels in gossip."""
        return MemberRecord(
            node_id=self.node_id,
            url=self.url,
            incarnation=self.incarnation,
            heartbeat=self.heartbeat,
            capacity=Capacity(**self.capacity),
            updated_at=self.updated_at,
            state=self.state.value,
            datagrams=self.datagrams,
        )

    def to_dict(self, *, now: float, is_self: bool = False) -> dict[str, Any]:
        """The member as GET /v1/federation/members lists it."""
        return {
            **self.record(),
            "last_heard_s": 0.0 if is_self else round(max(0.0, now - self.last_heard), 3),
            "self": is_self,
            # Only an alive member's capacity is its load now; a suspect, dead or departed
            # member's is the last report we had.
            "capacity_stale": not is_self and self.state is not MemberState.ALIVE,
        }

    def copy(self) -> Member:
        return Member(
            node_id=self.node_id,
            url=self.url,
            incarnation=self.incarnation,
            heartbeat=self.heartbeat,
            capacity=Capacity(**self.capacity),
            updated_at=self.updated_at,
            state=self.state,
            datagrams=self.datagrams,
            last_heard=self.last_heard,
            in_flight=self.in_flight,
            unreported=list(self.unreported),
        )
