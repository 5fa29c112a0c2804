"""What a finished result keeps in memory does not grow with the size of its task.

Finished results stay in the result store for ``result_ttl_s``; before issue 15 (point 10)
each kept its whole request, task included, so multi-MB task bodies grew the daemon's RSS
without bound. bench/soak.py measures the RSS side (``rss_per_result_kb``); this checks the
structure: once the rollouts are finished, no live object holds a task body.
"""

from __future__ import annotations

import gc

import pytest

from daemon.jobs import JobFinished

from .conftest import sleep_task

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
