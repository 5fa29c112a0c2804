"""Groups and DAPO dynamic sampling: keep K informative groups out of a prompt list.

A batch asks for ``keep`` (K) groups of ``group_size`` (G) samples each. The sampler keeps
up to ``max_in_flight_groups`` groups running, judges each group the moment its G samples
are terminal, streams kept groups at once, and starts a group from the next prompt in its
place, so the pipeline never drains in lock-step. It stops when K groups are kept, or when
nothing is in flight and no further group may start (prompts used up, ``max_gen_groups``
groups tried, or the daemon draining).

Groups still running when a batch has its K (the leftovers) are the slow ones: cancelling them
would keep only groups that finish fast, a bias toward short trajectories. A batch in a
``stream`` therefore passes them on (``carry_over``): they keep running, wait in the stream's
``Carry``, and its next batch adopts them before it starts groups of its own prompts, judging
them (with ``max_staleness``) like its own. Nothing is thrown away unexplained: every group
started ends kept, filtered or cancelled, each with a reason. Without a stream (or with
``carry_over: false``, or if no next batch comes within ``carry_ttl_s``) leftovers are
cancelled, which releases their sandboxes and aborts their LLM requests.

    Sampler.run                  owns a nursery; one task per batch
    ├─ batch task                submit -> wait for any group -> judge -> replenish
    └─ carry expiry              one per stream's carry: cancel it if no batch adopts it

Groups go through ``RolloutService.submit`` like any rollout (intake, back-pressure,
result store); the G samples share a ``group_id``, so the LLM pool routes them to one
backend (prefix reuse). A group with any unusable sample (failed, cancelled, not usable
timed out) is filtered with reason ``infrastructure``; it is not resubmitted and never
counted as reward 0. With ``max_staleness`` set, a group with a sample whose turns began more
than that many policy versions ago is filtered with reason ``stale``.

Finished batches stay readable for ``result_ttl_s``, so what one keeps must not grow with the
size of its tasks: when a batch ends it lets go of its request (every prompt) and of the
tasks of its groups, keeping its progress and its kept groups' trajectories (results, like
the result store's). A kept group's task stays while a stream of the batch's groups that was
open when it ended still runs, so a live reader gets every line whole.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

import trio

from rolloutd.daemon.batch import Batch, BatchRequest, BatchState, Group, GroupState, judge
from rolloutd.daemon.errors import (
    Draining,
    InvalidTask,
    NotFound,
    QueueFullError,
    StreamBusy,
    TooManyBatches,
)
from rolloutd.daemon.jobs import new_id
from rolloutd.daemon.service import RolloutRequest, RolloutService, Submitted
from rolloutd.daemon.tasks.base import TaskError

log = logging.getLogger(__name__)

#: When the intake is full, how often a batch retries starting a group (if none finishes).
QUEUE_FULL_RETRY_S = 0.2
#: How long a finished batch waits for its cancelled leftovers to unwind.
LEFTOVER_WAIT_S = 30.0


# ---- the sampler -----------------------------------------------------------------------


class Carry:
    """A stream's groups between two of its batches: still running (or finished, unjudged)."""

    def __init__(self, batch: Batch, originals: list[Group], ttl_s: float) -> None:
        self.from_batch = batch
        self.originals = originals  # the records in ``batch`` (state carried)
        self.groups = [g.successor(batch.id) for g in originals]  # the next batch's records
        self.deadline = trio.current_time() + ttl_s
        self.scope = trio.CancelScope(deadline=self.deadline)
        for group in self.groups:
            group.progress.route = None  # a group finishing now waits for the next batch



class Submit(Protocol):
    """How the sampler submits a group (``RolloutService.submit``, or the node's wrapper)."""

    def __call__(self, req: RolloutRequest, *, batch_id: str | None = None) -> Submitted: ...


