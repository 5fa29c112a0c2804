"""Gossip payload validation, tokens and the forwarded header."""

from __future__ import annotations

import httpx
import pytest

from rolloutd import federation
from rolloutd.federation import (
    FORWARDED_HEADER,
    Federation,
    GossipPayloadError,
    check_token,
    forward_headers,
    is_forwarded,
)

from .conftest import Cap


def record(**over):
    base = {
        "node_id": "b",
        "url": "http://b:1/",
        "incarnation": 1,
        "heartbeat": 2,
        "capacity": Cap()(),
        "updated_at": 1.5,
        "state": "alive",
    }
    return {**base, **over}


@pytest.mark.parametrize(
    "payload",
    [
        [],
        {"members": "x"},
        {"protocol": 2, "members": []},
        {"members": [1]},
        {"members": [record(node_id="")]},
        {"members": [record(url="ftp://b")]},
        {"members": [record(state="zombie")]},
        {"members": [record(incarnation=-1)]},
        {"members": [record(heartbeat=True)]},
        {"members": [record(updated_at="now")]},
        {"members": [record(updated_at=float("nan"))]},
        {"members": [record(capacity={"free_slots": 1})]},
        {"members": [record(capacity={**Cap()(), "draining": "no"})]},
        {"members": [record(capacity={**Cap()(), "queued": -1})]},
        {"members": [record(capacity={**Cap()(), "waiting": "2"})]},
    ],
)
async def test_malformed_gossip_is_refused_and_merges_nothing(payload):
    fed = Federation("a", "http://a:1", capacity=Cap())
    with pytest.raises(GossipPayloadError):
        fed.handle_gossip(payload)
    assert [m["node_id"] for m in fed.members()] == ["a"]


async def test_good_gossip_merges_and_answers_our_view():
    fed = Federation("a", "http://a:1/", capacity=Cap(), incarnation=3)
    answer = fed.handle_gossip({"protocol": 1, "members": [record()]})
    assert answer["protocol"] == 1
    assert [(m["node_id"], m["url"]) for m in answer["members"]] == [
        ("a", "http://a:1"),
        ("b", "http://b:1"),
    ]
    rows = fed.members()
    assert set(rows[0]) == {
        "node_id",
        "url",
        "incarnation",
        "heartbeat",
        "capacity",
        "updated_at",
        "state",
        "datagrams",
        "last_heard_s",
        "self",
        "capacity_stale",
    }
    assert rows[0]["self"] and not rows[1]["self"]
    assert rows[1]["datagrams"] is False  # b's record does not say it takes datagrams


async def test_a_record_says_whether_its_member_takes_datagrams():
    fed = Federation("a", "http://a:1/", capacity=Cap())
    fed.handle_gossip({"protocol": 1, "members": [dict(record(), datagrams=True)]})
    assert [m.datagrams for m in fed.peers()] == [True]
    with pytest.raises(GossipPayloadError, match="datagrams"):
        fed.handle_gossip({"protocol": 1, "members": [dict(record(), datagrams="yes")]})


def test_check_token():
    assert check_token(None, None)
    assert check_token("Bearer whatever", None)
    assert check_token("Bearer s3cret", "s3cret")
    assert check_token("bearer s3cret", "s3cret")
    assert not check_token(None, "s3cret")
    assert not check_token("Bearer wrong", "s3cret")
    assert not check_token("Basic s3cret", "s3cret")
    assert not check_token("s3cret", "s3cret")


def test_forward_headers_mark_and_authenticate():
    h = httpx.Headers(forward_headers("tok"))
    assert h["authorization"] == "Bearer tok"
    assert h[FORWARDED_HEADER.lower()] == "1"
    assert is_forwarded(h)
    assert not is_forwarded(httpx.Headers({}))
    assert forward_headers(None) == {FORWARDED_HEADER: "1"}


async def test_bad_capacity_callback_is_a_type_error():
    fed = Federation("a", "http://a:1", capacity=lambda: {"free_slots": "many"})  # type: ignore[arg-type,return-value]
    with pytest.raises(Exception, match="capacity"):
        fed.place()


def test_took_at_round_trips_and_a_malformed_one_is_ignored():
    headers = federation.took_at_headers((1795748184898, 7))
    assert federation.took_at(headers) == (1795748184898, 7)
    assert federation.took_at({federation.TOOK_AT_HEADER.lower(): "3.4"}) == (3, 4)
    for bad in ("", "3", "3.", ".4", "-1.2", "3.4.5", "a.b", "9" * 50 + ".1"):
        assert federation.took_at({federation.TOOK_AT_HEADER: bad}) is None, bad
    assert federation.took_at({}) is None


async def test_capacity_without_waiting_counts_none_waiting():
    """A member older than the ``waiting`` field (work stealing of rollouts through INIT)."""
    fed = Federation("a", "http://a:1", capacity=Cap())
    old = {k: v for k, v in Cap(waiting=3)().items() if k != "waiting"}
    fed.handle_gossip({"members": [record(capacity=old)]})
    member = fed.member("b")
    assert member is not None and member.capacity["waiting"] == 0
    fed.handle_gossip({"members": [record(heartbeat=3, capacity=Cap(waiting=3)())]})
    member = fed.member("b")
    assert member is not None and member.capacity["waiting"] == 3


@pytest.mark.parametrize(("field", "value", "bads"), [
    ("slots", 7, (-1, 1.5, "7", True)),  # a node's workers, which headroom counts against
    ("rate", 1.25, (-0.5, float("nan"), float("inf"), "1", True)),  # its speed while full
])
async def test_capacity_without_a_newer_field_is_an_older_member_and_bad_values_are_refused(
    field, value, bads
):
    """``slots`` and ``rate`` came after the other capacity fields: a member that does not
    send them reports 0 (not known); a bad value refuses the whole payload."""
    fed = Federation("a", "http://a:1", capacity=Cap())
    old = {k: v for k, v in Cap(**{field: value})().items() if k != field}
    fed.handle_gossip({"members": [record(capacity=old)]})
    member = fed.member("b")
    assert member is not None and member.capacity[field] == 0
    fed.handle_gossip({"members": [record(heartbeat=3, capacity=Cap(**{field: value})())]})
    member = fed.member("b")
    assert member is not None and member.capacity[field] == value
    for bad in bads:
        with pytest.raises(GossipPayloadError, match=field):
            fed.handle_gossip({"members": [record(heartbeat=4, capacity={**Cap()(), field: bad})]})