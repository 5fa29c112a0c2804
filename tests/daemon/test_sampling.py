"""Dynamic sampling (daemon/sampling.py) on virtual time, with scripted rewards.

The labelled sleep task scripts per-sample rewards (``rewards``) and RUN times (``run_s``).
Sandbox accounting uses ``CountingSupervisor``, a labelled test double: the pipeline's
open/release calls are what is under test here, not sandboxes themselves (the real
supervisor is exercised in test_batch_api.py).
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import pytest
import trio

from rolloutd.daemon.batch import BatchEnded, BatchRequest, BatchState, GroupFilter, GroupState
from rolloutd.daemon.errors import Draining, InvalidTask
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services
from rolloutd.daemon.tasks.base import Prompt, Reward, TaskHandler
from rolloutd.daemon.tasks.registry import TaskRegistry
from rolloutd.daemon.tasks.sleep import SleepTask
from rolloutd.daemon.trajectory import Status
from rolloutd.sandbox import SandboxSpec

from .conftest import make_settings


class CountingSupervisor:
    """TEST DOUBLE: hands out inert sandbox handles and counts opens and releases."""

    def __init__(self) -> None:
        self.live: dict[str, object] = {}
        self.opened = 0

    async def open(self, spec: SandboxSpec) -> Any:
        await trio.sleep(0.1)
        self.opened += 1

        class Handle:
            id = f"sb-{self.opened}"

        self.live[Handle.id] = Handle
        return Handle

    async def release(self, sb: Any) -> None:
        await trio.sleep(0.1)
        self.live.pop(sb.id, None)

    def statistics(self) -> dict[str, Any]:
        return {"live": len(self.live), "opened": self.opened}


class SandboxedSleep(SleepTask):
    """The sleep task, asking for a sandbox in INIT (labelled test task)."""

    kind = "sleep-sandboxed"

    def sandbox_spec(self, task: dict[str, Any]) -> SandboxSpec:
        return SandboxSpec()


@pytest.fixture
async def start(nursery, tmp_path):
    """A node's pipeline and sampler (no HTTP, no LLM), optionally with the counting supervisor."""

    async def make(*, supervisor: CountingSupervisor | None = None, **overrides: Any) -> Node:
        registry = TaskRegistry.default()
        registry.register(SandboxedSleep())
        values = {"n_init": 8, "n_run": 8, "n_eval": 8, **overrides}
        node = Node(make_settings(tmp_path, **values), services=Services(supervisor=supervisor),
                    registry=registry)
        await nursery.start(node.pipeline.run)
        await nursery.start(node.sampler.run)
        return node

    return make


def mixed(run_s: float | list[float] = 1.0, **kw: Any) -> dict[str, Any]:
    """A prompt whose group has different rewards (kept by the DAPO rule)."""
    return {"kind": "sleep", "run_s": run_s, "rewards": [0, 1], **kw}


def equal(reward: float = 1.0, run_s: float | list[float] = 1.0, **kw: Any) -> dict[str, Any]:
    """A prompt whose group rewards are all equal (filtered)."""
    return {"kind": "sleep", "run_s": run_s, "rewards": [reward], **kw}


def batch_req(prompts: list[dict[str, Any]], **kw: Any) -> BatchRequest:
    return BatchRequest(prompts=prompts, **{"group_size": 2, "keep": 2, **kw})


async def released(sup: CountingSupervisor) -> None:
    """Wait (briefly) until every sandbox is released: the pipeline publishes a job's result
    first and releases its sandbox right after."""
    with trio.fail_after(1):
        while sup.live:
            await trio.sleep(0.01)


async def collect(node: Node, batch) -> list[tuple[float, Any]]:
    return [(trio.current_time(), g) async for g in node.sampler.groups(batch)]


