"""The member table of `rolloutd status --federation`."""

from __future__ import annotations

from rich.console import Console

from rolloutd.federation import Federation, render_members

from .conftest import Cap


def as_text(table) -> str:
    console = Console(record=True, width=160, color_system=None)
    console.print(table)
    return console.export_text()


async def test_renders_members_with_state_capacity_and_last_heard():
    fed = Federation("node-a", "http://a:8000", capacity=Cap(free_slots=3, queued=1))
    fed.handle_gossip(
        {
            "members": [
                {
                    "node_id": "node-b",
                    "url": "http://b:8000",
                    "incarnation": 4,
                    "heartbeat": 9,
                    "capacity": Cap(free_slots=0, queued=7, in_flight=8, waiting=5, healthy_backends=2,
                                    slots=4, rate=1.234)(),
                    "updated_at": 0.0,
                    "state": "suspect",
                },
                {
                    "node_id": "node-c",
                    "url": "http://c:8000",
                    "incarnation": 1,
                    "heartbeat": 1,
                    "capacity": Cap(draining=True)(),
                    "updated_at": 0.0,
                    "state": "alive",
                },
            ]
        }
    )
    text = as_text(render_members(fed.members()))
    lines = text.splitlines()
    assert any("node-a *" in line and "now" in line for line in lines)
    b = next(line for line in lines if "node-b" in line)
    assert "suspect" in b and " ~7 " in b and " ~5 " in b and " ~8 " in b and "s ago" in b  # its last report
    assert " ~1.23 " in b  # its measured rate; the others have none yet
    assert "stale" in text
    assert "alive, draining" in next(line for line in lines if "node-c" in line)
    for header in ("node", "state", "free", "queued", "waiting", "running", "backends", "rate/s",
                   "last heard"):
        assert header in text


def test_accepts_the_members_route_answer_and_missing_fields():
    text = as_text(
        render_members({"node_id": "x", "members": [{"node_id": "old", "state": "dead"}]})
    )
    row = next(line for line in text.splitlines() if "old" in line)
    assert "dead" in row and "-" in row


async def test_a_dead_members_last_load_is_stale_and_alive_ones_are_live():
    fed = Federation("node-a", "http://a:8000", capacity=Cap(free_slots=3, queued=1))
    members = [
        {"node_id": "node-b", "url": "http://b:8000", "incarnation": 1, "heartbeat": 3,
         "capacity": Cap(free_slots=0, queued=12, in_flight=16, healthy_backends=1)(),
         "updated_at": 0.0, "state": "dead"},
        {"node_id": "node-c", "url": "http://c:8000", "incarnation": 1, "heartbeat": 3,
         "capacity": Cap(free_slots=5, queued=0, in_flight=2, healthy_backends=1)(),
         "updated_at": 0.0, "state": "alive"},
    ]
    fed.handle_gossip({"members": members})
    rows = {m["node_id"]: m for m in fed.members()}
    assert rows["node-b"]["capacity_stale"] is True
    assert rows["node-c"]["capacity_stale"] is False and rows["node-a"]["capacity_stale"] is False
    text = as_text(render_members(fed.members()))
    b = next(line for line in text.splitlines() if "node-b" in line)
    c = next(line for line in text.splitlines() if "node-c" in line)
    assert "dead" in b and " ~12 " in b and " ~16 " in b
    assert "~" not in c and " 5 " in c
    assert "stale" in text
