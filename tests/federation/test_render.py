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
                    "capacity": Cap(free_slots=0, queued=7, in_flight=8, healthy_backends=2)(),
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
    assert "suspect" in b and " 7 " in b and " 8 " in b and "s ago" in b
    assert "alive, draining" in next(line for line in lines if "node-c" in line)
    for header in ("node", "state", "free", "queued", "running", "backends", "last heard"):
        assert header in text


def test_accepts_the_members_route_answer_and_missing_fields():
    text = as_text(
        render_members({"node_id": "x", "members": [{"node_id": "old", "state": "dead"}]})
    )
    row = next(line for line in text.splitlines() if "old" in line)
    assert "dead" in row and "-" in row