async def test_exactly_k_kept_streamed_then_leftovers_cancelled(start, autojump_clock):
    node = await start()
    prompts = [mixed(run_s=[1, 2]), equal(0), mixed(), equal(1), mixed(), mixed(run_s=50), mixed()] * 2
    batch = node.sampler.create(batch_req(prompts, group_size=4, keep=3, max_in_flight_groups=4))
    kept = await collect(node, batch)
    assert len(kept) == 3
    for _, g in kept:
        assert g.state is GroupState.kept and len(g.jobs) == 4
        assert len(set(g.rewards)) > 1
        assert {j.group_id for j in g.jobs} == {g.group_id}
        assert f"batch:{batch.id}" in g.jobs[0].trajectory.labels
        assert sorted(j.trajectory.sample_index for j in g.jobs) == [0, 1, 2, 3]
    st = batch.status()
    assert (st["state"], st["stop_reason"]) == ("completed", "kept")
    assert st["kept"] == 3 and st["in_flight"] == 0
    assert st["filtered_reasons"] == {"all_equal": st["filtered"]}
    assert st["tried"] == st["kept"] + st["filtered"] + st["cancelled"] and st["cancelled"] >= 1
    leftovers = [g for g in batch.groups if g.state is GroupState.cancelled]
    assert all(j.done.is_set() for g in leftovers for j in g.jobs)
    # The 50 s group was still running: its samples were cancelled, not waited for.
    assert any(j.status is Status.cancelled for g in leftovers for j in g.jobs)
    assert trio.current_time() < 50
    assert node.pipeline.live == 0  # nothing of the batch is left running


async def test_all_equal_groups_are_filtered_with_reasons(start, autojump_clock):
    node = await start()
    prompts = [equal(0), equal(1), equal(0.5), equal(1)]
    batch = node.sampler.create(batch_req(prompts, keep=2))
    assert await collect(node, batch) == []
    st = batch.status()
    assert (st["state"], st["stop_reason"]) == ("exhausted", "prompts_exhausted")
    assert st["tried"] == 4 and st["filtered"] == 4 and st["filtered_reasons"] == {"all_equal": 4}
    details = [g["detail"] for g in st["filtered_groups"]]
    assert details[0] == "every sample has reward=0" and details[2] == "every sample has reward=0.5"


async def test_bound_on_groups_tried_and_in_flight(start, autojump_clock):
    node = await start()
    prompts = [equal(run_s=1)] * 20
    t0 = trio.current_time()
    batch = node.sampler.create(batch_req(prompts, keep=3, max_in_flight_groups=2, max_gen_groups=5))
    await batch.done.wait()
    st = batch.status()
    assert (st["state"], st["stop_reason"]) == ("exhausted", "max_gen_groups")
    assert st["tried"] == 5 and st["kept"] == 0
    # Two groups at a time, 1 s each: 5 groups take 3 s.
    assert trio.current_time() - t0 == pytest.approx(3.0)
    starts = sorted(g.jobs[0].submitted_at - t0 for g in batch.groups)
    assert starts == pytest.approx([0, 0, 1, 1, 2])


async def test_replenishes_as_each_group_finishes_not_in_lock_step(start, autojump_clock):
    node = await start()
    prompts = [mixed(run_s=10), equal(), equal(), equal(), mixed(), mixed(), mixed()]
    t0 = trio.current_time()
    batch = node.sampler.create(batch_req(prompts, keep=2, max_in_flight_groups=2))
    kept = await collect(node, batch)
    # The long group 0 never holds the others back: a new group starts as each short one ends.
    assert [round(t - t0, 6) for t, _ in kept] == [4.0, 5.0]
    assert [g.index for _, g in kept] == [4, 5]
    starts = [round(g.jobs[0].submitted_at - t0, 6) for g in batch.groups]
    assert starts == [0, 0, 1, 2, 3, 4]
    long = batch.groups[0]
    assert long.state is GroupState.cancelled
    assert [j.status for j in long.jobs] == [Status.cancelled] * 2
    assert long.jobs[0].trajectory.error.stage == "run"
    assert batch.status()["cancelled"] == 1


async def test_unusable_sample_filters_the_group_as_infrastructure(start, autojump_clock):
    node = await start()
    prompts = [mixed(fail_stage="eval"), mixed()]
    batch = node.sampler.create(batch_req(prompts, keep=1, max_in_flight_groups=1))
    kept = await collect(node, batch)
    assert [g.index for _, g in kept] == [1]
    [bad] = batch.status()["filtered_groups"]
    assert bad["reason"] == "infrastructure"
    assert "RuntimeError" in bad["detail"] and "failed" in bad["detail"]
    assert bad["rewards"] == [None, None]  # never disguised as reward 0


