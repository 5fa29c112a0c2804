"""What every adapter shares: the prompt/completion split, whole groups, masked rows.

A trajectory ``T`` splits at ``P`` = the offset of its first sampled token
(``T.turns[0].start``; ``T.prompt_length`` when it has no turn): ``T.token_ids[:P]`` is the
rendered prompt, ``T.token_ids[P:]`` everything after it (sampled turns, with ``loss_mask``
1, and tool observations, with 0).

**Groups stay whole.** GRPO normalises rewards per group, so a trainer must get exactly as
many samples per prompt as it asked for. :func:`run_group` / :func:`arun_group` submit a
group, then resubmit each unusable sample (failed, cancelled, timed out before its first turn)
up to ``max_resubmits`` times under the same ``group_id``. A sample that is still unusable is
kept as a **masked row** (:func:`masked`): ``loss_mask`` all 0, reward 0, ``usable`` false.
It contributes nothing to the loss, and it is never silently dropped.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rolloutd.daemon.client import AsyncClient, Client
from rolloutd.daemon.trajectory import Status, Trajectory


def boundary(t: Trajectory) -> int:
    """``P``: where the first sampled token is (the end of the rendered prompt)."""
    return t.turns[0].start if t.turns else (t.prompt_length or len(t.token_ids))


def zeros_for_null(logprobs: Sequence[float | None]) -> list[float]:
    return [0.0 if x is None else float(x) for x in logprobs]


def versions(t: Trajectory) -> tuple[int | None, int | None]:
    """(oldest ``policy_version_start``, newest ``policy_version_end``) over the turns."""
    if not t.turns:
        return None, None
    return min(x.policy_version_start for x in t.turns), max(x.policy_version_end for x in t.turns)


def masked(t: Trajectory) -> Trajectory:
    """A copy that trains on nothing: loss mask all 0, reward 0, ``usable`` false. A sample
    with no tokens at all gets one token (its last prompt token, or 0) so every trainer
    still has a row to pad."""
    ids = list(t.token_ids) or [0]
    return t.model_copy(update={
        "token_ids": ids, "loss_mask": [0] * len(ids), "logprobs": [None] * len(ids),
        "reward": 0.0, "usable": False,
        "reward_info": {**t.reward_info, "masked": True},
    })


@dataclass
class GroupResult:
    """A whole group: ``rollouts[i]`` is sample i (masked when it stayed unusable)."""

    group_id: str
    rollouts: list[Trajectory]
    resubmitted: int = 0
    masked: list[int] = field(default_factory=list)


def _ok(t: Trajectory) -> bool:
    return t.usable and t.status is not Status.lost


def run_group(
    client: Client, task: Mapping[str, Any], n: int, *, group_id: str | None = None,
    max_resubmits: int = 2, **options: Any,
) -> GroupResult:
    """Blocking: ``n`` samples of ``task`` as one group, unusable ones resubmitted."""
    gid = group_id or f"g-{uuid.uuid4().hex[:12]}"
    rollouts = client.run(task, n=n, group_id=gid, **options)
    result = GroupResult(gid, rollouts)
    for _ in range(max_resubmits):
        bad = [i for i, t in enumerate(result.rollouts) if not _ok(t)]
        if not bad:
            break
        fresh = client.run(task, n=len(bad), group_id=gid, **options)
        result.resubmitted += len(bad)
        for i, t in zip(bad, fresh, strict=True):
            result.rollouts[i] = t
    result.masked = [i for i, t in enumerate(result.rollouts) if not _ok(t)]
    for i in result.masked:
        result.rollouts[i] = masked(result.rollouts[i])
    return result


async def arun_group(
    client: AsyncClient, task: Mapping[str, Any], n: int, *, group_id: str | None = None,
    max_resubmits: int = 2, **options: Any,
) -> GroupResult:
    """:func:`run_group` for the async client."""
    gid = group_id or f"g-{uuid.uuid4().hex[:12]}"
    rollouts = await client.run(task, n=n, group_id=gid, **options)
    result = GroupResult(gid, rollouts)
    for _ in range(max_resubmits):
        bad = [i for i, t in enumerate(result.rollouts) if not _ok(t)]
        if not bad:
            break
        fresh = await client.run(task, n=len(bad), group_id=gid, **options)
        result.resubmitted += len(bad)
        for i, t in zip(bad, fresh, strict=True):
            result.rollouts[i] = t
    result.masked = [i for i, t in enumerate(result.rollouts) if not _ok(t)]
    for i in result.masked:
        result.rollouts[i] = masked(result.rollouts[i])
    return result


def task_from_prompt(prompt: Any) -> dict[str, Any]:
    """The default prompt -> rolloutd task mapping: the prompt *is* the task, as a dict
    with ``kind`` or a JSON string of one (a dataset column holding rolloutd tasks)."""
    import json

    if isinstance(prompt, Mapping) and "kind" in prompt:
        return dict(prompt)
    if isinstance(prompt, str):
        try:
            task = json.loads(prompt)
        except ValueError:
            task = None
        if isinstance(task, dict) and "kind" in task:
            return task
    raise ValueError(
        "cannot make a rolloutd task of this prompt: give a task dict (with 'kind'), a JSON "
        "string of one, or pass task_fn= to map your prompts to tasks"
    )
