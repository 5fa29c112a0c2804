"""ForwardedJobs: the front node's record of forwarded jobs."""

from __future__ import annotations

import pytest

from rolloutd.federation import DuplicateJobError, FederationError, ForwardedJobs


def test_track_discard_and_fail():
    t = ForwardedJobs()
    t.add("j1", "b")
    t.add("j2", "b")
    t.add("j3", "c")
    assert len(t) == 3 and "j1" in t and t.node_of("j3") == "c"
    t.discard("j1")
    t.discard("j1")  # idempotent
    assert t.jobs_on("b") == ["j2"]
    assert t.fail_node("b") == ["j2"]
    assert t.fail_node("b") == []
    assert t.node_of("j2") is None
    assert t.statistics() == {"forwarded": 1, "peers": 1, "orphans": 1}
    assert t.take_orphans("b") == ["j2"]
    assert t.take_orphans("b") == []


def test_a_job_is_never_tracked_twice():
    t = ForwardedJobs()
    t.add("j1", "b")
    with pytest.raises(DuplicateJobError, match="already forwarded to b") as info:
        t.add("j1", "c")
    assert isinstance(info.value, FederationError)
    assert t.node_of("j1") == "b"


def test_orphans_are_bounded_oldest_first():
    t = ForwardedJobs(max_orphans=2)
    for j in ("j1", "j2", "j3"):
        t.add(j, "b")
    t.fail_node("b")
    assert t.take_orphans("b") == ["j2", "j3"]