async def test_filter_by_reward_info_metric(start, autojump_clock):
    node = await start()
    # Rewards equal, but the `acc` metric differs within group 0.
    acc = {"kind": "sleep", "rewards": [1], "reward_info": [{"acc": True}, {"acc": False}]}
    same = {"kind": "sleep", "rewards": [0, 1], "reward_info": {"acc": 1}}
    missing = {"kind": "sleep", "rewards": [0, 1]}
    flt = GroupFilter(metric="acc")
    batch = node.sampler.create(batch_req([same, missing, acc], keep=1, filter=flt))
    kept = await collect(node, batch)
    assert [g.index for _, g in kept] == [2]
    assert batch.status()["filtered_reasons"] == {"all_equal": 1, "missing_metric": 1}


async def test_min_std_and_keep_all(start, autojump_clock):
    node = await start()
    near = {"kind": "sleep", "rewards": [0.5, 0.51]}
    batch = node.sampler.create(batch_req([near, mixed()], keep=1, filter=GroupFilter(min_std=0.1)))
    kept = await collect(node, batch)
    assert [g.index for _, g in kept] == [1]
    assert batch.status()["filtered_reasons"] == {"low_std": 1}
    batch = node.sampler.create(batch_req([equal(), equal()], keep=2, filter=GroupFilter(rule="keep_all")))
    assert len(await collect(node, batch)) == 2


async def test_leftovers_release_their_sandboxes(start, autojump_clock):
    sup = CountingSupervisor()
    node = await start(supervisor=sup, n_init=4, n_run=2)
    prompts = [dict(mixed(run_s=[1, 30]), kind="sleep-sandboxed")] + [
        dict(mixed(run_s=r), kind="sleep-sandboxed") for r in (40, 2, 60, 3, 70)
    ]
    batch = node.sampler.create(batch_req(prompts, keep=1, max_in_flight_groups=6))
    await trio.sleep(5)
    assert sup.live  # groups hold sandboxes in INIT and RUN, others wait for a RUN worker
    await batch.done.wait()
    assert batch.status()["kept"] == 1 and batch.status()["cancelled"] == 5
    await released(sup)
    assert sup.opened >= 2
    assert node.pipeline.live == 0
    assert {s for g in batch.groups for s in (j.status for j in g.jobs)} <= {
        Status.completed, Status.cancelled}


async def test_cancel_a_batch(start, autojump_clock):
    sup = CountingSupervisor()
    node = await start(supervisor=sup)
    prompts = [dict(mixed(run_s=100), kind="sleep-sandboxed")] * 6
    batch = node.sampler.create(batch_req(prompts, keep=3, max_in_flight_groups=3))
    await trio.sleep(10)
    assert batch.status()["in_flight"] == 3
    node.sampler.cancel(batch.id)
    node.sampler.cancel(batch.id)  # idempotent
    await batch.done.wait()
    st = batch.status()
    assert (st["state"], st["stop_reason"]) == ("cancelled", "cancelled by request")
    assert st["cancelled"] == 3 and st["tried"] == 3 and st["in_flight"] == 0
    assert node.pipeline.live == 0
    await released(sup)


async def test_cancel_before_the_batch_starts_submits_nothing(start, autojump_clock):
    node = await start()
    batch = node.sampler.create(batch_req([mixed()] * 3))
    node.sampler.cancel(batch.id)
    await batch.done.wait()
    assert batch.state is BatchState.cancelled and batch.groups == []
    assert node.service.submitted_total == 0


async def test_full_intake_is_back_pressure_not_an_error(start, autojump_clock):
    node = await start(queue_size=4, n_init=1, n_run=1, n_eval=1)
    prompts = [equal(run_s=1), mixed(run_s=1)] * 4
    batch = node.sampler.create(batch_req(prompts, group_size=4, keep=3, max_in_flight_groups=4))
    kept = await collect(node, batch)
    assert len(kept) == 3 and batch.state is BatchState.completed


async def test_draining_stops_new_groups_and_lets_running_ones_finish(start, autojump_clock):
    node = await start()
    batch = node.sampler.create(batch_req([equal(run_s=5)] * 10, max_in_flight_groups=2))
    await trio.sleep(1)
    node.service.draining = True
    await batch.done.wait()
    st = batch.status()
    assert (st["state"], st["stop_reason"]) == ("exhausted", "draining")
    assert st["tried"] == 2 and st["filtered"] == 2 and st["cancelled"] == 0
    with pytest.raises(Draining):
        node.sampler.create(batch_req([mixed()]))


