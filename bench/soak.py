"""Soak: thousands of rollouts through a real `rolloutd serve` with about 10% injected faults.

Setup: a `rolloutd serve` process (bwrap sandboxes) whose LLM pool holds two
`rolloutd model-server --backend scripted` processes (the scripted policy is a labelled TEST
DOUBLE: every rollout runs its workspace's ``run.sh`` with the bash tool, then finishes).
Rollouts are ``code`` tasks (an agent sandbox, a bash tool, a fresh evaluation sandbox)
submitted by ``--clients`` concurrent clients with ``wait=true``.

Injected faults (``--fault-rate`` of the rollouts, in turn):

- tool crash: ``run.sh`` kills the agent's bash shell (``kill -9 $PPID``); the tool restarts it
- sandbox start failure: a ``swe`` task whose repository does not exist (bwrap refuses)
- timeout: a rollout budget of 1.5 s spent in a ``sleep 30`` tool call (``timed_out``)
- tool timeout: ``sleep 30`` under a 0.5 s tool timeout (the rollout goes on)
- backend death: model-server A is SIGKILLed every ``--kill-every`` rollouts and restarted
  3 s later; its rollouts fail over to B (turns record the retry)

The daemon keeps at most ``--max-results`` finished results in memory (and for 60 s), so a
growing RSS means a leak, not retention. Checked: every rollout reaches a terminal status and the expected one for its fault; the
daemon's RSS and fd count after warm-up (the first ``--warmup`` rollouts) and at the end;
after a SIGTERM drain, leaks = sandbox processes + sandbox dirs + cgroups + mounts left.

Then the memory a finished result holds: ``--big-results`` ``sleep`` rollouts (a labelled
test task: no sandbox, no model) whose task bodies carry ``--big-body-mb`` MB of padding are
run one after another; the daemon's RSS growth once they are finished (and kept in the result
store), divided by their number, is ``rss_per_result_kb``. A daemon that kept each task
would grow by about the body size per result.

Ends with: RESULT rollouts=N terminal=N leaks=N rss_growth_mb=F fd_growth=N rss_per_result_kb=F
"""

from __future__ import annotations

import argparse
import itertools
import random
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import trio
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.hostile._daemon import (  # noqa: E402  (the hostile suite's process harness)
    GOOD,
    RUN_SCRIPT,
    Daemon,
    ModelServer,
    cgroup_dirs,
    code_task,
    fd_count,
    mounts_under,
    rss_mb,
    sandbox_dirs,
    sandbox_pids,
    short_dir,
)

SETTLE_S = 3.0
TERMINAL = {"completed", "failed", "timed_out", "cancelled", "lost"}
FAULTS = ("tool_crash", "sandbox_start", "timeout", "tool_timeout")
EXPECTED = {"none": {"completed"}, "tool_crash": {"completed"}, "sandbox_start": {"failed"},
            "timeout": {"timed_out"}, "tool_timeout": {"completed"}}


def make_task(kind: str) -> dict[str, Any]:
    """The request body of one rollout with fault ``kind`` (or "none")."""
    if kind == "tool_crash":
        return {"task": code_task("kill -9 $PPID")}
    if kind == "sandbox_start":
        return {"task": {"kind": "swe", "instance_id": "soak", "problem_statement": "p",
                         "base_commit": "abc123", "FAIL_TO_PASS": ["t"],
                         "repo_path": "/nonexistent/soak-repo"}}
    if kind == "timeout":
        return {"task": code_task("sleep 30"), "timeout_s": 1.5}
    if kind == "tool_timeout":
        return {"task": code_task("sleep 30; " + GOOD), "limits": {"tool_timeout_s": 0.5}}
    return {"task": code_task(GOOD)}


