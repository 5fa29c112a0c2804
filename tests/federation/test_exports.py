"""The public surface of federation/ is exactly __all__ (like httpx's test_exported_members)."""

from __future__ import annotations

from rolloutd import federation

EXPECTED = {
    "FORWARDED_HEADER",
    "FORWARDED_VALUE",
    "GOSSIP_PATH",
    "MEMBERS_PATH",
    "PROTOCOL_VERSION",
    "Capacity",
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
    "is_forwarded",
    "render_members",
    "slurm_seeds",
}


def test_all_is_exactly_the_public_api():
    assert set(federation.__all__) == EXPECTED
    for name in federation.__all__:
        assert hasattr(federation, name), name
    public = {n for n in vars(federation) if not n.startswith("_")} - {"testing", "annotations"}
    assert public == EXPECTED


def test_constants():
    assert federation.FORWARDED_HEADER == "X-Rolloutd-Forwarded"
    assert federation.GOSSIP_PATH == "/v1/federation/gossip"
    assert federation.MEMBERS_PATH == "/v1/federation/members"


def test_error_tree():
    for name in (
        "GossipPayloadError",
        "PeerError",
        "PeerAuthError",
        "DuplicateJobError",
        "SlurmError",
    ):
        assert issubclass(getattr(federation, name), federation.FederationError)
    assert issubclass(federation.PeerAuthError, federation.PeerError)
