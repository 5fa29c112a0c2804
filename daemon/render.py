"""Terminal output for the CLI: status tables and the submit progress bar (rich)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rolloutd.daemon.client import Client, RolloutdError
from rolloutd.daemon.trajectory import Trajectory


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
    from rolloutd.federation import render_members

    console.print(render_members(fed["members"]))
    gossip = fed.get("gossip")
    if gossip:  # absent from an older daemon
        refused = gossip["auth_failures"]
        console.print(
            f"gossip: {gossip['rounds']} rounds; {gossip['exchanges']} exchanges started"
            + (f" ({gossip['datagram_exchanges']} over UDP), " if "datagram_exchanges" in gossip else ", ")
            + f"{gossip['answered']} answered, {gossip['failures']} failed, "
            + (f"[red]{refused} refused (a peer has another token)[/red]" if refused else "0 refused")
            + f"; {gossip['refutations']} refutations")


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


def _batch_info(st: Mapping[str, Any]) -> str:
    reasons = " ".join(f"{k}={v}" for k, v in st["filtered_reasons"].items())
    return (f"tried {st['tried']}  in flight {st['in_flight']}  filtered {st['filtered']}"
            + (f" ({reasons})" if reasons else "") + (f"  cancelled {st['cancelled']}" if st["cancelled"] else "")
            + (f"  carried in {st['carried_in']}" if st.get("carried_in") else "")
            + (f"  carried out {st['carried_out']}" if st.get("carried_out") else ""))


def sample_batch_with_progress(
    client: Client,
    tasks: Sequence[Mapping[str, Any]],
    *,
    group_size: int,
    keep: int,
    out: Path | None,
    options: Mapping[str, Any],
    status: Callable[[str], dict[str, Any]] | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run a dynamic-sampling batch with a progress bar of kept groups; kept groups go to ``out``
    (JSONL). ``status`` (a second client's ``batch_status``) refreshes the counts twice a second."""
    console = console or Console(stderr=True)
    st = client.create_batch(tasks, group_size=group_size, keep=keep, **options)
    done = threading.Event()
    sink = out.open("w") if out else None
    try:
        with Progress(TextColumn("kept groups"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[info]}"), console=console) as progress:
            bar = progress.add_task("kept", total=keep, info=_batch_info(st))

            def poll() -> None:
                while status is not None and not done.wait(0.5):
                    try:
                        progress.update(bar, info=_batch_info(status(st["id"])))
                    except RolloutdError:
                        return

            threading.Thread(target=poll, name="batch-progress", daemon=True).start()
            for group in client.batch_groups(st["id"], prompts=tasks):
                if sink:
                    line = {**vars(group), "rollouts": [t.model_dump(mode="json") for t in group.rollouts]}
                    sink.write(json.dumps(line) + "\n")
                progress.update(bar, advance=1)
            st = client.batch_status(st["id"])
            progress.update(bar, completed=st["kept"], info=_batch_info(st))
    finally:
        done.set()
        if sink:
            sink.close()
    console.print(f"batch {st['id']} {st['state']} ({st['stop_reason']}): kept {st['kept']}/{keep}, "
                  + _batch_info(st) + (f"; written to {out}" if out else ""))
    return st


def import_image_with_progress(
    client: Client, source: str, *, name: str | None, console: Console | None = None
) -> dict[str, Any]:
    """``rolloutd images pull|import``: a progress bar of the unpacked bytes, then the image."""
    from rich.progress import DownloadColumn, TransferSpeedColumn

    console = console or Console(stderr=True)
    with Progress(TextColumn("unpacking"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        bar = progress.add_task("unpack", total=None)

        def show(done: int, total: int) -> None:
            progress.update(bar, completed=done, total=total or None)

        image = client.import_image(source, name=name, progress=show)
    console.print(f"{image['digest']}  {_size(image['size'])}  {' '.join(image['names'])}")
    return image


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def print_images(images: Sequence[Mapping[str, Any]], console: Console | None = None) -> None:
    import time

    console = console or Console()
    table = Table("digest", "names", "size", "layers", "last used", "source")
    now = time.time()
    for image in images:
        table.add_row(image["digest"][:19], ", ".join(image["names"]) or "-", _size(image["size"]),
                      str(len(image["layers"])), f"{(now - image['last_used']) / 60:.0f} min ago",
                      image["source"])
    console.print(table)
