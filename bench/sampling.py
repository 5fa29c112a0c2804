"""Dynamic-sampling benchmark: speed, selection bias and wasted work of three DAPO loops.

An in-process node runs the labelled sleep task through the real pipeline (no sandbox, no
model); RUN times are per sample and drawn from a lognormal (median MEDIAN_S, sigma SIGMA),
so a few samples are very slow. About 60% of the prompts give groups whose rewards are all
equal (half all 0, half all 1); the rest give mixed rewards, independently of their RUN
times. A trainer asks for batches of K kept groups in a row, each from its own slice of one
prompt list, and each loop sees the same list on the same daemon, in real time:

- lock-step (verl's DAPO loop): submit a generation batch of M groups, wait for all of them,
  filter, repeat until K groups are kept (kept groups beyond K are dropped, as verl does);
- async, cancel (daemon/sampling.py without a stream): keep M groups in flight, judge each
  group as it finishes, start the next prompt in its place, stop at K kept and cancel the
  groups still running;
- async, carry (the same batches in a ``stream``): the groups still running at K carry over
  to the next batch, which judges them first; the last batch has ``carry_over: false``.

Measured per loop, over the first BATCHES batches. Lock-step and cancel run one batch more.
The stream runs on after its measured batches while an eligible group they started is still
running (at most MAX_DRAIN batches more), then ends with one batch that carries nothing over.
So the figures are those of a stream in its steady state, as in a training run of many steps,
not of a stream that ends right after the measured batches: the end of a stream cuts the
groups still running then, once per run, whatever the run's length; the benchmark prints what
that cut would have cost here.

- time to K, summed over the measured batches (the trainer's wait);

- ``kept_vs_offered_len``: the mean length (the slowest sample's RUN time, known from the
  prompt) of the groups kept, over the mean length of the eligible groups offered (started,
  with mixed rewards: those the filter would keep). 1.0 means no selection by length;
- ``wasted_frac``: sample-seconds spent on groups never judged (cancelled, or kept beyond K by
  lock-step, or still running when the stream ended), over all sample-seconds spent, across
  all the loop's batches. Groups filtered for equal rewards are DAPO's own cost and not
  counted as waste (shown apart);
- for the carry loop, the eligible groups of the measured batches kept only after batch
  BATCHES + 1 (how many, how long), and the ``kept_vs_offered_len`` a stream ending with that
  batch would have had (those groups cut).

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

from rolloutd.daemon.batch import Batch, BatchRequest, Group, GroupFilter, GroupState, judge  # noqa: E402
from rolloutd.daemon.config import Settings  # noqa: E402
from rolloutd.daemon.node import Node  # noqa: E402
from rolloutd.daemon.pipeline import Services  # noqa: E402
from rolloutd.daemon.service import RolloutRequest  # noqa: E402

G = 8  # samples per group
K = 32  # groups to keep per batch
M = 64  # lock-step generation batch, and the async sampler's groups in flight
BATCHES = 5  # batches measured (one more runs after them; a stream's, up to MAX_DRAIN more)
MAX_DRAIN = 20  # a stream's batches after the measured ones, while their groups still run
PER_BATCH = 192  # prompts in each batch's slice (3 lock-step rounds)
ALL_EQUAL = 0.6
MEDIAN_S = 0.08
SIGMA = 1.0
TRIALS = 3
TARGET_BIAS = 0.95


def make_prompts(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range((BATCHES + 1 + MAX_DRAIN) * PER_BATCH):
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
    """One loop's run: BATCHES measured batches, then one more (for a stream, as many more as
    its measured groups need, see ``run_async``)."""

    wait_s: float = 0.0  # time to K, over the measured batches
    offered: list[float] = field(default_factory=list)  # lengths of eligible groups started
    kept: list[float] = field(default_factory=list)  # lengths of the kept ones among them
    kept_late: list[float] = field(default_factory=list)  # ... kept after batch BATCHES
    kept_lag: list[int] = field(default_factory=list)  # per kept group: batches it was carried
    cut: list[float] = field(default_factory=list)  # ... and of those the stream's end cancelled
    batches: int = 0  # batches run
    work_s: float = 0.0  # sample-seconds spent, all batches
    wasted_s: float = 0.0  # of which on groups never judged
    filtered_s: float = 0.0  # of which on groups filtered (equal rewards)
    tried: int = 0
    kept_groups: int = 0

    @property
    def bias(self) -> float:
        return statistics.fmean(self.kept) / statistics.fmean(self.offered)

    @property
    def bias_one_extra(self) -> float:
        """The bias had the stream ended with batch BATCHES (the groups kept later cut)."""
        on_time = list(self.kept)
        for x in self.kept_late:
            on_time.remove(x)
        return statistics.fmean(on_time) / statistics.fmean(self.offered)

    def bias_staleness(self, max_staleness: int) -> tuple[int, float]:
        """Groups a weight sync after every batch and ``max_staleness`` would filter as stale
        (carried through more than that many batches), and the bias without them."""
        fresh = [x for x, lag in zip(self.kept, self.kept_lag, strict=True) if lag <= max_staleness]
        return len(self.kept) - len(fresh), statistics.fmean(fresh) / statistics.fmean(self.offered)

    @property
    def wasted_frac(self) -> float:
        return self.wasted_s / self.work_s


def account(out: Outcome, groups: list[tuple[int, int, Group, str]], measured: set[int]) -> None:
    """Fold the fate of every started group in: (batch number it started in, batch number
    that judged or dropped it, group, fate) with fate one of kept / filtered / wasted / cut
    (cut: still running when the stream's last batch ended)."""
    for started_in, ended_in, group, fate in groups:
        work = group.work_s()
        out.work_s += work
        if fate in ("wasted", "cut"):
            out.wasted_s += work
        elif fate == "filtered":
            out.filtered_s += work
        out.tried += started_in in measured
        task = group.task
        assert task is not None
        if started_in in measured and eligible(task):
            out.offered.append(length(task))
            if fate == "kept":
                out.kept.append(length(task))
                out.kept_lag.append(ended_in - started_in)
                out.kept_groups += 1
                if ended_in > BATCHES:
                    out.kept_late.append(length(task))
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
                fates.append((b, b, group, fate))
            tried += len(chunk)
        if b < BATCHES:
            out.wait_s += time.perf_counter() - start
    account(out, fates, set(range(BATCHES)))
    out.batches = BATCHES + 1
    return out


def origin_of(group: Group, b: int, number: dict[str, int]) -> int:
    """The batch number a group started in (a carried group's record names it)."""
    return number[group.carried_from] if group.carried_from else b


def measured_pending(batch: Batch, b: int, number: dict[str, int], prompts: list[dict[str, Any]]) -> int:
    """Eligible groups started in the measured batches that batch ``b`` hands on unjudged."""
    pending = 0
    for group in batch.every_group():
        if group.state in (GroupState.running, GroupState.carried):
            origin = origin_of(group, b, number)
            pending += origin < BATCHES and eligible(prompts[origin * PER_BATCH + group.index])
    return pending


async def run_async(node: Node, prompts: list[dict[str, Any]], *, stream: str | None) -> Outcome:
    out = Outcome()
    batches: list[Batch] = []
    number: dict[str, int] = {}
    b, last = 0, False
    while not last:
        # Without a stream: BATCHES + 1 batches. With one, the stream goes on past the
        # measured batches while any of their eligible groups is still running (at most
        # MAX_DRAIN batches), then ends with one batch that carries nothing over.
        last = b >= BATCHES and (stream is None or b == BATCHES + MAX_DRAIN
                                 or not measured_pending(batches[-1], b - 1, number, prompts))
        start = time.perf_counter()
        batch = node.sampler.create(BatchRequest(
            prompts=prompts[b * PER_BATCH : (b + 1) * PER_BATCH], group_size=G, keep=K,
            max_in_flight_groups=M, stream=stream, carry_over=not last,
        ))
        number[batch.id] = b
        kept = 0
        async with aclosing(node.sampler.groups(batch)) as groups:
            async for _ in groups:
                kept += 1
        assert kept == K, batch.status()
        if b < BATCHES:
            out.wait_s += time.perf_counter() - start
        batches.append(batch)
        b += 1
    for batch in batches:
        await batch.done.wait()  # leftovers unwound (not timed: the trainer has its K)
    await node.pipeline.wait_idle()
    # Where each group started (a carried group's record in a later batch says which batch),
    # and how it ended; the tasks come from the prompt list (batches release theirs).
    fates = []
    for b, batch in enumerate(batches):
        for group in batch.every_group():
            if group.state is GroupState.carried:
                continue  # judged (or cancelled) by the batch that adopted it
            origin = origin_of(group, b, number)
            fate = {GroupState.kept: "kept", GroupState.filtered: "filtered"}.get(group.state, "wasted")
            if fate == "wasted" and stream is not None and b == len(batches) - 1:
                fate = "cut"  # the stream ends with this batch: nobody would judge it
            group.task = prompts[origin * PER_BATCH + group.index]
            fates.append((origin, b, group, fate))
    account(out, fates, set(range(BATCHES)))
    out.batches = len(batches)
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

                async def run(name: str, prompts: list[dict[str, Any]] = prompts,
                              trial: int = trial) -> Outcome:
                    if name == "lock-step":
                        return await run_lockstep(node, prompts)
                    stream = f"trial-{trial}" if name == "async, carry" else None
                    return await run_async(node, prompts, stream=stream)

                order = loops[trial % 3:] + loops[: trial % 3]  # which runs first rotates
                outcomes = {name: await run(name) for name in order}
                first = prompts[: (BATCHES + 1) * PER_BATCH]
                rows.append((trial, sorted(s for p in first for s in p["run_s"]), outcomes))
            nursery.cancel_scope.cancel()

    table = Table(title=f"dynamic sampling: {BATCHES} batches of K={K} kept groups in a row (G={G}, "
                        f"M={M} groups in flight / per generation batch, {ALL_EQUAL:.0%} all-equal)")
    for col in ("trial", "sample p50/p99/max s", "loop", "time to K s", "kept len s",
                "offered len s", "kept/offered", "wasted", "filtered", "tried", "batches"):
        table.add_column(col, justify="right")
    for trial, durations, outcomes in rows:
        p50 = statistics.median(durations)
        p99 = durations[int(0.99 * (len(durations) - 1))]
        for name in loops:
            o = outcomes[name]
            table.add_row(str(trial), f"{p50:.2f}/{p99:.2f}/{durations[-1]:.2f}", name,
                          f"{o.wait_s:.2f}", f"{statistics.fmean(o.kept):.3f}",
                          f"{statistics.fmean(o.offered):.3f}", f"{o.bias:.3f}",
                          f"{o.wasted_frac:.1%}", f"{o.filtered_s / o.work_s:.1%}", str(o.tried),
                          str(o.batches))
    Console(width=170).print(table)

    def total(name: str) -> Outcome:
        out = Outcome()
        for _, _, outcomes in rows:
            o = outcomes[name]
            out.wait_s += o.wait_s
            out.offered += o.offered
            out.kept += o.kept
            out.kept_late += o.kept_late
            out.kept_lag += o.kept_lag
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
    late = carry.kept_late
    print(f"async, carry: {len(late)} of {len(carry.offered)} eligible groups of the measured "
          f"batches were kept after batch {BATCHES + 1} (the stream ran on while they did: "
          f"batches per trial {[x['async, carry'].batches for _, _, x in rows]}), "
          f"mean length {statistics.fmean(late) if late else 0:.2f} s against "
          f"{statistics.fmean(carry.offered):.2f} s offered. Had the stream ended with batch "
          f"{BATCHES + 1}, they would have been cut: kept/offered length "
          f"{carry.bias_one_extra:.3f}")
    print(f"async, carry: {len(carry.cut)} of them were still running when the stream ended; "
          f"{len(carry.offered) - len(carry.kept) - len(carry.cut)} others were not kept")
    for n in (1, 2):
        stale, bias = carry.bias_staleness(n)
        print(f"async, carry: with a weight sync after every batch and max_staleness {n}, "
              f"{stale} of the kept groups would have been filtered as stale: kept/offered "
              f"length {bias:.3f}")
    speedup = lock.wait_s / carry.wait_s
    print(f"target kept_vs_offered_len >= {TARGET_BIAS}: "
          f"{'met' if carry.bias >= TARGET_BIAS else 'MISSED'} ({carry.bias:.3f}); "
          f"speedup of the carry loop over lock-step {speedup:.2f}x")
    print(f"RESULT kept_vs_offered_len={carry.bias:.3f} wasted_frac={carry.wasted_frac:.3f} "
          f"speedup_vs_lockstep={speedup:.3f} kept_groups={carry.kept_groups} tried_groups={carry.tried}")


if __name__ == "__main__":
    trio.run(main)
