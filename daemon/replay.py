"""Replay: a finished rollout's model outputs fed back against a fresh sandbox.

``POST /v1/rollouts/{id}/replay`` submits the rollout's task again (same task, sampling and
limits) as a new rollout whose LLM is a :class:`ReplayPool`: turn ``k`` is answered with the
token ids the original rollout sampled at its turn ``k`` (and their logprobs); no model runs.
The tools run again in the new sandbox, and :func:`compare` records, per tool call, whether
its output equals the recorded one (``ToolCallRecord.output_equal``) and a summary in the
trajectory's ``replay`` (:class:`~rolloutd.daemon.trajectory.ReplayInfo`).

A finished rollout keeps what a replay needs (its task, sampling, limits) only while it is in
the result store and only when its task is at most :data:`MAX_TASK_BYTES` of JSON, so that
the results kept do not grow with large task bodies (``tests/daemon/test_result_memory.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rolloutd.daemon.errors import NotReplayable
from rolloutd.daemon.llm.base import Completion, SamplingParams
from rolloutd.daemon.trajectory import ReplayInfo, Trajectory

#: The largest task (as JSON) a finished rollout keeps for a replay.
MAX_TASK_BYTES = 64 * 1024
#: How much of a differing output ``first_difference`` shows.
SHOWN_CHARS = 500
LABEL = "replay"


@dataclass(frozen=True)
class ReplaySource:
    """What a finished rollout keeps to be replayed."""

    task: dict[str, Any]
    sampling: SamplingParams | None
    limits: dict[str, Any] | None
    timeout_s: float


def keep_for_replay(source: ReplaySource, trajectory: Trajectory) -> ReplaySource | None:
    """``source`` if the rollout that finishes now (``trajectory``) can be replayed, else None."""
    if not trajectory.turns:
        return None
    try:
        size = len(json.dumps(source.task))
    except (TypeError, ValueError):
        return None
    return source if size <= MAX_TASK_BYTES else None


def check_replayable(trajectory: Trajectory, source: ReplaySource | None, *, done: bool) -> ReplaySource:
    """The source to replay ``trajectory`` from; :class:`NotReplayable` says why there is none."""
    rid = trajectory.id
    if not done:
        raise NotReplayable(f"rollout {rid} is {trajectory.status.value}, not finished: replay it once it ends")
    if not trajectory.turns:
        raise NotReplayable(f"rollout {rid} has no LLM turns to replay")
    if source is None:
        raise NotReplayable(
            f"rollout {rid}'s task is not held for replay (a task over {MAX_TASK_BYTES} bytes "
            "of JSON, or a rollout from an earlier daemon process)"
        )
    return source


class ReplayPool:
    """The LLM pool of a replay: turn ``k`` answers with the recorded turn ``k``'s sampled ids.

    Has the pool methods the agent loop and the pipeline call (``complete``, ``forget``). A
    replay that asks for more turns than were recorded gets an ``abort`` with no tokens."""

    def __init__(self, original: Trajectory) -> None:
        self.original = original
        self.name = f"{LABEL} of {original.id}"
        self.turn = 0

    async def complete(self, prompt_ids: Sequence[int], params: SamplingParams, *, max_tokens: int,
                       sticky_key: str | None = None, group_key: str | None = None) -> Completion:
        orig = self.original
        k, self.turn = self.turn, self.turn + 1
        if k >= len(orig.turns):
            return Completion([], [], "abort", backend=self.name)
        t = orig.turns[k]
        seq = orig.segments[t.segment] if t.segment is not None and orig.segments else orig
        ids = seq.token_ids[t.start : t.end]
        logprobs = [lp if lp is not None else 0.0 for lp in seq.logprobs[t.start : t.end]]
        return Completion(ids, logprobs, t.finish_reason or "stop", backend=self.name,
                          extra={"backend_id": self.name})

    def forget(self, key: str) -> None:
        pass


def _tool_outputs(tr: Trajectory) -> list[str]:
    return [str(m.get("content", "")) for m in tr.messages if m.get("role") == "tool"]


def _prompts(tr: Trajectory) -> list[list[int]]:
    """A harness-driven rollout's prompt of each call (what the harness made of its world)."""
    return [tr.segments[t.segment].token_ids[: t.start] for t in tr.turns
            if t.segment is not None and t.segment < len(tr.segments)]


def _compare_prompts(replayed: Trajectory, original: Trajectory) -> ReplayInfo:
    """A harness-driven replay: the harness gets the recorded replies again; its prompts
    (history, tool results) must come out the same, token for token."""
    got, want = _prompts(replayed), _prompts(original)
    first: dict[str, Any] | None = None
    for i in range(max(len(got), len(want))):
        a, b = (got[i] if i < len(got) else None), (want[i] if i < len(want) else None)
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a or [], b or [], strict=False)) if x != y),
                      min(len(a or []), len(b or [])))
            first = {"turn": i, "call": i, "tool": None, "position": at,
                     "recorded": None if b is None else f"prompt of {len(b)} tokens",
                     "replayed": None if a is None else f"prompt of {len(a)} tokens"}
            break
    return ReplayInfo(of=original.id, turns=min(len(replayed.turns), len(original.turns)),
                      tool_calls=len(got), tool_outputs_equal=first is None, first_difference=first)


def compare(replayed: Trajectory, original: Trajectory) -> ReplayInfo:
    """Mark each replayed tool call's ``output_equal`` and summarise (``replay``). For a
    harness-driven rollout, compare each call's prompt instead (:func:`_compare_prompts`)."""
    if original.segments:
        return _compare_prompts(replayed, original)
    got, want = _tool_outputs(replayed), _tool_outputs(original)
    calls = [(n, c) for n, turn in enumerate(replayed.turns) for c in turn.tool_calls]
    first: dict[str, Any] | None = None
    for i in range(max(len(got), len(want))):
        equal = i < len(got) and i < len(want) and got[i] == want[i]
        if i < len(calls):
            calls[i][1].output_equal = equal
        if not equal and first is None:
            first = {
                "turn": calls[i][0] if i < len(calls) else None,
                "call": i,
                "tool": calls[i][1].name if i < len(calls) else None,
                "recorded": want[i][:SHOWN_CHARS] if i < len(want) else None,
                "replayed": got[i][:SHOWN_CHARS] if i < len(got) else None,
            }
    return ReplayInfo(of=original.id, turns=min(len(replayed.turns), len(original.turns)),
                      tool_calls=len(got), tool_outputs_equal=first is None, first_difference=first)
