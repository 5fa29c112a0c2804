"""The INIT/RUN/EVAL pipeline on virtual time (autojump_clock), with the labelled sleep task."""

from __future__ import annotations

import gc
import shutil
import weakref

import pytest
import trio

from rolloutd.daemon.errors import QueueFullError
from rolloutd.daemon.service import RolloutRequest
from rolloutd.daemon.trajectory import Stage, Status

from .conftest import sleep_task


def req(**kw) -> RolloutRequest:
    body = {k: kw.pop(k) for k in ("n", "timeout_s", "priority", "idempotency_key", "group_id") if k in kw}
    return RolloutRequest(task=sleep_task(**kw), **body)


async def test_stages_overlap_across_jobs(start_node, autojump_clock):
    node = await start_node(n_init=1, n_run=1, n_eval=1)
    start = trio.current_time()
    sub = node.submit(req(n=3, init_s=1, run_s=2, eval_s=3))
    await node.service.wait(sub.jobs)
    # Bottleneck EVAL: 3 jobs x 3 s, after the first job's 1 + 2 s of INIT and RUN.
    assert trio.current_time() - start == pytest.approx(12.0)
    assert [j.status for j in sub.jobs] == [Status.completed] * 3
    assert all(j.trajectory.reward == 1.0 and j.trajectory.usable for j in sub.jobs)


async def test_deadline_excludes_queue_wait(start_node, autojump_clock):
    node = await start_node(n_init=1, n_run=1, n_eval=1)
    first = node.submit(req(run_s=5, timeout_s=100)).jobs[0]
    waits = node.submit(req(run_s=5, timeout_s=6)).jobs[0]
    await node.service.wait([first, waits])
    assert waits.status is Status.completed
    t = waits.trajectory.timing
    assert t.run_s == pytest.approx(5.0)
    assert t.queue_s == pytest.approx(5.0)  # waited for `first` to leave RUN


async def test_deadline_expires_in_run(start_node, autojump_clock):
    node = await start_node()
    job = node.submit(req(init_s=1, run_s=10, timeout_s=4)).jobs[0]
    await job.done.wait()
    traj = job.trajectory
    assert traj.status is Status.timed_out
    assert traj.error is not None and traj.error.stage == "run" and traj.error.type == "timeout"
    assert traj.timing.run_s == pytest.approx(3.0)
    assert traj.reward == 0.0
    assert traj.usable is False  # no turn was recorded, so nothing to train on


@pytest.mark.parametrize("stage", ["init", "run", "eval"])
async def test_failure_records_stage_and_type(start_node, autojump_clock, stage):
    node = await start_node()
    job = node.submit(req(init_s=1, run_s=1, eval_s=1, fail_stage=stage)).jobs[0]
    await job.done.wait()
    assert job.status is Status.failed
    assert job.trajectory.error.stage == stage
    assert job.trajectory.error.type == "RuntimeError"
    assert job.trajectory.usable is False and job.trajectory.reward is None


@pytest.mark.parametrize("stage", ["init", "run", "eval"])
async def test_cancel_in_each_stage(start_node, autojump_clock, stage):
    node = await start_node()
    job = node.submit(req(init_s=10, run_s=10, eval_s=10)).jobs[0]
    await trio.sleep({"init": 5, "run": 15, "eval": 25}[stage])
    assert job.status.value == stage
    node.service.cancel(job.id)
    await job.done.wait()
    assert job.status is Status.cancelled
    assert job.trajectory.error.stage == stage
    assert trio.current_time() == pytest.approx({"init": 5, "run": 15, "eval": 25}[stage])
    await node.pipeline.wait_idle()
    assert node.pipeline.stats[Stage(stage)].in_flight == 0


async def test_cancel_while_waiting_for_run_ends_it_at_once(start_node, autojump_clock):
    """A job through INIT that waits for a busy RUN worker ends (and gives back what INIT
    gave it) when cancelled, not when a RUN worker frees up."""
    node = await start_node(n_init=1, n_run=1, n_eval=1)
    jobs = node.submit(req(n=3, init_s=1, run_s=100)).jobs
    await trio.sleep(5)  # one runs, two wait in ready (one of them in the INIT worker's hands)
    assert [j.status for j in jobs] == [Status.run, Status.init, Status.init]
    assert node.pipeline.waiting == 2
    node.service.cancel(jobs[1].id)
    await jobs[1].done.wait()
    assert trio.current_time() == pytest.approx(5)
    assert jobs[1].status is Status.cancelled
    assert (jobs[1].trajectory.error.stage, jobs[1].trajectory.error.message) == (
        "run", "cancelled before run")
    assert node.pipeline.waiting == 1 and jobs[0].status is Status.run
    for job in (jobs[0], jobs[2]):
        node.service.cancel(job.id)
    await node.pipeline.wait_idle()


