"""Dynamic-sampling benchmark: speed, selection bias and wasted work of three DAPO loops.

An in-process node runs the labelled sleep task through the real pipeline (no sandbox, no
model); RUN times are per sample and drawn from a lognormal (median MEDIAN_S, sigma SIGMA),
so a few samples are very slow. About 60% of the prompts give groups whose rewards are all
equal (half all 0, half all 1); the rest give mixed rewards, independently of their RUN
times. A trainer asks for BATCHES + 1 batches of K kept groups in a row, each from its own
slice of one prompt list, and each loop sees the same list on the same daemon, in real time:

- lock-step (verl's DAPO loop): submit a generation batch of M groups, wait for all of them,
  filter, repeat until K groups are kept (kept groups beyond K are dropped, as verl does);
- async, cancel (daemon/sampling.py without a stream): keep M groups in flight, judge each
  group as it finishes, start the next prompt in its place, stop at K kept and cancel the
  groups still running;
- async, carry (the same batches in a ``stream``): the groups still running at K carry over
  to the next batch, which judges them first; the last batch has ``carry_over: false``.

Measured per loop, over the first BATCHES batches (the extra batch is there so that the groups
the last measured batch carries over get their chance):

- time to K, summed over the batches (the trainer's wait);
- ``kept_vs_offered_len``: the mean length (the slowest sample's RUN time, known from the
  prompt) of the groups kept, over the mean length of the eligible groups offered (started,
  with mixed rewards: those the filter would keep). 1.0 means no selection by length;
- ``wasted_frac``: sample-seconds spent on groups never judged (cancelled, or kept beyond K by
  lock-step), over all sample-seconds spent, across all BATCHES + 1 batches. Groups filtered
  for equal rewards are DAPO's own cost and not counted as waste (shown apart);
- for the carry loop, the eligible groups of the measured batches still running when the
  stream ended (cancelled by the extra batch): how many, and how long.

Ends with: RESULT kept_vs_offered_len=F wasted_frac=F speedup_vs_lockstep=F kept_groups=N tried_groups=N
(of the carry loop, the default for trainers: ``speedup`` = lock-step time / carry time;
kept and tried groups summed over the trials).
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rolloutd.daemon.batch import BatchRequest, Group, GroupFilter, GroupState, judge  # noqa: E402
from rolloutd.daemon.config import Settings  # noqa: E402
from rolloutd.daemon.node import Node  # noqa: E402
from rolloutd.daemon.pipeline import Services  # noqa: E402
from rolloutd.daemon.service import RolloutRequest  # noqa: E402

G = 8  # samples per group
K = 32  # groups to keep per batch
M = 64  # lock-step generation batch, and the async sampler's groups in flight
BATCHES = 5  # batches measured (one more runs after them)
PER_BATCH = 192  # prompts in each batch's slice (3 lock-step rounds)
ALL_EQUAL = 0.6
MEDIAN_S = 0.08
SIGMA = 1.0
TRIALS = 3
TARGET_BIAS = 0.95


def make_prompts(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range((BATCHES + 1) * PER_BATCH):
        if rng.random() < ALL_EQUAL:
            rewards = [float(rng.random() < 0.5)] * G
        else:
            rewards = [float(rng.random() < 0.5) for _ in range(G)]
            if len(set(rewards)) == 1:
                rewards[rng.randrange(G)] = 1.0 - rewards[0]
        run_s = [round(rng.lognormvariate(0, SIGMA) * MEDIAN_S, 4) for _ in range(G)]
        prompts.append({"kind": "sleep", "rewards": rewards, "run_s": run_s})
    return prompts


def length(task: dict[str, Any]) -> float:
    return max(task["run_s"])


def eligible(task: dict[str, Any]) -> bool:
    return len(set(task["rewards"])) > 1


@dataclass
class Outcome:
    """One loop's run of BATCHES + 1 batches."""

    wait_s: float = 0.0  # time to K, over the measured batches
    offered: list[float] = field(default_factory=list)  # lengths of eligible groups started
    kept: list[float] = field(default_factory=list)  # lengths of the kept ones among them
    cut: list[float] = field(default_factory=list)  # ... and of those the stream's end cancelled
    work_s: float = 0.0  # sample-seconds spent, all batches
    wasted_s: float = 0.0  # of which on groups never judged
    filtered_s: float = 0.0  # of which on groups filtered (equal rewards)
    tried: int = 0
    kept_groups: int = 0

    @property
    def bias(self) -> float:
        return statistics.fmean(self.kept) / statistics.fmean(self.offered)

    @property
    def wasted_frac(self) -> float:
        return self.wasted_s / self.work_s


