"""What every adapter shares: the prompt/completion split, segments, whole groups, masked rows.

A trajectory ``T`` splits at ``P`` = the offset of its first sampled token
(``T.turns[0].start``; ``T.prompt_length`` when it has no turn): ``T.token_ids[:P]`` is the
rendered prompt, ``T.token_ids[P:]`` everything after it (sampled turns, with ``loss_mask``
1, and tool observations, with 0).

**Segments.** A harness-driven rollout may hold several token-exact sequences
(``T.segments``: a new one each time the harness rewrote its history). Every adapter trains on
*views* (:func:`segment_view`): a copy of ``T`` whose ``token_ids``/``loss_mask``/``logprobs``
are segment ``i``'s, whose ``turns`` are the calls with ``turn.segment == i`` (their
``start``/``end`` are offsets into that segment), and whose ``P`` is the segment's
``prompt_length``; reward, group and ids stay the rollout's. A built-in-loop rollout (no
segments) is its own single view, unchanged. The rule, the same for every adapter:

- where the trainer takes a variable number of samples per rollout (SkyRL in step-wise mode),
  :func:`sequence_views` gives one row per segment, each with the rollout's reward and group,
  so no sampled token is lost;
- where it takes exactly one sequence per sample (TRL, verl, NeMo-Gym, SkyRL otherwise),
  :func:`last_sequence` gives the LAST segment (the history the harness ended with, the one
  its reward was computed on) and how many segments were left out; each adapter records that
  count in the row's extra info or metrics (``segments``, ``segments_left_out``), never
  silently.

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
    """``P``: where the first sampled token is (the end of the rendered prompt). For a
    built-in loop's rollout, the first turn's start; for a segment view (or a harness-driven
    rollout, whose top-level tokens repeat its last segment), the segment's ``prompt_length``."""
    if t.segments:
        return t.segments[-1].prompt_length
    return t.turns[0].start if t.turns else (t.prompt_length or len(t.token_ids))


def segment_view(t: Trajectory, i: int) -> Trajectory:
    """Segment ``i`` of a harness-driven rollout as a trajectory of its own: its tokens, its
    calls (``turn.segment == i``) and its ``prompt_length``; everything else (id, reward,
    group, usable, messages, timing) is the rollout's. ``segments`` holds just that segment."""
    seg = t.segments[i]
    return t.model_copy(update={
        "token_ids": list(seg.token_ids), "loss_mask": list(seg.loss_mask),
        "logprobs": list(seg.logprobs), "prompt_length": seg.prompt_length,
        "turns": [x for x in t.turns if x.segment == i], "segments": [seg],
    })


def sequence_views(t: Trajectory) -> list[Trajectory]:
    """One view per token-exact sequence, in order: ``[t]`` itself for a built-in loop's
    rollout, one :func:`segment_view` per segment for a harness-driven one."""
    if not t.segments:
        return [t]
    return [segment_view(t, i) for i in range(len(t.segments))]


def last_sequence(t: Trajectory) -> tuple[Trajectory, int]:
    """For a trainer that takes one sequence per sample: the last sequence's view and how
    many sequences were left out (0 for a built-in loop or a single segment)."""
    if not t.segments:
        return t, 0
    return segment_view(t, len(t.segments) - 1), len(t.segments) - 1


def segment_info(t: Trajectory, left_out: int) -> dict[str, int]:
    """What a one-sequence row records about the rollout's sequences."""
    return {"segments": max(1, len(t.segments)), "segments_left_out": left_out}


def zeros_for_null(logprobs: Sequence[float | None]) -> list[float]:
    return [0.0 if x is None else float(x) for x in logprobs]


def versions(t: Trajectory) -> tuple[int | None, int | None]:
    """(oldest ``policy_version_start``, newest ``policy_version_end``) over the turns."""
    if not t.turns:
        return None, None
    return min(x.policy_version_start for x in t.turns), max(x.policy_version_end for x in t.turns)


def masked(t: Trajectory) -> Trajectory:
    """A copy that trains on nothing: loss mask all 0, reward 0, ``usable`` false (every
    segment's loss mask too). A sample with no tokens at all gets one token (its last prompt
    token, or 0) so every trainer still has a row to pad."""
    ids = list(t.token_ids) or [0]
    segments = [s.model_copy(update={"loss_mask": [0] * len(s.token_ids),
                                     "logprobs": [None] * len(s.token_ids)}) for s in t.segments]
    return t.model_copy(update={
        "token_ids": ids, "loss_mask": [0] * len(ids), "logprobs": [None] * len(ids),
        "reward": 0.0, "usable": False, "segments": segments,
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
