"""The SWE set, scored end to end: every shipped instance with its gold patch, the empty patch
and a wrong patch, through a real `rolloutd serve`, real images, real evaluation in place.

Setup: the SWE set's images (examples/swe_set/build.py: the Debian test image plus each
project's repository at /testbed, an instance branch each) and instances; one `rolloutd serve`
process (bwrap, its own image store) grading with its built-in parsers (``swe_grader=builtin``)
and one `rolloutd model-server --backend scripted` process: the scripted policy (a labelled
TEST DOUBLE, not a model) is the agent, applying the patch it is given, then finishing.

Each rollout is the instance's ``swe`` task (patches hidden from the task) whose
``env_setup`` exports the variant's patch as ``ROLLOUTD_BENCH_PATCH``: INIT runs it, so the
agent's shell has it, and the scripted agent's one bash call applies it with ``git apply``
in the repository (nothing for the empty variant). EVAL is the real one: kill leftovers, take
the diff, check and apply the test patch, run the project's test command, grade the log.

Checked per rollout: gold resolved (reward 1), empty and wrong not resolved (0); every
rollout completed (a failed one counts against its variant). The eval log of each rollout
(``reward_info.eval_log``) is graded again here with the official harness's grading (the
``swebench`` package's parsers and functions): ``harness_agreement`` is the share of
rollouts whose verdict (resolved or not) equals that grading. The empty patch never runs the
tests (``empty_patch``), as the harness does not: it is counted as agreeing when both say
unresolved. ``eval_p50_s`` is the median EVAL stage time of the gold and wrong rollouts.

    .venv/bin/python bench/swe_set.py [--n-slots 2] [--limit N]

Ends with: RESULT instances=N projects=N gold_rate=F empty_resolved=N wrong_resolved=N
harness_agreement=F eval_p50_s=F
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rolloutd.daemon.demo import swe_set_module  # noqa: E402
from rolloutd.daemon.tasks._swe_grading import grade, swebench_version  # noqa: E402
from tests.hostile._daemon import Daemon, ModelServer, tool_call  # noqa: E402

BUILD = swe_set_module()  # examples/swe_set/build.py
POLICY = [tool_call("bash", command=BUILD.APPLY_PATCH), tool_call("finish", answer="done")]


async def run_all(daemon: Daemon, tasks: list[dict[str, Any]], console: Console) -> list[dict[str, Any]]:
    async with daemon.client(timeout=120.0) as http:
        ids = []
        for task in tasks:
            r = await http.post("/v1/rollouts", json={
                "task": task, "n": 1, "timeout_s": 900,
                "limits": {"max_turns": 3, "max_tokens_per_turn": 512}})
            r.raise_for_status()
            ids.append(r.json()["ids"][0])
        results: dict[str, dict[str, Any]] = {}
        last = 0
        while len(results) < len(ids):
            for rid in ids:
                if rid in results:
                    continue
                tr = (await http.get(f"/v1/rollouts/{rid}")).json()
                if tr["status"] in ("completed", "failed", "timed_out", "cancelled", "lost"):
                    results[rid] = tr
            if len(results) - last >= 10 or len(results) == len(ids):
                console.print(f"  {len(results)}/{len(ids)} rollouts finished")
                last = len(results)
            await trio.sleep(1.0)
        return [results[rid] for rid in ids]


def official(tr: dict[str, Any], row: dict[str, Any]) -> bool | None:
    """The harness's verdict on the rollout's eval log (None: no log to grade)."""
    info = tr.get("reward_info") or {}
    log = info.get("eval_log")
    if log is None:
        return None
    spec = info["eval_spec"]
    import json
    f2p = json.loads(row["FAIL_TO_PASS"]) if isinstance(row["FAIL_TO_PASS"], str) else row["FAIL_TO_PASS"]
    p2p = json.loads(row["PASS_TO_PASS"]) if isinstance(row["PASS_TO_PASS"], str) else row["PASS_TO_PASS"]
    g = grade(log, parser=spec["log_parser"], f2p=f2p, p2p=p2p, eval_type=spec["eval_type"],
              instance_id=row["instance_id"], repo=row.get("repo", ""), version=row.get("version", ""),
              use_swebench=True)
    return g.resolved


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-slots", type=int, default=2, help="the daemon's INIT/RUN/EVAL workers each")
    p.add_argument("--limit", type=int, default=0, help="only the first N instances (0: all)")
    args = p.parse_args()
    console = Console()
    if swebench_version() is None:
        console.print("[red]the swebench package is needed for the official grading "
                      "(pip install 'rolloutd[swe]')[/red]")
        return 2
    t0 = time.monotonic()
    rows = await trio.to_thread.run_sync(BUILD.load_instances)
    if args.limit:
        rows = rows[:args.limit]
    console.print(f"SWE set: {len(rows)} instances, images ready in {time.monotonic() - t0:.0f} s")
    by_id = {r["instance_id"]: r for r in rows}
    tasks = [BUILD.with_patch(r, v) for r in rows for v in BUILD.VARIANTS]
    root = Path(tempfile.mkdtemp(prefix="rl-swe-"))
    ms = ModelServer(POLICY)
    daemon = Daemon(root / "state", log_level="warning", n_init=args.n_slots, n_run=args.n_slots,
                    n_eval=args.n_slots, swe_grader="builtin", image_cache_dir=str(root / "images"),
                    backends=[{"kind": "vllm", "url": ms.url, "id": "scripted"}])
    await ms.start()
    try:
        await daemon.start()
        try:
            t1 = time.monotonic()
            done = await run_all(daemon, tasks, console)
            wall = time.monotonic() - t1
        finally:
            await daemon.stop()
    finally:
        await ms.kill()

    per_project: dict[str, Counter[str]] = {}
    evals: list[float] = []
    agree = total = 0
    failures = []
    for tr in done:
        iid, variant = tr["task_id"].rsplit(":", 1)
        row = by_id[iid]
        c = per_project.setdefault(row["repo"], Counter())
        c["instances"] += variant == "gold"
        ok = tr["status"] == "completed"
        resolved = ok and tr["reward"] == 1.0
        c[f"{variant}_resolved"] += resolved
        if not ok:
            c["failed"] += 1
            failures.append(f"{tr['task_id']}: {tr['status']} {tr.get('error')}")
        elif resolved != (variant == "gold"):
            info = tr.get("reward_info") or {}
            shell = [m.get("content", "")[:300] for m in tr.get("messages", []) if m.get("role") == "tool"]
            failures.append(f"{tr['task_id']}: reward {tr['reward']} ({info.get('reason')}); "
                            f"agent's shell: {shell[:1]}")
        if variant != "empty" and ok:
            evals.append(tr["timing"]["eval_s"])
        verdict = official(tr, row) if ok else None
        total += 1
        if verdict is None:
            agree += (not resolved and variant == "empty" and ok)
        else:
            agree += verdict == resolved
            c["graded"] += 1
    table = Table(title=f"SWE set: gold / empty / wrong patches ({wall:.0f} s, {args.n_slots} slots per stage)")
    for col in ("project", "instances", "gold resolved", "empty resolved", "wrong resolved",
                "failed", "graded by harness"):
        table.add_column(col, justify="left" if col == "project" else "right")
    for repo, c in sorted(per_project.items()):
        table.add_row(repo.split("/")[-1], str(c["instances"]), str(c["gold_resolved"]), str(c["empty_resolved"]),
                      str(c["wrong_resolved"]), str(c["failed"]), str(c["graded"]))
    console.print(table)
    for line in failures:
        console.print(f"[red]{line}[/red]")
    n = len(rows)
    gold = sum(c["gold_resolved"] for c in per_project.values())
    empty = sum(c["empty_resolved"] for c in per_project.values())
    wrong = sum(c["wrong_resolved"] for c in per_project.values())
    p50 = statistics.median(evals) if evals else float("nan")
    console.print(f"official grading: swebench {swebench_version()}; eval stage p50 {p50:.2f} s "
                  f"over {len(evals)} gold and wrong rollouts")
    print(f"RESULT instances={n} projects={len(per_project)} gold_rate={gold / n:.3f} "
          f"empty_resolved={empty} wrong_resolved={wrong} "
          f"harness_agreement={agree / total:.3f} eval_p50_s={p50:.2f}")
    return 0 if gold == n and empty == 0 and wrong == 0 and agree == total else 1


if __name__ == "__main__":
    sys.exit(trio.run(main))