def account(out: Outcome, groups: list[tuple[int, Group, str]], measured: set[int]) -> None:
    """Fold the fate of every started group in: (batch number it started in, group, fate)
    with fate one of kept / filtered / wasted / cut (wasted: still running when the stream's
    last batch ended)."""
    for started_in, group, fate in groups:
        work = group.work_s()
        out.work_s += work
        out.tried += started_in in measured
        if fate in ("wasted", "cut"):
            out.wasted_s += work
        elif fate == "filtered":
            out.filtered_s += work
        task = group.task
        assert task is not None
        if started_in in measured and eligible(task):
            out.offered.append(length(task))
            if fate == "kept":
                out.kept.append(length(task))
                out.kept_groups += 1
            elif fate == "cut":
                out.cut.append(length(task))


async def run_lockstep(node: Node, prompts: list[dict[str, Any]]) -> Outcome:
    out, fates, flt = Outcome(), [], GroupFilter()
    for b in range(BATCHES + 1):
        chunk_start, kept, tried = b * PER_BATCH, 0, 0
        start = time.perf_counter()
        while kept < K:
            chunk = prompts[chunk_start + tried : chunk_start + tried + M]
            assert chunk, "lock-step ran out of prompts"
            subs = [node.submit(RolloutRequest(task=p, n=G)) for p in chunk]
            await node.service.wait([j for s in subs for j in s.jobs])
            for i, (p, s) in enumerate(zip(chunk, subs, strict=True)):
                group = Group(index=tried + i, group_id=s.group_id, task=p, jobs=s.jobs)
                ok = judge(group, flt)[0]
                fate = "filtered" if not ok else "kept" if kept < K else "wasted"
                kept += fate == "kept"
                fates.append((b, group, fate))
            tried += len(chunk)
        if b < BATCHES:
            out.wait_s += time.perf_counter() - start
    account(out, fates, set(range(BATCHES)))
    return out


async def run_async(node: Node, prompts: list[dict[str, Any]], *, stream: str | None) -> Outcome:
    out, batches = Outcome(), []
    for b in range(BATCHES + 1):
        start = time.perf_counter()
        batch = node.sampler.create(BatchRequest(
            prompts=prompts[b * PER_BATCH : (b + 1) * PER_BATCH], group_size=G, keep=K,
            max_in_flight_groups=M, stream=stream, carry_over=b < BATCHES,
        ))
        kept = 0
        async with aclosing(node.sampler.groups(batch)) as groups:
            async for _ in groups:
                kept += 1
        assert kept == K, batch.status()
        if b < BATCHES:
            out.wait_s += time.perf_counter() - start
        batches.append(batch)
    for batch in batches:
        await batch.done.wait()  # leftovers unwound (not timed: the trainer has its K)
    await node.pipeline.wait_idle()
    # Where each group started (a carried group's record in a later batch says which batch),
    # and how it ended; the tasks come from the prompt list (batches release theirs).
    number = {batch.id: b for b, batch in enumerate(batches)}
    fates = []
    for b, batch in enumerate(batches):
        for group in batch.every_group():
            if group.state is GroupState.carried:
                continue  # judged (or cancelled) by the batch that adopted it
            origin = number[group.carried_from] if group.carried_from else b
            fate = {GroupState.kept: "kept", GroupState.filtered: "filtered"}.get(group.state, "wasted")
            if fate == "wasted" and stream is not None and b == BATCHES:
                fate = "cut"  # the stream ends with this batch: nobody would judge it
            group.task = prompts[origin * PER_BATCH + group.index]
            fates.append((origin, group, fate))
    account(out, fates, set(range(BATCHES)))
    return out


