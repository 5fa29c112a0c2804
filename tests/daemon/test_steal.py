"""The thief's memory of peers that gave nothing (daemon/steal.py), with labelled test doubles."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from rolloutd.daemon.config import Settings
from rolloutd.daemon.steal import Stealer
from rolloutd.federation import Member, MemberState


class EmptyHanded:
    """TEST DOUBLE of the forwarder's HTTP client: every victim answers that it moved nothing."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def post(self, url: str, **_: Any) -> Any:
        self.asked.append(url)
        return SimpleNamespace(status_code=200, json=lambda: {"moved": []})


def busy_peer(name: str) -> Member:
    m = Member(node_id=name, url=f"http://{name}:1", state=MemberState.ALIVE)
    m.capacity = {"free_slots": 0, "queued": 5, "waiting": 0, "in_flight": 4, "slots": 4,
                  "healthy_backends": 1, "draining": False}
    return m


async def test_a_thief_forgets_the_peers_that_gave_nothing_once_they_leave():
    members = [busy_peer("b"), busy_peer("c")]
    client = EmptyHanded()
    # TEST DOUBLES: a pipeline with two free workers and nothing queued, a service that is not
    # draining, and a forwarder whose federation lists ``members``. _steal reads only these.
    stealer = Stealer(
        node_id="a", settings=Settings(), journal=cast(Any, None), follow=lambda jobs: None,
        pipeline=cast(Any, SimpleNamespace(free_capacity=lambda: 2, has_room=lambda: True)),
        service=cast(Any, SimpleNamespace(draining=False)),
        forwarder=cast(Any, SimpleNamespace(
            client=client, federation=SimpleNamespace(peers=lambda: members))),
    )
    await stealer._steal()
    assert len(client.asked) == 2 and set(stealer._dry) == {"b", "c"}
    await stealer._steal()  # no newer report of either: neither is asked again
    assert len(client.asked) == 2

    members[0].state = MemberState.DEAD
    await stealer._steal()
    assert set(stealer._dry) == {"c"}  # the dead one's entry is gone; c still gave nothing
    members.pop(0)  # it left the table altogether
    await stealer._steal()
    assert set(stealer._dry) == {"c"} and len(client.asked) == 2
