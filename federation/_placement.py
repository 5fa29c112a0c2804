"""Where a new rollout runs: here, or on the peer that would finish it first (two choices)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from ._member import Member
from ._wire import Capacity, finish_s, headroom

#: Measured rates closer than this (the larger over the smaller) count as equal speeds, and
#: headroom decides: equal daemons of bench/federation.py measured up to 1.17 apart in one
#: burst (their speed while full varies with the shared VM), and sharing work by that noise
#: spread a burst unevenly (13-18 rollouts a daemon against 14-17).
SPEEDS_DIFFER = 1.25


def local_headroom(local: Capacity) -> int | None:
    """This node's headroom (see ``headroom`` in _wire.py); None when it takes no work
    (draining, no backend)."""
    if local["draining"] or local["healthy_backends"] <= 0:
        return None
    return headroom(local)


class Placement:
    """The placement policy of a front node (pure: no I/O, no clock).

    1. A node with room (headroom > 0) runs the rollout itself: no extra hop.
    2. Otherwise it samples two peers that accept work (power of two choices) and takes
       the one that would finish it first: the least ``finish_s`` (everything it holds,
       the rollouts we sent it since its last report and this one, over the rate it
       measured while full), when this node and both peers have measured a rate and those
       differ by ``SPEEDS_DIFFER`` or more. Otherwise (a node needs a few finishes while
       full; an older member never reports a rate; speeds alike) it takes the one with
       more headroom (its workers - the rollouts it holds - rollouts we sent it since its
       last report): the same order for nodes of equal speed.
    3. It forwards when that peer would finish no later than this node (by the same
       measure), so a full cluster queues in proportion to each node's speed. Ties go to
       the peer: this node sees its own slots free up at once but a peer's only at its
       next report, so keeping ties here made the front the busiest node at the end of a
       burst (bench/federation.py: 82 vs 64 rollouts at 8 daemons). A draining node or one
       without a healthy backend forwards whenever any peer accepts work.

    Sampling two instead of scanning all peers keeps fronts that decide on the same stale
    gossip from all picking the same peer.
    """

    def __init__(self, *, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, local: Capacity, peers: Sequence[Member]) -> Member | None:
        """The peer to forward to, or None to run locally."""
        here = local_headroom(local)
        if here is not None and here > 0:
            return None
        candidates = [m for m in peers if m.accepts_work]
        if not candidates:
            return None
        pair = self._rng.sample(candidates, min(2, len(candidates)))
        timed = [(t, m) for m in pair if (t := m.finish_s) is not None]
        mine = None if here is None else finish_s(local)
        rates = [m.capacity.get("rate", 0.0) for m in pair]
        rates += [] if here is None else [local.get("rate", 0.0)]
        if (len(timed) == len(pair) and (here is None or mine is not None)
                and max(rates) >= SPEEDS_DIFFER * min(rates)):
            when, best = min(timed, key=lambda tm: tm[0])
            return best if mine is None or when <= mine else None
        best = max(pair, key=lambda m: m.headroom)
        return best if here is None or best.headroom >= here else None
