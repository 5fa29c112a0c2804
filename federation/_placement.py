"""Where a new rollout runs: here, or on the peer that would finish it first (two choices);
a task with an image goes first to that image's homes."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence

from ._member import Member
from ._wire import Capacity, finish_s, headroom

#: Measured rates closer than this (the larger over the smaller) count as equal speeds, and
#: headroom decides: equal daemons of bench/federation.py measured up to 1.17 apart in one
#: burst (their speed while full varies with the shared VM), and sharing work by that noise
#: spread a burst unevenly (13-18 rollouts a daemon against 14-17).
SPEEDS_DIFFER = 1.25
#: How many members are an image's homes: where the rollouts of tasks with that image go
#: first, while a home has room, so that a federation unpacks (and caches) each image on a
#: few nodes instead of every one. Two, so that one busy home does not send it elsewhere.
IMAGE_HOMES = 2


def image_homes(image: str, node_ids: Iterable[str], k: int = IMAGE_HOMES) -> list[str]:
    """The ``k`` of ``node_ids`` that are ``image``'s homes, best first: rendezvous (highest
    random weight) hashing. Every front that knows the same members picks the same homes,
    and a member that joins or leaves moves only the images it is or was a home of."""
    def weight(node_id: str) -> bytes:
        return hashlib.blake2b(f"{image}\0{node_id}".encode(), digest_size=8).digest()

    return sorted(set(node_ids), key=weight, reverse=True)[:k]


def homes_among(image: str, peers: Iterable[Member], local_id: str, *,
                local_accepts: bool) -> list[str]:
    """``image``'s homes among the ``peers`` that accept work and this node (``local_id``,
    when it accepts work): what rule 0 places by, and where a batch warms the image."""
    ids = [m.node_id for m in peers if m.accepts_work] + ([local_id] if local_accepts else [])
    return image_homes(image, ids)


def local_headroom(local: Capacity) -> int | None:
    """This node's headroom (see ``headroom`` in _wire.py); None when it takes no work
    (draining, no backend)."""
    if local["draining"] or local["healthy_backends"] <= 0:
        return None
    return headroom(local)


class Placement:
    """The placement policy of a front node (pure: no I/O, no clock).

    1. A node with room (headroom > 0) runs the rollout itself: no extra hop.
    2. Otherwise it samples two peers that accept work (power of two choices; every one
       for a request of several samples, see below) and takes
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
    gossip from all picking the same peer. A request of several samples (a group: a client's
    ``n``, a batch's ``group_size``) is compared against every peer that accepts work
    instead: two choices leave about one request's worth of imbalance per node, which for a
    group is the group's size (a batch of 32 groups of 4 on 8 equal daemons ended with one
    daemon holding 5 groups and another 3 in every burst; a scan of all, none). One front's
    own choices never pile up on one peer, since each one is debited from the peer's
    headroom at once; fronts that share stale gossip may, for one gossip interval.

    0. With ``image`` (the task's image ref), before all of that: the image's homes (see
       ``image_homes``, among this node and the peers that accept work) come first. A home
       with room takes it: this node when it is one, else the home peer with more headroom,
       even when this node has room (a forward costs milliseconds; an image's first unpack
       on one more node, seconds to minutes, and space in its cache). When no home has room,
       rules 1-3 decide as for any task.
    """

    def __init__(self, *, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self.image_home = 0  # tasks with an image placed on one of its homes (rule 0)
        self.image_spilled = 0  # tasks with an image whose homes had no room (rules 1-3)

    def choose(self, local: Capacity, peers: Sequence[Member], *, image: str | None = None,
               local_id: str = "", n: int = 1) -> Member | None:
        """The peer to forward a request of ``n`` samples to, or None to run it locally
        (``local_id``: this node's id, for the homes of ``image``)."""
        here = local_headroom(local)
        candidates = [m for m in peers if m.accepts_work]
        if image:
            homes = homes_among(image, candidates, local_id, local_accepts=here is not None)
            if here is not None and here > 0 and local_id in homes:
                self.image_home += 1
                return None
            roomy = [m for m in candidates if m.node_id in homes and m.headroom > 0]
            if roomy:
                self.image_home += 1
                return max(roomy, key=lambda m: m.headroom)
            self.image_spilled += 1
        if here is not None and here > 0:
            return None
        if not candidates:
            return None
        drawn = self._rng.sample(candidates, len(candidates) if n > 1 else min(2, len(candidates)))
        timed = [(t, m) for m in drawn if (t := m.finish_s) is not None]
        mine = None if here is None else finish_s(local)
        rates = [m.capacity.get("rate", 0.0) for m in drawn]
        rates += [] if here is None else [local.get("rate", 0.0)]
        if (len(timed) == len(drawn) and (here is None or mine is not None)
                and max(rates) >= SPEEDS_DIFFER * min(rates)):
            when, best = min(timed, key=lambda tm: tm[0])
            return best if mine is None or when <= mine else None
        best = max(drawn, key=lambda m: m.headroom)
        return best if here is None or best.headroom >= here else None