async def test_cancel_while_queued_frees_the_slot(start_node, autojump_clock):
    node = await start_node(n_init=1, n_run=1, n_eval=1, queue_size=2)
    busy = node.submit(req(init_s=50)).jobs[0]
    await trio.sleep(1)
    queued = node.submit(req(n=2, init_s=1)).jobs
    with pytest.raises(QueueFullError):
        node.submit(req())
    node.service.cancel(queued[0].id)
    assert queued[0].status is Status.cancelled
    assert queued[0].trajectory.error.stage == "queue"
    node.submit(req())  # the slot is free again
    node.service.cancel(busy.id)
    await node.pipeline.wait_idle()


async def test_wait_for_room_returns_when_a_job_could_start_without_queueing(start_node, autojump_clock):
    """``wait_for_room`` (what an idle thief sleeps on) returns at once when a slot is free
    and nothing is queued, and otherwise at the moment that becomes so: here when the
    queued job is taken by the INIT worker and a slot is still free, then, once full, when
    a job ends."""
    node = await start_node(n_init=1, n_run=1, n_eval=1)  # 3 slots
    pipeline = node.pipeline
    with trio.fail_after(0):
        await pipeline.wait_for_room()  # idle: at once
    first = node.submit(req(init_s=5, run_s=100)).jobs[0]
    await trio.sleep(1)
    second = node.submit(req(init_s=5, run_s=100)).jobs[0]  # queued behind INIT
    assert not pipeline.has_room() and len(pipeline.intake) == 1
    t0 = trio.current_time()
    await pipeline.wait_for_room()
    assert trio.current_time() - t0 == pytest.approx(4)  # INIT took the queued one; 1 slot free
    assert pipeline.has_room()
    third = node.submit(req(run_s=1)).jobs[0]
    assert not pipeline.has_room()  # three live jobs, three slots
    t0 = trio.current_time()
    await pipeline.wait_for_room()
    assert first.done.is_set() and trio.current_time() - t0 == pytest.approx(100, abs=1)
    for job in (first, second, third):
        node.service.cancel(job.id)
    await pipeline.wait_idle()


async def test_a_withdrawn_job_leaves_the_queue_for_good():
    """``JobQueue.remove`` drops the job itself, not only its slot: a job cancelled while
    queued is no longer referenced by the queue (it used to stay in the heap, task and all,
    until a worker popped it), and the others keep their priority order."""
    from rolloutd.daemon.jobs import Job, JobQueue, JobRequest
    from rolloutd.daemon.tasks.sleep import SleepTask

    queue = JobQueue(3)
    jobs = [Job(JobRequest(task=sleep_task(), handler=SleepTask(), timeout_s=1, priority=p),
                job_id=f"r-{p}", group_id="g", sample_index=0) for p in (1, 3, 2)]
    queue.put_many_nowait(jobs)
    gone = weakref.ref(jobs.pop(0))
    assert queue.remove(gone()) and not queue.remove(gone())  # type: ignore[arg-type]
    gc.collect()
    assert gone() is None and len(queue) == 2 and queue.free == 1
    assert [j.id for j in queue.drain_nowait()] == ["r-3", "r-2"]


async def test_cancel_between_stages(start_node, autojump_clock):
    node = await start_node(n_init=2, n_run=1, n_eval=1)
    jobs = node.submit(req(n=2, init_s=1, run_s=10)).jobs
    await trio.sleep(2)  # one job runs, the other finished INIT and waits for the RUN worker
    [first] = [j for j in jobs if j.status is Status.run]
    [second] = [j for j in jobs if j.status is Status.init]
    node.service.cancel(second.id)
    await second.done.wait()
    assert second.status is Status.cancelled
    await first.done.wait()
    assert first.status is Status.completed


async def test_priority_orders_the_queue(start_node, autojump_clock):
    node = await start_node(n_init=1, n_run=1, n_eval=1)
    node.submit(req(init_s=1))
    low = node.submit(req(init_s=1, priority=-5)).jobs[0]
    high = node.submit(req(init_s=1, priority=5)).jobs[0]
    await node.service.wait([low, high])
    assert high.finished_at < low.finished_at


async def test_stage_statistics(start_node, autojump_clock):
    node = await start_node()
    sub = node.submit(req(n=4, init_s=1, run_s=2, eval_s=1))
    await node.service.wait(sub.jobs)
    stages = node.pipeline.statistics()["stages"]
    assert stages["run"]["finished"] == 4
    assert stages["run"]["p50_s"] == pytest.approx(2.0)
    assert stages["init"]["in_flight"] == 0