class Sampler:
    """Owns every dynamic-sampling batch. Start with ``await nursery.start(sampler.run)``."""

    MAX_LIVE_BATCHES = 256
    MAX_BATCHES = 1024

    def __init__(
        self,
        service: RolloutService,
        *,
        submit: Submit | None = None,
        ttl_s: float | None = None,
        prefetch: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> None:
        self.service = service
        self._submit = submit or service.submit
        self._prefetch = prefetch  # warms what a coming group needs (its image)
        self.ttl_s = ttl_s if ttl_s is not None else service.settings.result_ttl_s
        self._batches: dict[str, Batch] = {}
        self._streams: dict[str, Batch] = {}  # each stream's latest batch
        self._carries: dict[str, Carry] = {}  # each stream's groups waiting for its next batch
        self._send, self._recv = trio.open_memory_channel[Batch | Carry](self.MAX_LIVE_BATCHES)
        self._running = False

    # ---- lifetime --------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run batches as they are created, until cancelled (which cancels every batch)."""
        try:
            async with trio.open_nursery() as nursery, self._recv:
                self._running = True
                task_status.started()
                async for item in self._recv:
                    if isinstance(item, Carry):
                        nursery.start_soon(self._expire_carry, item,
                                           name=f"carry-{item.from_batch.id}")
                    else:
                        nursery.start_soon(self._run_batch, item, name=f"batch-{item.id}")
        finally:
            self._running = False
            for carry in self._carries.values():  # the daemon stops: nobody will adopt them
                self._drop_carry(carry, "the daemon stopped")
            self._carries.clear()

    # ---- operations the API calls ------------------------------------------------------

    def create(self, req: BatchRequest) -> Batch:
        """Validate a batch request and queue it for the sampler's nursery."""
        if self.service.draining:
            raise Draining("the daemon is draining and takes no new batches", retry_after_s=5)
        if not self._running:
            raise Draining("the sampler is not running", retry_after_s=5)
        settings = self.service.settings
        self.service.check_group_size("group_size", req.group_size)
        timeout_s = req.timeout_s or settings.default_timeout_s
        if timeout_s > settings.max_timeout_s:
            raise InvalidTask(f"timeout_s={timeout_s:g} exceeds max_timeout_s={settings.max_timeout_s:g}")
        for i, task in enumerate(req.prompts):
            try:
                self.service.registry.validate(task)
            except TaskError as exc:
                raise InvalidTask(f"prompts[{i}]: {exc}") from None
        self._expire()
        if self.live >= self.MAX_LIVE_BATCHES:
            raise TooManyBatches(f"{self.live} batches are running; retry later", retry_after_s=5)
        if req.stream is not None:
            last = self._streams.get(req.stream)
            if last is not None and last.state is BatchState.running:
                raise StreamBusy(f"batch {last.id} of stream {req.stream!r} is still running; a "
                                 "stream runs one batch at a time", retry_after_s=1)
        max_gen = min(len(req.prompts), req.max_gen_groups or len(req.prompts))
        batch = Batch(
            id=new_id("b"),
            req=req,
            max_in_flight=min(req.max_in_flight_groups or req.keep, max_gen),
            max_gen_groups=max_gen,
        )
        self._send.send_nowait(batch)
        self._batches[batch.id] = batch
        if req.stream is not None:
            self._streams[req.stream] = batch
            carry = self._carries.pop(req.stream, None)
            if carry is not None:
                self._adopt(batch, carry)
        log.info("batch %s: %d prompts, G=%d, K=%d, in flight %d, bound %d, carried in %d",
                 batch.id, len(req.prompts), req.group_size, req.keep, batch.max_in_flight,
                 max_gen, len(batch.carried_in))
        return batch

    def get(self, batch_id: str) -> Batch:
        self._expire()
        batch = self._batches.get(batch_id)
        if batch is None:
            raise NotFound(f"no batch with id {batch_id!r}")
        return batch

    def cancel(self, batch_id: str, *, reason: str = "cancelled by request") -> Batch:
        """Stop a batch; its running groups are cancelled. Idempotent."""
        batch = self.get(batch_id)
        if batch.state is BatchState.running and batch.stop_reason is None:
            batch.stop_reason = reason
            batch.scope.cancel()
        return batch

    async def groups(self, batch: Batch, *, start: int = 0) -> AsyncGenerator[Group]:
        """Kept groups from index ``start`` on, as they are kept; ends when the batch ends.

        A reader of the batch: while it runs, kept groups keep their tasks (even once the
        batch has ended). The last reader to leave before the batch ends cancels it when the
        request says ``cancel_on_disconnect``; close the iterator deterministically (aclosing).
        """
        batch.readers += 1
        finished = False
        try:
            i = start
            while True:
                while i < len(batch.kept_groups):
                    yield batch.kept_groups[i]
                    i += 1
                if batch.done.is_set():
                    break
                await batch.wait_changed()
            finished = True
        finally:
            batch.readers -= 1
            if batch.readers == 0 and batch.done.is_set():
                batch.release()
            elif batch.readers == 0 and not finished and batch.cancel_on_disconnect:
                self.cancel(batch.id, reason="the client streaming its groups disconnected")

    @property
    def live(self) -> int:
        return sum(1 for b in self._batches.values() if not b.done.is_set())

    def statistics(self) -> dict[str, Any]:
        states: dict[str, int] = {}
        for b in self._batches.values():
            states[b.state.value] = states.get(b.state.value, 0) + 1
        return {"batches": states, "live": self.live}

    def _expire(self) -> None:
        now = trio.current_time()
        done = [b for b in self._batches.values() if b.ended_at is not None]
        excess = len(self._batches) - self.MAX_BATCHES
        for b in sorted(done, key=lambda b: b.ended_at or 0.0):
            if now - (b.ended_at or now) >= self.ttl_s or excess > 0:
                del self._batches[b.id]
                excess -= 1
                if b.stream is not None and self._streams.get(b.stream) is b:
                    del self._streams[b.stream]

    # ---- one batch -------------------------------------------------------------------

    async def _run_batch(self, batch: Batch) -> None:
        try:
            with batch.scope:
                await self._drive(batch)
        finally:
            if batch.state is BatchState.running:
                batch.state = BatchState.cancelled
                batch.stop_reason = batch.stop_reason or "the daemon stopped"
            why = "batch_full" if batch.state is BatchState.completed else "batch_ended"
            leftovers = [g for g in batch.every_group() if g.state is GroupState.running]
            for group in leftovers:
                batch.cancelled(group, why)
                batch.running -= 1
                for job in group.jobs:
                    self.service.pipeline.cancel(job)
            # Let the leftovers unwind (sandboxes released) before the batch reports done.
            with trio.move_on_after(LEFTOVER_WAIT_S, shield=True):
                for group in leftovers:
                    for job in group.jobs:
                        await job.done.wait()
            batch.wasted_s += sum(g.work_s() for g in leftovers)
            batch.ended_at = trio.current_time()
            batch.release()
            batch.done.set()
            batch._notify()
            log.info("batch %s %s (%s): tried %d, kept %d, cancelled %d", batch.id,
                     batch.state.value, batch.stop_reason, len(batch.groups),
                     len(batch.kept_groups), len(leftovers))

    async def _drive(self, batch: Batch) -> None:
        req = batch.request
        blocked: str | None = None  # why no further group may start
        await trio.lowlevel.checkpoint()  # a batch cancelled before it started submits nothing
        while True:
            while batch._finished and len(batch.kept_groups) < req.keep:
                self._judge(batch, batch._finished.popleft())
            if len(batch.kept_groups) >= req.keep:
                if req.stream is not None and req.carry_over:
                    self._carry_out(batch, req.stream, req.carry_ttl_s)
                batch.state, batch.stop_reason = BatchState.completed, "kept"
                return
            retry_s = math.inf
            while blocked is None and batch.running < batch.max_in_flight:
                if len(batch.groups) >= len(req.prompts):
                    blocked = "prompts_exhausted"
                elif len(batch.groups) >= batch.max_gen_groups:
                    blocked = "max_gen_groups"
                else:
                    try:
                        self._start_group(batch)
                    except QueueFullError:
                        retry_s = QUEUE_FULL_RETRY_S
                        break
                    except Draining:
                        blocked = "draining"
            if blocked is not None and batch.running == 0 and not batch._finished:
                batch.state, batch.stop_reason = BatchState.exhausted, blocked
                return
            if not batch._finished:
                with trio.move_on_after(retry_s):
                    await batch._wake.wait()
            batch._wake = trio.Event()

    def _start_group(self, batch: Batch) -> None:
        req = batch.request
        index = len(batch.groups)
        task = req.prompts[index]
        sub = self._submit(RolloutRequest(
            task=task,
            n=req.group_size,
            sampling=req.sampling,
            limits=req.limits,
            timeout_s=req.timeout_s,
            group_id=f"{batch.id}.{index}",
            priority=req.priority,
            labels=[*req.labels, f"batch:{batch.id}"],
        ), batch_id=batch.id)
        ahead = index + batch.max_in_flight  # the group that starts a window from now
        if self._prefetch is not None and ahead < batch.max_gen_groups:
            self._prefetch([req.prompts[ahead]])
        group = Group(index=index, group_id=sub.group_id, task=task, jobs=sub.jobs)
        group.progress.pending = len(sub.jobs)
        group.progress.route = lambda: batch._group_done(group)
        batch.groups.append(group)
        batch.running += 1
        for job in sub.jobs:
            job.add_listener(lambda job: group.progress.sample_done())
        batch._notify()

    # ---- streams: leftovers carried to the next batch -----------------------------------

    def _carry_out(self, batch: Batch, stream: str, ttl_s: float) -> None:
        """``batch`` is full: hand its unjudged groups (running, or finished and waiting to be
        judged) to the stream's next batch."""
        waiting = [g for g in batch.every_group() if g.state is GroupState.running]
        if not waiting:
            return
        for group in waiting:
            group.state = GroupState.carried
        batch.running = 0
        batch._finished.clear()
        carry = Carry(batch, waiting, ttl_s)
        self._carries[stream] = carry
        self._send.send_nowait(carry)
        log.info("batch %s: %d groups carried over to the next batch of stream %r", batch.id,
                 len(waiting), stream)

    def _adopt(self, batch: Batch, carry: Carry) -> None:
        """The stream's next batch takes its carried groups: they count as in flight and are
        judged first (a finished one at once)."""
        carry.scope.cancel()
        carry.from_batch.carried_to = batch.id
        for group in carry.groups:
            batch.carried_in.append(group)
            group.progress.route = lambda group=group: batch._group_done(group)
            batch.running += 1
            if group.finished:
                batch._group_done(group)

    async def _expire_carry(self, carry: Carry) -> None:
        """Cancel a carry that no batch of its stream adopts in time."""
        with carry.scope:
            await trio.sleep_forever()
        if carry.from_batch.carried_to is not None:
            return  # adopted
        stream = carry.from_batch.stream
        if stream is not None and self._carries.get(stream) is carry:
            del self._carries[stream]
            self._drop_carry(carry, "not_adopted")
            with trio.move_on_after(LEFTOVER_WAIT_S, shield=True):
                for group in carry.groups:
                    for job in group.jobs:
                        await job.done.wait()
            carry.from_batch.wasted_s += sum(g.work_s() for g in carry.groups)

    def _drop_carry(self, carry: Carry, reason: str) -> None:
        log.info("batch %s: %d carried groups cancelled (%s)", carry.from_batch.id,
                 len(carry.groups), reason)
        for group in carry.originals:
            carry.from_batch.cancelled(group, reason)
            for job in group.jobs:
                self.service.pipeline.cancel(job)

    def _judge(self, batch: Batch, group: Group) -> None:
        if group.state is not GroupState.running:
            return
        pool = self.service.pipeline.services.pool
        keep, reason, detail = judge(
            group, batch.request.filter, max_staleness=batch.request.max_staleness,
            current_version=pool.policy_version if pool is not None else 0,
        )
        batch.running -= 1
        batch.judged(group, keep)
        if keep:
            group.state = GroupState.kept
            batch.kept_groups.append(group)
        else:
            group.state, group.reason, group.detail = GroupState.filtered, reason, detail
            group.task = None  # only a kept group's line shows its task
            assert reason is not None
            batch.filtered_reasons[reason] = batch.filtered_reasons.get(reason, 0) + 1
        batch._notify()
