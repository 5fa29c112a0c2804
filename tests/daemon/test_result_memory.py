"""What a finished result keeps in memory does not grow with the size of its task.

Finished results stay in the result store for ``result_ttl_s``; before issue 15 (point 10)
each kept its whole request, task included, so multi-MB task bodies grew the daemon's RSS
without bound. bench/soak.py measures the RSS side (``rss_per_result_kb``); this checks the
structure: once the rollouts are finished, no live object holds a task body. The same holds
for dynamic-sampling batches, kept for ``result_ttl_s`` too: an ended batch let go of its
prompts and of its groups' tasks.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
from typing import Any

import pytest
import trio

from rolloutd.daemon.batch import BatchEnded
from rolloutd.daemon.jobs import JobFinished

from .conftest import sleep_task
from .test_sampling import equal, mixed

BODY_CHARS = 2 * 1024 * 1024
ROLLOUTS = 20


def holders_of_big_values(min_len: int) -> list[str]:
    """Type names of live gc-tracked objects that hold a str or bytes of ``min_len``+, directly
    or through containers the gc does not track (a dict of only strings and numbers)."""

    def holds(obj: object) -> bool:
        for ref in gc.get_referents(obj):
            kind = type(ref)  # not isinstance: that would touch lazy modules' attributes
            if kind in (str, bytes, bytearray) and len(ref) >= min_len:
                return True
            if kind in (dict, list, tuple) and not gc.is_tracked(ref) and holds(ref):
                return True
        return False

    gc.collect()
    return [type(obj).__name__ for obj in gc.get_objects() if holds(obj)]


async def test_finished_results_do_not_keep_their_task_bodies(asgi):
    client, node = await asgi(max_body_bytes=4 * BODY_CHARS)
    ids = []
    async with client:
        for i in range(ROLLOUTS):
            # A fresh multi-MB body per rollout; the test keeps no reference to it.
            task = sleep_task(id=f"big-{i}", pad=chr(ord("a") + i % 26) * BODY_CHARS)
            r = await client.post("/v1/rollouts", json={"task": task, "idempotency_key": f"k{i}"})
            assert r.status_code == 202, r.text
            ids += r.json()["ids"]
            del task, r
        jobs = [node.service.get(i) for i in ids]
        await node.service.wait(jobs)
        assert {j.status.value for j in jobs} == {"completed"}
        # What the API answers for a finished rollout is all still there.
        r = await client.get(f"/v1/rollouts/{ids[0]}")
        assert (r.json()["task_id"], r.json()["reward"]) == ("big-0", 1.0)
        r = await client.post("/v1/rollouts", json={
            "task": sleep_task(id="big-0", pad="a" * BODY_CHARS), "idempotency_key": "k0"})
        assert r.json()["replayed"] is True and r.json()["ids"] == ids[:1]
        del r
    assert holders_of_big_values(BODY_CHARS // 2) == []
    for job in jobs:
        with pytest.raises(JobFinished):
            job.request  # noqa: B018  (released when the job finished)


async def test_ended_batches_do_not_keep_their_prompts(asgi, nursery, autojump_clock, caplog):
    # pytest keeps every log record; a failed job's record holds its exception, whose frames
    # hold the task. The daemon's handlers format and drop records at once.
    caplog.set_level(logging.ERROR, logger="rolloutd.daemon.pipeline")
    client, node = await asgi(max_body_bytes=6 * BODY_CHARS)
    await nursery.start(node.sampler.run)
    letters = itertools.count()

    async def create(tasks: list[dict[str, Any]], **kw: Any) -> str:
        # A fresh multi-MB body per prompt; the test keeps no reference to it.
        prompts = [dict(t, pad=chr(ord("a") + next(letters) % 26) * BODY_CHARS) for t in tasks]
        r = await client.post("/v1/batches", json={"prompts": prompts, "group_size": 2, **kw})
        assert r.status_code == 202, r.text
        return str(r.json()["id"])

    async with client:
        # Kept K (group 1 filtered, group 3 a cancelled leftover), streamed while it runs.
        kept = await create([mixed(), equal(), mixed(run_s=2), mixed(run_s=100)],
                            keep=2, max_in_flight_groups=4)
        r = await client.get(f"/v1/batches/{kept}/groups")  # ASGI buffers: returns at the end
        assert [len(line) > BODY_CHARS for line in r.text.splitlines()] == [True, True]
        # Ran out: a failed group (infrastructure) and an all-equal one; prompts never tried.
        failed = await create([mixed(fail_stage="eval"), equal()], keep=1)
        bounded = await create([equal(), equal(), equal()], keep=1, max_gen_groups=1)
        cancelled = await create([mixed(run_s=100)] * 3, keep=2)
        await trio.sleep(1)
        assert (await client.delete(f"/v1/batches/{cancelled}")).status_code == 202
        batches = [node.sampler.get(b) for b in (kept, failed, bounded, cancelled)]
        for batch in batches:
            await batch.done.wait()
        expected = [("completed", "kept"), ("exhausted", "prompts_exhausted"),
                    ("exhausted", "max_gen_groups"), ("cancelled", "cancelled by request")]
        assert [(b.state.value, b.stop_reason) for b in batches] == expected
        # What the API answers for an ended batch is all still there, but the tasks.
        st = (await client.get(f"/v1/batches/{kept}")).json()
        assert (st["prompts"], st["tried"], st["kept"], st["filtered"], st["cancelled"]) == (4, 4, 2, 1, 1)
        r = await client.get(f"/v1/batches/{kept}/groups")
        replay = [json.loads(line) for line in r.text.splitlines()]
        assert [(g["prompt_index"], g["task"], g["rewards"], len(g["rollouts"])) for g in replay] == [
            (0, None, [0.0, 1.0], 2), (2, None, [0.0, 1.0], 2)]
        st = (await client.get(f"/v1/batches/{failed}")).json()
        assert st["filtered_reasons"] == {"infrastructure": 1, "all_equal": 1}
        del r
    assert holders_of_big_values(BODY_CHARS // 2) == []
    for batch in batches:
        assert all(g.task is None for g in batch.groups)
        with pytest.raises(BatchEnded):
            batch.request  # noqa: B018  (released when the batch ended)