async def test_stopping_the_sampler_cancels_its_batches(tmp_path, autojump_clock):
    node = Node(make_settings(tmp_path), services=Services())
    async with trio.open_nursery() as outer:
        await outer.start(node.pipeline.run)
        async with trio.open_nursery() as inner:
            await inner.start(node.sampler.run)
            batch = node.sampler.create(batch_req([mixed(run_s=100)] * 4))
            await trio.sleep(1)
            inner.cancel_scope.cancel()
        assert batch.done.is_set() and batch.state is BatchState.cancelled
        assert batch.stop_reason == "the daemon stopped"
        await node.pipeline.wait_idle()
        assert all(j.status is Status.cancelled for g in batch.groups for j in g.jobs)
        outer.cancel_scope.cancel()


async def test_invalid_batches_are_refused_up_front(start, autojump_clock):
    node = await start(max_samples_per_request=8)
    with pytest.raises(InvalidTask, match=r"prompts\[1\]: sleep task: 'rewards'"):
        node.sampler.create(batch_req([mixed(), {"kind": "sleep", "rewards": []}]))
    with pytest.raises(InvalidTask, match="unknown task kind"):
        node.sampler.create(batch_req([{"kind": "nope"}]))
    with pytest.raises(InvalidTask, match="group_size=9"):
        node.sampler.create(batch_req([mixed()], group_size=9))
    assert node.sampler.live == 0 and node.service.submitted_total == 0


async def test_stream_from_an_offset_and_after_the_end(start, autojump_clock):
    node = await start()
    batch = node.sampler.create(batch_req([mixed()] * 4, keep=3, max_in_flight_groups=3))
    await batch.done.wait()
    assert [g async for g in node.sampler.groups(batch, start=1)] == batch.kept_groups[1:]
    line = batch.kept_groups[0].line()
    assert set(line) == {"group_id", "prompt_index", "task", "rewards", "carried_from", "rollouts"}
    assert line["rewards"] == [0.0, 1.0] and line["rollouts"][1]["reward"] == 1.0
    assert line["task"] is None  # released: the batch ended with no reader


async def test_a_reader_open_when_the_batch_ends_gets_every_task(start, autojump_clock):
    node = await start()
    prompts = [mixed(), equal(), mixed(run_s=2), mixed(run_s=50)]
    batch = node.sampler.create(batch_req(prompts, keep=2, max_in_flight_groups=4))
    async with aclosing(node.sampler.groups(batch)) as groups:
        assert (await anext(groups)).index == 0
        await batch.done.wait()  # the reader falls behind: the batch ends before it reads on
        with pytest.raises(BatchEnded):
            batch.request  # noqa: B018  (every prompt is released at once)
        assert [g.task for g in batch.groups] == [prompts[0], None, prompts[2], None]
        rest = [g.line()["task"] async for g in groups]
    assert rest == [prompts[2]]
    # The last reader is gone: the kept groups let go of their tasks too.
    assert [g.task for g in batch.groups] == [None] * 4
    assert [g.line()["task"] async for g in node.sampler.groups(batch)] == [None, None]


# ---- through the real agent loop: groups stick to one backend, leftovers abort LLM calls ----


class ChatTask(TaskHandler):
    """A labelled test task run by the real agent loop; rewards scripted per sample index."""

    kind = "chat-test"

    def validate(self, task: dict[str, Any]) -> dict[str, Any]:
        return dict(task)

    def prompt(self, task: dict[str, Any]) -> Prompt:
        return Prompt(messages=[{"role": "user", "content": task["q"]}])

    async def evaluate(self, task: dict[str, Any], trajectory: Any, ctx: Any) -> Reward:
        return Reward(float(trajectory.sample_index % 2), {"test_task": "chat-test"})


@pytest.fixture(scope="module")
def renderer():
    from rolloutd.daemon.llm.chat import ChatRenderer, load_embedded_tokenizer

    return ChatRenderer.for_tokenizer(load_embedded_tokenizer())


