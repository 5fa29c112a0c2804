"""What federation/'s public names mean (that they are exactly ``__all__``: tests/test_exports.py)."""

from __future__ import annotations

from rolloutd import federation


def test_constants():
    assert federation.FORWARDED_HEADER == "X-Rolloutd-Forwarded"
    assert federation.GOSSIP_PATH == "/v1/federation/gossip"
    assert federation.MEMBERS_PATH == "/v1/federation/members"
    assert federation.IMAGE_HOMES == 2 and federation.MAX_FORWARDED_IDS == 10_000


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
