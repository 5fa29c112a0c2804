"""Terminal output for the CLI: status tables and the submit progress bar (rich)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from daemon.client import Client
from daemon.trajectory import Trajectory


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_status(st: Mapping[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    pipe = st["pipeline"]
    state = "draining" if st["draining"] else ("ready" if st["ready"] else "starting")
    console.print(f"[bold]{st['node_id']}[/bold]  {state}  up {st['uptime_s']:.0f}s  "
                  f"queued {pipe['queued']}/{pipe['queue_capacity']}")
    table = Table(title="stages")
    for col in ("stage", "workers", "queued", "in flight", "finished", "failed", "p50 s", "p95 s"):
        table.add_column(col, justify="right" if col != "stage" else "left")
    for name, s in pipe["stages"].items():
        table.add_row(name, str(s["workers"]), str(s["queued"]), str(s["in_flight"]),
                      str(s["finished"]), str(s["failed"]), _fmt(s["p50_s"]), _fmt(s["p95_s"]))
    console.print(table)
    rollouts = st.get("rollouts") or {}
    console.print("rollouts: " + ", ".join(f"{k} {v}" for k, v in rollouts.items()))
    backends = (st.get("backends") or {}).get("backends") or []
    if backends:
        bt = Table(title=f"backends (policy version {st['backends']['policy_version']})")
        for col in ("id", "kind", "healthy", "in flight", "served"):
            bt.add_column(col)
        for b in backends:
            bt.add_row(str(b.get("id")), str(b.get("kind", "")), "yes" if b.get("healthy") else "no",
                       str(b.get("in_flight", 0)), str(b.get("served", 0)))
        console.print(bt)
    sandboxes = st.get("sandboxes")
    if sandboxes:
        console.print("sandboxes: " + ", ".join(f"{k} {v}" for k, v in sandboxes.items()
                                                if not isinstance(v, dict | list)))


def print_federation(st: Mapping[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    fed = st.get("federation")
    if not fed:
        console.print("federation is not enabled on this daemon")
        return
    from federation import render_members

    console.print(render_members(fed["members"]))


def submit_with_progress(
    client: Client,
    tasks: Sequence[Mapping[str, Any]],
    *,
    n: int,
    out: Path | None,
    options: Mapping[str, Any],
    console: Console | None = None,
) -> list[Trajectory]:
    console = console or Console(stderr=True)
    ids: list[str] = []
    for task in tasks:
        ids += client.submit(task, n=n, **options).ids
    results: list[Trajectory] = []
    counts: dict[str, int] = {}
    sink = out.open("w") if out else None
    try:
        with Progress(TextColumn("rollouts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[counts]}"), console=console) as progress:
            bar = progress.add_task("rollouts", total=len(ids), counts="")
            for traj in client.stream(ids):
                results.append(traj)
                counts[traj.status.value] = counts.get(traj.status.value, 0) + 1
                if sink:
                    sink.write(json.dumps(traj.model_dump(mode="json")) + "\n")
                progress.update(bar, advance=1, counts=" ".join(f"{k}={v}" for k, v in counts.items()))
    finally:
        if sink:
            sink.close()
    rewards = [t.reward for t in results if t.reward is not None]
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    console.print(f"{len(results)} rollouts: " + ", ".join(f"{k} {v}" for k, v in counts.items())
                  + f"; mean reward {mean:.3f}" + (f"; written to {out}" if out else ""))
    return results