async def test_groups_share_a_backend_and_leftovers_abort_llm_requests(
    nursery, tmp_path, renderer, autojump_clock
):
    from rolloutd.daemon.llm.pool import BackendPool
    from rolloutd.daemon.llm.scripted import ScriptedBackend

    pool = BackendPool(health_interval_s=3600)
    await nursery.start(pool.run)
    for name, latency in [("fast-a", 1.0), ("fast-b", 1.0), ("slow", 100.0)]:
        pool.add(ScriptedBackend(renderer, ["The answer is 4."], latency_s=latency), backend_id=name)

    async def get_renderer() -> Any:
        return renderer

    registry = TaskRegistry()
    registry.register(ChatTask())
    node = Node(make_settings(tmp_path, n_init=16, n_run=16, n_eval=16),
                services=Services(pool=pool, renderer=get_renderer), registry=registry)
    await nursery.start(node.pipeline.run)
    await nursery.start(node.sampler.run)
    prompts = [{"kind": "chat-test", "q": f"What is 2+2? ({i})"} for i in range(12)]
    batch = node.sampler.create(batch_req(prompts, group_size=4, keep=4, max_in_flight_groups=6))
    kept = await collect(node, batch)
    assert len(kept) == 4 and trio.current_time() < 100
    for _, g in kept:
        backends = {t.backend for j in g.jobs for t in j.trajectory.turns}
        assert len(backends) == 1 and backends <= {"fast-a", "fast-b"}  # sticky per group
    # The groups routed to the slow backend were still waiting for it: cancelled in RUN.
    cut = [j for g in batch.groups if g.state is GroupState.cancelled for j in g.jobs
           if j.status is Status.cancelled]
    assert cut and {j.trajectory.error.stage for j in cut} == {"run"}
    assert all(b["in_flight"] == 0 for b in pool.describe())  # their LLM requests were aborted


# ---- streams: leftovers carry over to the next batch ------------------------------------


def accounted(st: dict[str, Any]) -> bool:
    """Every group a batch started or adopted is in exactly one place."""
    return (st["tried"] + st["carried_in"] == st["kept"] + st["filtered"] + st["in_flight"]
            + st["cancelled"] + st["carried_out"]
            and sum(st["cancelled_reasons"].values()) == st["cancelled"])


async def test_stream_carries_slow_groups_to_the_next_batch(start, autojump_clock):
    node = await start()
    slow = [mixed(run_s=10), mixed(run_s=[1, 20])]
    a = node.sampler.create(batch_req([mixed(), slow[0], slow[1], mixed()], stream="run-1",
                                      max_in_flight_groups=4))
    kept_a = await collect(node, a)
    assert sorted(g.index for _, g in kept_a) == [0, 3]
    st = a.status()
    assert (st["state"], st["stream"], st["carried_out"], st["cancelled"]) == ("completed", "run-1", 2, 0)
    assert st["carried_to"] is None and accounted(st)
    # The slow groups still run: nothing was cancelled, and their samples are not done.
    carried = [g for g in a.groups if g.state is GroupState.carried]
    assert [g.index for g in carried] == [1, 2]
    assert all(not all(j.done.is_set() for j in g.jobs) for g in carried)

    await trio.sleep(12)  # slow[0] finishes between the two batches; slow[1] still runs
    b = node.sampler.create(batch_req([mixed(run_s=30), mixed(run_s=30)], stream="run-1",
                                      max_in_flight_groups=2))
    assert a.status()["carried_to"] == b.id
    t0 = trio.current_time()
    kept_b = await collect(node, b)
    # The two carried groups take B's two in-flight slots and are judged first: the finished
    # one at once (its slot goes to B's first prompt), the other when it finishes; B's own
    # 30 s group is then carried on in turn.
    assert [(g.carried_from, g.index) for _, g in kept_b] == [(a.id, 1), (a.id, 2)]
    assert kept_b[0][0] == t0 and kept_b[1][0] - t0 < 10
    st = b.status()
    assert (st["carried_in"], st["kept"], st["tried"], st["carried_out"]) == (2, 2, 1, 1)
    assert accounted(st)
    assert all(j.status is Status.completed for _, g in kept_b for j in g.jobs)
    lines = [g.line() for _, g in kept_b]
    assert {line["carried_from"] for line in lines} == {a.id}
    assert st["lengths"]["kept"]["groups"] == 2 and st["lengths"]["kept"]["mean_duration_s"] > 10


