"""Dynamic-sampling benchmark: time to K kept groups, asynchronous replenishment vs lock-step.

An in-process node runs the labelled sleep task through the real pipeline (no sandbox, no
model); RUN times are per sample and drawn from a lognormal (median MEDIAN_S, sigma SIGMA),
so a few samples are very slow. About 60% of the prompts give groups whose rewards are all
equal (half all 0, half all 1); the rest give mixed rewards. Both methods see the same prompt
list, in the same order, on the same daemon, in real time:

- lock-step (verl's DAPO loop): submit a generation batch of M groups, wait for all of them,
  filter, repeat until K groups are kept;
- async (daemon/sampling.py): keep M groups in flight, judge each group as it finishes,
  start the next prompt in its place, stop at K kept and cancel the leftovers.

Each trial uses a fresh prompt list (new seed); the two methods alternate which runs first.
The table also shows the sampler with only K groups in flight (its default): fewer groups
tried and cancelled, a little slower.
Ends with: RESULT speedup_vs_lockstep=F kept_groups=N tried_groups=N
(speedup = total lock-step time / total async time; kept and tried groups of the async
sampler, summed over the trials).
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rolloutd.daemon.batch import BatchRequest, Group, GroupFilter, judge  # noqa: E402
from rolloutd.daemon.config import Settings  # noqa: E402
from rolloutd.daemon.node import Node  # noqa: E402
from rolloutd.daemon.pipeline import Services  # noqa: E402
from rolloutd.daemon.service import RolloutRequest  # noqa: E402

G = 8  # samples per group
K = 32  # groups to keep
M = 64  # lock-step generation batch, and the async sampler's groups in flight
PROMPTS = 640
ALL_EQUAL = 0.6
MEDIAN_S = 0.08
SIGMA = 1.0
TRIALS = 3


def make_prompts(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(PROMPTS):
        if rng.random() < ALL_EQUAL:
            rewards = [float(rng.random() < 0.5)] * G
        else:
            rewards = [float(rng.random() < 0.5) for _ in range(G)]
            if len(set(rewards)) == 1:
                rewards[rng.randrange(G)] = 1.0 - rewards[0]
        run_s = [round(rng.lognormvariate(0, SIGMA) * MEDIAN_S, 4) for _ in range(G)]
        prompts.append({"kind": "sleep", "rewards": rewards, "run_s": run_s})
    return prompts


async def run_async(
    node: Node, prompts: list[dict[str, Any]], in_flight: int = M
) -> tuple[float, int, int, int]:
    start = time.perf_counter()
    batch = node.sampler.create(
        BatchRequest(prompts=prompts, group_size=G, keep=K, max_in_flight_groups=in_flight)
    )
    kept = 0
    async with aclosing(node.sampler.groups(batch)) as groups:
        async for _ in groups:
            kept += 1
            if kept == K:
                break
    elapsed = time.perf_counter() - start
    await batch.done.wait()  # leftovers cancelled (not timed: the trainer already has its K)
    await node.pipeline.wait_idle()
    st = batch.status()
    return elapsed, st["kept"], st["tried"], st["cancelled"]


async def run_lockstep(node: Node, prompts: list[dict[str, Any]]) -> tuple[float, int, int, int]:
    start = time.perf_counter()
    kept = tried = rounds = 0
    flt = GroupFilter()
    while kept < K:
        chunk = prompts[tried : tried + M]
        subs = [node.submit(RolloutRequest(task=p, n=G)) for p in chunk]
        jobs = [j for s in subs for j in s.jobs]
        await node.service.wait(jobs)
        for i, (p, s) in enumerate(zip(chunk, subs, strict=True)):
            group = Group(index=tried + i, group_id=s.group_id, task=p, jobs=s.jobs)
            if judge(group, flt)[0] and kept < K:
                kept += 1
        tried += len(chunk)
        rounds += 1
    return time.perf_counter() - start, kept, tried, rounds


async def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(state_dir=Path(tmp), n_init=64, n_run=M * G, n_eval=64,
                            queue_size=4 * M * G, log_level="warning")
        node = Node(settings, services=Services())
        async with trio.open_nursery() as nursery:
            await nursery.start(node.pipeline.run)
            await nursery.start(node.sampler.run)
            await run_lockstep(node, make_prompts(-1)[: M * 2])  # warm-up
            for trial in range(TRIALS):
                prompts = make_prompts(trial)
                if trial % 2 == 0:
                    a = await run_async(node, prompts)
                    lock = await run_lockstep(node, prompts)
                else:
                    lock = await run_lockstep(node, prompts)
                    a = await run_async(node, prompts)
                small = await run_async(node, prompts, in_flight=K)
                durations = sorted(s for p in prompts for s in p["run_s"])
                rows.append((trial, a, lock, small, durations))
            nursery.cancel_scope.cancel()

    table = Table(title=f"dynamic sampling: time to K={K} kept groups (G={G}, M={M} groups in flight "
                        f"/ per generation batch, {ALL_EQUAL:.0%} all-equal prompts)")
    for col in ("trial", "sample p50/p99/max s", "lock-step s", "rounds", "tried",
                f"async (M={M}) s", "tried", "cancelled", "speedup", f"async (M={K}) s", "tried"):
        table.add_column(col, justify="right")
    for trial, (a_s, _, a_tried, a_cancelled), (l_s, _, l_tried, rounds), small, durations in rows:
        p50 = statistics.median(durations)
        p99 = durations[int(0.99 * (len(durations) - 1))]
        table.add_row(str(trial), f"{p50:.2f}/{p99:.2f}/{durations[-1]:.2f}", f"{l_s:.3f}",
                      str(rounds), str(l_tried), f"{a_s:.3f}", str(a_tried), str(a_cancelled),
                      f"{l_s / a_s:.2f}x", f"{small[0]:.3f}", str(small[2]))
    Console(width=160).print(table)
    lock_total = sum(r[2][0] for r in rows)
    async_total = sum(r[1][0] for r in rows)
    kept = sum(r[1][1] for r in rows)
    tried = sum(r[1][2] for r in rows)
    speedup = lock_total / async_total
    print(f"total: lock-step {lock_total:.3f} s, async {async_total:.3f} s; target speedup >= 1.5: "
          f"{'met' if speedup >= 1.5 else 'MISSED'}")
    print(f"RESULT speedup_vs_lockstep={speedup:.3f} kept_groups={kept} tried_groups={tried}")


if __name__ == "__main__":
    trio.run(main)