async def test_drain_cancels_queued_and_waits_for_in_flight(start_node, autojump_clock):
    node = await start_node(n_init=1, n_run=1, n_eval=1, drain_timeout_s=5)
    running = node.submit(req(run_s=3)).jobs[0]
    late = node.submit(req(run_s=3)).jobs[0]
    stuck = node.submit(req(init_s=1)).jobs[0]
    await trio.sleep(0.5)
    await node._drain()
    assert running.status is Status.completed
    # `late` was in flight (waiting between stages) and got the drain window; `stuck` too.
    assert {late.status, stuck.status} <= {Status.completed, Status.cancelled}
    assert node.pipeline.live == 0


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
async def test_hand_over_takes_queued_jobs_then_those_waiting_after_init(nursery, tmp_path, caplog):
    """Work stealing's victim side (daemon/steal.py) on a real bwrap supervisor: queued jobs
    go first, then jobs through INIT that wait for a RUN worker, newest first; those give
    their sandboxes back and are queued again by status. Taken back, they run here."""
    from rolloutd.daemon.node import Node
    from rolloutd.daemon.pipeline import Services
    from rolloutd.daemon.tasks import TaskRegistry
    from rolloutd.sandbox import SandboxSupervisor

    from .conftest import make_settings
    from .test_sampling import SandboxedSleep

    sup = SandboxSupervisor(default_backend="bwrap", state_dir=tmp_path / "sb", boot_id="test-boot")
    await nursery.start(sup.run)
    registry = TaskRegistry.default()
    registry.register(SandboxedSleep())
    node = Node(make_settings(tmp_path, n_init=1, n_run=1, n_eval=1),
                services=Services(supervisor=sup), registry=registry)
    await nursery.start(node.pipeline.run)
    pipeline = node.pipeline
    sub = node.submit(RolloutRequest(task={"kind": "sleep-sandboxed", "run_s": 30}, n=4))
    with trio.fail_after(30):  # 1 runs, 2 wait through INIT (one in the INIT worker's hands), 1 queued
        while (len(pipeline.intake), pipeline.waiting) != (1, 2):
            await trio.sleep(0.02)
    assert sup.statistics()["live"] == 3
    running = next(j for j in sub.jobs if j.status is Status.run)
    waiting_ids = [j.id for j in sub.jobs if j.status is Status.init]
    assert len(waiting_ids) == 2

    with caplog.at_level("INFO", logger="rolloutd.daemon.pipeline"):
        taken = await pipeline.hand_over(2, lambda job: True)
    queued = [j for j in sub.jobs if j is not running and j.id not in waiting_ids]
    assert taken[0] is queued[0]  # the queued one first
    assert taken[1].id == waiting_ids[-1]  # then the newest of those waiting
    assert all(j.status is Status.queued and j.sandbox is None for j in taken)
    assert sup.statistics()["live"] == 2  # its sandbox is gone; the others' are not
    assert (len(pipeline.intake), pipeline.waiting, pipeline.away) == (0, 1, 2)
    assert any(f"rollout {taken[1].id} withdrawn after INIT" in r.getMessage() for r in caplog.records)

    pipeline.take_back(taken)  # the peer did not take them: they run here after all
    assert (len(pipeline.intake), pipeline.waiting, pipeline.away) == (2, 1, 0)
    for job in sub.jobs:
        pipeline.cancel(job)
    with trio.fail_after(30):
        await node.service.wait(sub.jobs)
        while sup.statistics()["live"]:
            await trio.sleep(0.05)
    assert {j.status for j in sub.jobs} == {Status.cancelled}


async def test_withdraw_takes_just_queued_jobs_for_a_peer_and_take_back_requeues_them(start_node):
    """Placement of a batch's group (daemon/steal.py ``place``): the group's jobs, queued in
    this step, leave the intake whole; a cancelled or started one is not taken."""
    node = await start_node(n_init=1, n_run=1, n_eval=1)
    pipeline = node.pipeline
    group = node.submit(req(n=3, run_s=30)).jobs
    cancelled = node.submit(req(n=1, run_s=30)).jobs[0]
    cancelled.cancel()  # asked to cancel: not handed to anyone
    taken = pipeline.withdraw([*group, cancelled])
    assert taken == group
    assert (len(pipeline.intake), pipeline.away) == (1, 3)
    assert pipeline.withdraw(group) == []  # no longer queued here
    pipeline.take_back(taken)
    assert (len(pipeline.intake), pipeline.away) == (4, 0)
    for job in [*group, cancelled]:
        pipeline.cancel(job)
    with trio.fail_after(5):
        await node.service.wait([*group, cancelled])


async def test_rate_while_full_counts_finished_rollouts_not_cancelled_ones(start_node,
                                                                          autojump_clock):
    """The pipeline feeds its Throughput: EVAL (3 s, one worker) paces 3 workers' worth of
    rollouts at one every 3 s; cancelling queued ones does not make the node look faster.
    The rate is in the capacity federation peers are told."""
    node = await start_node(n_init=1, n_run=1, n_eval=1)
    jobs = node.submit(req(n=20, init_s=1, run_s=2, eval_s=3)).jobs
    assert node.capacity()["rate"] == 0.0
    await trio.sleep(10)  # two finished (at 6 and 9 s)
    for job in jobs[-5:]:
        node.service.cancel(job.id)
    await node.service.wait(jobs)
    assert sum(j.status is Status.completed for j in jobs) == 15
    assert node.pipeline.throughput.rate == pytest.approx(1 / 3)
    assert node.capacity()["rate"] == pytest.approx(0.3333)
