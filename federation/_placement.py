"""Where a new rollout runs: here, or on the peer with the most headroom (two choices)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from ._member import Member
from ._wire import Capacity, headroom


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
       the one with more headroom (its workers - the rollouts it holds - rollouts we sent
       it since its last report).
    3. It forwards when that peer has at least as much headroom as this node, so a full
       cluster queues evenly. Ties go to the peer: this node sees its own slots free up at
       once but a peer's only at its next report, so keeping ties here made the front the
       busiest node at the end of a burst (bench/federation.py: 82 vs 64 rollouts at 8
       daemons). A draining node or one without a healthy backend forwards whenever any
       peer accepts work.

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
        best = max(pair, key=lambda m: m.headroom)
        if here is None or best.headroom >= here:
            return best
        return None