async def main() -> None:
    rows: list[tuple[int, list[float], dict[str, Outcome]]] = []
    loops = ("lock-step", "async, cancel", "async, carry")
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(state_dir=Path(tmp), n_init=64, n_run=2 * M * G, n_eval=64,
                            queue_size=4 * M * G, log_level="warning")
        node = Node(settings, services=Services())
        async with trio.open_nursery() as nursery:
            await nursery.start(node.pipeline.run)
            await nursery.start(node.sampler.run)
            for trial in range(TRIALS):
                prompts = make_prompts(trial)
                runs = {
                    "lock-step": lambda p: run_lockstep(node, p),
                    "async, cancel": lambda p: run_async(node, p, stream=None),
                    "async, carry": lambda p, t=trial: run_async(node, p, stream=f"trial-{t}"),
                }
                order = loops[trial % 3:] + loops[: trial % 3]  # which runs first rotates
                outcomes = {name: await runs[name](prompts) for name in order}
                rows.append((trial, sorted(s for p in prompts for s in p["run_s"]), outcomes))
            nursery.cancel_scope.cancel()

    table = Table(title=f"dynamic sampling: {BATCHES} batches of K={K} kept groups in a row (G={G}, "
                        f"M={M} groups in flight / per generation batch, {ALL_EQUAL:.0%} all-equal)")
    for col in ("trial", "sample p50/p99/max s", "loop", "time to K s", "kept len s",
                "offered len s", "kept/offered", "wasted", "filtered", "tried"):
        table.add_column(col, justify="right")
    for trial, durations, outcomes in rows:
        p50 = statistics.median(durations)
        p99 = durations[int(0.99 * (len(durations) - 1))]
        for name in loops:
            o = outcomes[name]
            table.add_row(str(trial), f"{p50:.2f}/{p99:.2f}/{durations[-1]:.2f}", name,
                          f"{o.wait_s:.2f}", f"{statistics.fmean(o.kept):.3f}",
                          f"{statistics.fmean(o.offered):.3f}", f"{o.bias:.3f}",
                          f"{o.wasted_frac:.1%}", f"{o.filtered_s / o.work_s:.1%}", str(o.tried))
    Console(width=170).print(table)

    def total(name: str) -> Outcome:
        out = Outcome()
        for _, _, outcomes in rows:
            o = outcomes[name]
            out.wait_s += o.wait_s
            out.offered += o.offered
            out.kept += o.kept
            out.cut += o.cut
            out.work_s += o.work_s
            out.wasted_s += o.wasted_s
            out.tried += o.tried
            out.kept_groups += o.kept_groups
        return out

    totals = {name: total(name) for name in loops}
    for name, o in totals.items():
        print(f"{name:>14}: time to K {o.wait_s:7.2f} s   kept/offered length {o.bias:.3f}   "
              f"wasted {o.wasted_frac:.1%} of {o.work_s:.0f} sample-s")
    carry, lock = totals["async, carry"], totals["lock-step"]
    if carry.cut:
        print(f"async, carry: {len(carry.cut)} of {len(carry.offered)} eligible groups of the "
              f"measured batches were still running when the stream ended (the extra batch, "
              f"carry_over false): mean length {statistics.fmean(carry.cut):.2f} s, against "
              f"{statistics.fmean(carry.offered):.2f} s offered; "
              f"{len(carry.offered) - len(carry.kept) - len(carry.cut)} others were not kept")
    speedup = lock.wait_s / carry.wait_s
    print(f"target kept_vs_offered_len >= {TARGET_BIAS}: "
          f"{'met' if carry.bias >= TARGET_BIAS else 'MISSED'} ({carry.bias:.3f}); "
          f"speedup of the carry loop over lock-step {speedup:.2f}x")
    print(f"RESULT kept_vs_offered_len={carry.bias:.3f} wasted_frac={carry.wasted_frac:.3f} "
          f"speedup_vs_lockstep={speedup:.3f} kept_groups={carry.kept_groups} tried_groups={carry.tried}")


if __name__ == "__main__":
    trio.run(main)
