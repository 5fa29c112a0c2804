"""Policy-version stamps and ``max_staleness`` in dynamic-sampling batches, on virtual time.

The LLM is the scripted backend (a labelled test double) with a fixed latency per turn, so
the test can bump the policy version while turns are in flight. The task is the real ``calc``
handler with the real calculator tool, so this also runs the calc task end to end.
"""

from __future__ import annotations

import pytest
import trio

from rolloutd.daemon.batch import BatchRequest, BatchState
from rolloutd.daemon.llm.chat import embedded_renderer
from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.llm.scripted import ScriptedBackend
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services

from ..daemon.conftest import make_settings

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 392"}}\n</tool_call>'
TASK = {"kind": "calc", "expression": "4821 * 392", "examples": 0}  # the script counts turns


@pytest.fixture
async def node(nursery, tmp_path):
    pool = BackendPool(health_interval_s=3600)
    await nursery.start(pool.run)
    renderer = await trio.to_thread.run_sync(embedded_renderer)
    pool.add(ScriptedBackend(renderer, [CALL, "The answer is 1,889,832."], latency_s=1.0), backend_id="s")
    node = Node(make_settings(tmp_path, n_init=8, n_run=8, n_eval=8), services=Services(pool=pool))
    node.services.renderer = node.backends.renderer
    await node.backends.renderer()  # loaded in a thread: before any job's clock runs (autojump)
    await nursery.start(node.pipeline.run)
    await nursery.start(node.sampler.run)
    return node


def batch(**kw):
    return BatchRequest(prompts=[TASK] * 2, group_size=2, keep=2, filter={"rule": "keep_all"}, **kw)


async def test_calc_rollouts_carry_versions_and_stale_groups_are_dropped(node, autojump_clock):
    pool = node.pool
    # 1. A version bump while the first turns are in flight: with max_staleness=0 every group
    #    holds a sample that began on version 0 while version 1 is current -> dropped.
    b = node.sampler.create(batch(max_staleness=0))
    await trio.sleep(0.5)
    pool.set_policy_version(1)
    await b.done.wait()
    assert b.state is BatchState.exhausted and not b.kept_groups
    assert b.filtered_reasons == {"stale": 2}
    assert "began on policy version 0" in b.groups[0].detail and "current version is 1" in b.groups[0].detail

    # 2. The same bump without a bound: kept, and the turns say where they straddled.
    b = node.sampler.create(batch())
    await trio.sleep(0.5)
    pool.set_policy_version(2)
    await b.done.wait()
    assert b.state is BatchState.completed and len(b.kept_groups) == 2
    traj = b.kept_groups[0].jobs[0].trajectory
    first, second = traj.turns
    assert (first.policy_version_start, first.policy_version_end) == (1, 2)
    assert (second.policy_version_start, second.policy_version_end) == (2, 2)
    # The calc task itself: the tool ran, its exact result came back, the answer was read.
    assert traj.reward == 1.0 and traj.reward_info["called_tool"] and traj.reward_info["tool_ok"]
    assert traj.messages[-2] == {"role": "tool", "name": "calculator", "content": "1889832"}

    # 3. Nothing changes during the batch: max_staleness=0 keeps every group.
    b = node.sampler.create(batch(max_staleness=0))
    await b.done.wait()
    assert b.state is BatchState.completed and len(b.kept_groups) == 2
    assert {t.policy_version_start for g in b.kept_groups for j in g.jobs for t in j.trajectory.turns} == {2}

    # 4. A bound of 1 tolerates one bump.
    b = node.sampler.create(batch(max_staleness=1))
    await trio.sleep(0.5)
    pool.set_policy_version(3)
    await b.done.wait()
    assert b.state is BatchState.completed and len(b.kept_groups) == 2
    status = b.status()
    assert status["filtered"] == 0


async def test_max_staleness_is_validated():
    with pytest.raises(ValueError):
        BatchRequest(prompts=[TASK], group_size=2, keep=1, max_staleness=-1)
