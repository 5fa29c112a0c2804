"""The member table of `rolloutd status --federation`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table
from rich.text import Text

_STATE_STYLE = {"alive": "green", "suspect": "yellow", "dead": "red", "left": "dim"}


def render_members(
    members: Sequence[Mapping[str, Any]] | Mapping[str, Any], *, title: str | None = "federation"
) -> Table:
    """A rich Table of members (the list from GET /v1/federation/members, or an object
    with a "members" list): node, URL, state, capacity, queue, measured rate, last heard.

    Print it with `rich.console.Console().print(table)`. Missing fields show as "-", so a
    table from an older daemon still renders."""
    rows: Sequence[Mapping[str, Any]] = (
        members.get("members", []) if isinstance(members, Mapping) else members
    )
    table = Table(title=title, title_justify="left")
    table.add_column("node", no_wrap=True)
    table.add_column("url", overflow="fold")
    table.add_column("state")
    table.add_column("free", justify="right")
    table.add_column("queued", justify="right")
    table.add_column("waiting", justify="right")  # through INIT, before RUN
    table.add_column("running", justify="right")
    table.add_column("backends", justify="right")
    table.add_column("rate/s", justify="right")  # finishes per second while full
    table.add_column("last heard", justify="right")
    any_stale = False
    for m in sorted(rows, key=lambda m: str(m.get("node_id", ""))):
        cap = m.get("capacity") or {}
        state = str(m.get("state", "-"))
        if cap.get("draining") and state == "alive":
            state_text = Text("alive, draining", style="yellow")
        else:
            state_text = Text(state, style=_STATE_STYLE.get(state, ""))
        node = str(m.get("node_id", "-"))
        stale = _is_stale(m, state)
        any_stale = any_stale or stale
        table.add_row(
            Text(node + (" *" if m.get("self") else ""), style="bold" if m.get("self") else ""),
            str(m.get("url", "-")),
            state_text,
            *(_num(cap.get(k), stale=stale)
              for k in ("free_slots", "queued", "waiting", "in_flight", "healthy_backends")),
            _num(f"{cap['rate']:.2f}" if cap.get("rate") else None, stale=stale),
            "now" if m.get("self") else _ago(m.get("last_heard_s")),
        )
    if any_stale:
        table.caption = "~n: the last load a member reported before it went quiet (stale, not live)"
        table.caption_justify = "left"
    return table


def _is_stale(m: Mapping[str, Any], state: str) -> bool:
    """Whether a member's capacity is only its last report (not alive, not this node)."""
    if "capacity_stale" in m:
        return bool(m["capacity_stale"])
    return not m.get("self") and state != "alive"


def _num(v: Any, *, stale: bool = False) -> Text | str:
    if v is None:
        return "-"
    return Text(f"~{v}", style="dim italic") if stale else str(v)


def _ago(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"
