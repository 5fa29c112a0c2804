"""Federation of rolloutd daemons: membership, capacity gossip, placement.

Knows nothing of the daemon: the daemon hands a Federation a capacity callback, serves
`handle_gossip` and `members` on its HTTP API, asks `place()` where a new rollout should
run, and forwards it itself with `forward_headers(token)`.
"""

from ._exceptions import (
    DatagramError,
    DuplicateJobError,
    FederationError,
    FederationSettingError,
    GossipPayloadError,
    PeerAuthError,
    PeerError,
    SlurmError,
)
from ._federation import Federation, FederationStatistics, MemberCallback
from ._forwarded import ForwardedJobs
from ._member import Member, MemberState
from ._placement import IMAGE_HOMES, Placement, image_homes
from ._render import render_members
from ._settings import GossipSettings
from ._slurm import slurm_seeds
from ._wire import (
    FORWARDED_HEADER,
    FORWARDED_VALUE,
    GOSSIP_PATH,
    IDS_HEADER,
    MAX_FORWARDED_IDS,
    MEMBERS_PATH,
    ORIGIN_HEADER,
    PROTOCOL_VERSION,
    TOOK_AT_HEADER,
    Capacity,
    auth_headers,
    check_token,
    forward_headers,
    forwarded_ids,
    forwarded_origin,
    ids_headers,
    is_forwarded,
    took_at,
    took_at_headers,
)

__all__ = [
    "FORWARDED_HEADER",
    "FORWARDED_VALUE",
    "GOSSIP_PATH",
    "IDS_HEADER",
    "IMAGE_HOMES",
    "MAX_FORWARDED_IDS",
    "MEMBERS_PATH",
    "ORIGIN_HEADER",
    "PROTOCOL_VERSION",
    "TOOK_AT_HEADER",
    "Capacity",
    "DatagramError",
    "DuplicateJobError",
    "Federation",
    "FederationError",
    "FederationSettingError",
    "FederationStatistics",
    "ForwardedJobs",
    "GossipPayloadError",
    "GossipSettings",
    "Member",
    "MemberCallback",
    "MemberState",
    "PeerAuthError",
    "PeerError",
    "Placement",
    "SlurmError",
    "auth_headers",
    "check_token",
    "forward_headers",
    "forwarded_ids",
    "forwarded_origin",
    "ids_headers",
    "image_homes",
    "is_forwarded",
    "render_members",
    "slurm_seeds",
    "took_at",
    "took_at_headers",
]