def plan(n: int, fault_rate: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    kinds = itertools.cycle(FAULTS)
    return [next(kinds) if rng.random() < fault_rate else "none" for _ in range(n)]


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.kinds = plan(args.rollouts, args.fault_rate, args.seed)
        self.results: list[dict[str, Any] | None] = [None] * args.rollouts
        self.errors: list[str] = []
        self.done = 0
        self.kills = 0
        self._next: Any = iter(())

    async def phase(self, daemon: Daemon, start: int, stop: int, server: ModelServer | None) -> None:
        """Rollouts ``start..stop-1`` through ``--clients`` concurrent clients."""
        self._next = iter(range(start, stop))
        async with trio.open_nursery() as n:
            if server is not None:
                n.start_soon(self.killer, server, stop)
            async with trio.open_nursery() as clients:
                for _ in range(self.args.clients):
                    clients.start_soon(self.client, daemon)
            n.cancel_scope.cancel()

    async def client(self, daemon: Daemon) -> None:
        async with daemon.client(timeout=httpx.Timeout(10, read=300)) as h:
            for i in self._next:
                body = make_task(self.kinds[i])
                body.setdefault("timeout_s", 120)
                body["wait"] = True
                for attempt in range(3):
                    try:
                        r = await h.post("/v1/rollouts", json=body)
                    except httpx.HTTPError as exc:
                        self.errors.append(f"rollout {i}: {exc!r}")
                        continue
                    if r.status_code == 200:
                        self.results[i] = r.json()["rollouts"][0]
                        break
                    self.errors.append(f"rollout {i}: HTTP {r.status_code} {r.text[:200]}")
                    await trio.sleep(1 + attempt)
                self.done += 1

    async def killer(self, server: ModelServer, stop: int) -> None:
        """Kill model-server A every --kill-every finished rollouts; restart it 3 s later."""
        next_kill = self.done + self.args.kill_every
        while self.done < stop - self.args.kill_every // 2:
            if self.done >= next_kill:
                await server.kill()
                self.kills += 1
                await trio.sleep(3)
                await server.start()
                next_kill += self.args.kill_every
            await trio.sleep(0.2)


async def rss_per_result_kb(daemon: Daemon, results: int, body_mb: float) -> float:
    """RSS the daemon holds per finished result whose task body was ``body_mb`` MB."""
    pad = "x" * int(body_mb * 1024 * 1024)
    async with daemon.client(timeout=httpx.Timeout(10, read=120)) as h:
        await trio.sleep(SETTLE_S)
        before = rss_mb(daemon.pid)
        for i in range(results):
            r = await h.post("/v1/rollouts", json={"task": {"kind": "sleep", "id": f"big-{i}", "pad": pad},
                                                   "wait": True})
            r.raise_for_status()
            assert r.json()["rollouts"][0]["status"] == "completed", r.text[:300]
        await trio.sleep(SETTLE_S)
        return (rss_mb(daemon.pid) - before) * 1024 / results


def table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for row in rows:
        t.add_row(*(str(x) for x in row))
    return t


async def main(args: argparse.Namespace) -> None:
    console = Console()
    root = short_dir("rls")
    soak = Soak(args)
    a = ModelServer(RUN_SCRIPT, latency_s=args.latency_s)
    b = ModelServer(RUN_SCRIPT, latency_s=args.latency_s)
    daemon = Daemon(root / "state", log_level="warning", n_init=args.n_init, n_run=args.n_run,
                    n_eval=args.n_eval, health_interval_s=1.0,
                    # Finished results are kept (for GET) up to these bounds: small, so that
                    # RSS growth measures leaks, not the result store filling up.
                    max_results=args.max_results, result_ttl_s=60,
                    backends=[{"kind": "vllm", "url": a.url, "id": "ms-a"},
                              {"kind": "vllm", "url": b.url, "id": "ms-b"}])
    t0 = time.monotonic()
    end_rss = warm_rss = 0.0
    end_fds = warm_fds = 0
    exit_code = None
    per_result_kb = float("nan")
    status: dict[str, Any] = {}
    tag = ""
    run_s = 0.0
    try:
        async with trio.open_nursery() as n:
            n.start_soon(a.start)
            n.start_soon(b.start)
        await daemon.start()
        tag = daemon.tag
        console.print(f"daemon pid {daemon.pid} up in {time.monotonic() - t0:.1f} s; "
                      f"{args.rollouts} rollouts, {args.clients} clients, n_run={args.n_run}")
        t_run = time.monotonic()
        async with trio.open_nursery() as n:

            async def progress() -> None:
                while True:
                    await trio.sleep(30)
                    console.print(f"  {soak.done}/{args.rollouts} in {time.monotonic() - t_run:.0f} s, "
                                  f"RSS {rss_mb(daemon.pid):.1f} MB, fds {fd_count(daemon.pid)}")
            n.start_soon(progress)
            # Warm-up, then the daemon's RSS and fds at rest; the rest; at rest again.
            await soak.phase(daemon, 0, args.warmup, None)
            await trio.sleep(SETTLE_S)
            warm_rss, warm_fds = rss_mb(daemon.pid), fd_count(daemon.pid)
            await soak.phase(daemon, args.warmup, args.rollouts, a)
            n.cancel_scope.cancel()
        run_s = time.monotonic() - t_run
        await trio.sleep(SETTLE_S)
        end_rss, end_fds = rss_mb(daemon.pid), fd_count(daemon.pid)
        per_result_kb = await rss_per_result_kb(daemon, args.big_results, args.big_body_mb)
        async with daemon.client() as h:
            status = (await h.get("/v1/status")).json()
        exit_code = await daemon.stop()
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.kill_sync()
        a.kill_sync()
        b.kill_sync()

    # ---- leaks, after the daemon is gone ----
    await trio.sleep(1)
    left_pids = sandbox_pids(tag)
    left_dirs = sandbox_dirs(daemon.state_dir)
    left_cgroups = cgroup_dirs(tag)
    left_mounts = mounts_under(root)
    leaks = len(left_pids) + len(left_dirs) + len(left_cgroups) + len(left_mounts)

    # ---- tables ----
    by_kind: dict[str, Counter[str]] = {}
    unexpected = 0
    retried = 0
    for kind, res in zip(soak.kinds, soak.results, strict=True):
        st = res["status"] if res else "no answer"
        by_kind.setdefault(kind, Counter())[st] += 1
        if st not in EXPECTED[kind]:
            unexpected += 1
        if res and any(t["retries"] for t in res["turns"]):
            retried += 1
    terminal = sum(1 for r in soak.results if r and r["status"] in TERMINAL)
    console.print(table("rollouts by injected fault", ["fault", "rollouts", "statuses", "expected"],
                        [[k, sum(c.values()), dict(c), "/".join(sorted(EXPECTED[k]))]
                         for k, c in sorted(by_kind.items())]))
    sb = status.get("sandboxes") or {}
    console.print(table("daemon", ["measure", "value"], [
        ["wall time of the run (s)", f"{run_s:.1f}"],
        ["rollouts per second", f"{args.rollouts / run_s:.2f}"],
        ["backend kills (model-server A)", soak.kills],
        ["rollouts whose turns retried on the other backend", retried],
        ["unexpected statuses", unexpected],
        ["client errors (HTTP)", len(soak.errors)],
        [f"RSS at rest after {args.warmup} warm-up rollouts / at the end (MB)",
         f"{warm_rss:.1f} / {end_rss:.1f}"],
        [f"fds at rest after {args.warmup} warm-up rollouts / at the end", f"{warm_fds} / {end_fds}"],
        ["sandboxes opened / closed / start failures",
         f"{sb.get('opened')} / {sb.get('closed')} / {sb.get('start_failures')}"],
        [f"RSS held per finished result with a {args.big_body_mb:g} MB task body "
         f"({args.big_results} results, KB)", f"{per_result_kb:.1f}"],
        ["daemon exit code after SIGTERM", exit_code],
        ["leaked sandbox processes / dirs / cgroups / mounts",
         f"{len(left_pids)} / {len(left_dirs)} / {len(left_cgroups)} / {len(left_mounts)}"],
    ]))
    for err in soak.errors[:10]:
        console.print(f"[yellow]{err}")
    shutil.rmtree(root, ignore_errors=True)
    print(f"RESULT rollouts={args.rollouts} terminal={terminal} leaks={leaks} "
          f"rss_growth_mb={end_rss - warm_rss:.1f} fd_growth={end_fds - warm_fds} "
          f"rss_per_result_kb={per_result_kb:.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=2000)
    p.add_argument("--fault-rate", type=float, default=0.10)
    p.add_argument("--clients", type=int, default=32, help="concurrent wait=true requests")
    p.add_argument("--n-init", type=int, default=8)
    p.add_argument("--n-run", type=int, default=24)
    p.add_argument("--n-eval", type=int, default=8)
    p.add_argument("--latency-s", type=float, default=0.01, help="scripted latency per LLM request")
    p.add_argument("--kill-every", type=int, default=400, help="kill model-server A every N rollouts")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--max-results", type=int, default=200, help="the daemon's result store bound")
    p.add_argument("--big-results", type=int, default=30,
                   help="finished results with large task bodies, for rss_per_result_kb")
    p.add_argument("--big-body-mb", type=float, default=8.0, help="size of each of those task bodies")
    p.add_argument("--seed", type=int, default=9)
    return p.parse_args(argv)


if __name__ == "__main__":
    trio.run(main, parse_args())