async def test_a_group_carried_twice_names_the_batch_that_started_it(start, autojump_clock):
    """A -> B -> C: the slow group of A outlives B too. C's record still says A (and A's
    prompt index), so a trainer maps it to the right prompt (bench/sampling.py did not)."""
    node = await start()
    a = node.sampler.create(batch_req([mixed(), mixed(run_s=50, tag="slow")], stream="s",
                                      keep=1, max_in_flight_groups=2))
    assert [g.index for _, g in await collect(node, a)] == [0]
    # (a batch's in-flight cap is at most its prompt count; a carried group takes a slot)
    b = node.sampler.create(batch_req([mixed(tag="b0"), mixed(tag="b1")], stream="s",
                                      keep=1, max_in_flight_groups=2))
    kept_b = [(g.carried_from, g.task["tag"]) async for g in node.sampler.groups(b)]
    assert kept_b == [(None, "b0")]
    assert b.status()["carried_out"] == 1
    c = node.sampler.create(batch_req([mixed(run_s=100)] * 2, stream="s", keep=1,
                                      max_in_flight_groups=2, carry_over=False))
    kept_c = [(g.carried_from, g.index, g.task["tag"], g.line()["carried_from"])
              async for g in node.sampler.groups(c)]
    assert kept_c == [(a.id, 1, "slow", a.id)]
    assert trio.current_time() < 60


async def test_a_stream_runs_one_batch_at_a_time(start, autojump_clock):
    from rolloutd.daemon.errors import StreamBusy

    node = await start()
    a = node.sampler.create(batch_req([mixed(run_s=5)] * 3, stream="s"))
    with pytest.raises(StreamBusy, match="still running"):
        node.sampler.create(batch_req([mixed()], stream="s"))
    other = node.sampler.create(batch_req([mixed()], stream="t"))  # another stream is free
    await collect(node, a)
    await collect(node, other)
    node.sampler.cancel(node.sampler.create(batch_req([mixed()], stream="s")).id)


async def test_carried_groups_nobody_adopts_are_cancelled(start, autojump_clock):
    node = await start()
    a = node.sampler.create(batch_req([mixed(), mixed(), mixed(run_s=500)], stream="s",
                                      max_in_flight_groups=3, carry_ttl_s=60))
    await collect(node, a)
    (slow,) = [g for g in a.groups if g.state is GroupState.carried]
    await trio.sleep(61)
    st = a.status()
    assert (st["carried_out"], st["cancelled"], st["cancelled_reasons"]) == (0, 1, {"not_adopted": 1})
    assert slow.state is GroupState.cancelled and slow.reason == "not_adopted"
    assert all(j.status is Status.cancelled for j in slow.jobs) and accounted(st)
    assert st["wasted_sample_s"] == pytest.approx(2 * 61, abs=2)
    # The next batch of the stream starts clean.
    b = node.sampler.create(batch_req([mixed()], stream="s", keep=1))
    assert b.status()["carried_in"] == 0 and len(await collect(node, b)) == 1


@pytest.mark.parametrize("stream", [None, "s"])
async def test_without_carry_over_leftovers_are_cancelled_with_a_reason(start, autojump_clock, stream):
    node = await start()
    a = node.sampler.create(batch_req([mixed(), mixed(), mixed(run_s=500)], stream=stream,
                                      max_in_flight_groups=3, carry_over=False))
    await collect(node, a)
    await a.done.wait()
    st = a.status()
    assert (st["carried_out"], st["cancelled_reasons"]) == (0, {"batch_full": 1}) and accounted(st)
    assert st["lengths"]["offered"]["groups"] == 2


async def test_the_daemon_stopping_cancels_a_carry(nursery, tmp_path, autojump_clock):
    node = Node(make_settings(tmp_path, n_init=8, n_run=8, n_eval=8), services=Services())
    await nursery.start(node.pipeline.run)
    async with trio.open_nursery() as sampler_nursery:
        await sampler_nursery.start(node.sampler.run)
        a = node.sampler.create(batch_req([mixed(), mixed(), mixed(run_s=500)], stream="s",
                                          max_in_flight_groups=3))
        await collect(node, a)
        sampler_nursery.cancel_scope.cancel()
    (slow,) = [g for g in a.groups if g.reason is not None]
    assert (slow.state, slow.reason) == (GroupState.cancelled, "the daemon stopped")
    with trio.fail_after(5):
        for j in slow.jobs:
            await j.done.wait()
    assert all(j.status is Status.cancelled for j in slow.jobs)
