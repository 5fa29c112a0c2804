"""The data a trainer consumes: a trajectory, its turns, reward and timings.

These models are the wire format of ``GET /v1/rollouts/{id}`` and of the NDJSON streams,
and the in-memory record the pipeline stages fill in. Token fields are the canonical
representation: ``token_ids`` holds exactly what the model saw and sampled, ``loss_mask``
is 1 on sampled tokens, ``logprobs`` carries the sampled-token logprob where the mask is 1.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field


class Status(StrEnum):
    queued = "queued"
    init = "init"
    run = "run"
    eval = "eval"
    completed = "completed"
    failed = "failed"
    timed_out = "timed_out"
    cancelled = "cancelled"
    lost = "lost"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({Status.completed, Status.failed, Status.timed_out, Status.cancelled, Status.lost})


class Stage(StrEnum):
    queue = "queue"
    init = "init"
    run = "run"
    eval = "eval"


class ErrorInfo(BaseModel):
    stage: str
    type: str
    message: str


class ToolCallRecord(BaseModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    exit_code: int | None = None
    ok: bool = True
    latency_s: float = 0.0
    error: str | None = None
    start_s: float | None = Field(
        None, description="When the call started, in seconds since the rollout was submitted."
    )
    output_equal: bool | None = Field(
        None, description="In a replay: whether the output equals the recorded call's output."
    )


class Turn(BaseModel):
    """One LLM call: ``token_ids[start:end]`` are the sampled ids of this turn."""

    start: int
    end: int
    backend: str | None = None
    policy_version_start: int = 0
    policy_version_end: int = 0
    finish_reason: str | None = None
    retries: int = 0
    backend_switches: list[str] = Field(default_factory=list)
    llm_s: float = 0.0
    start_s: float | None = Field(
        None, description="When the LLM call started, in seconds since the rollout was submitted."
    )
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    error: str | None = None
    segment: int | None = Field(
        None, description="Harness-driven rollouts: the index of the segment this call's tokens "
        "are in; ``start``/``end`` are then offsets into that segment's ``token_ids``.")
    merged: bool | None = Field(
        None, description="Harness-driven rollouts: whether this call's prompt extended the "
        "previous call of its segment (True) or started the segment (False).")


class Segment(BaseModel):
    """One token-exact sequence of a harness-driven rollout (DESIGN section 13).

    ``token_ids[:prompt_length]`` is the first call's rendered prompt; every later call of the
    segment rendered a prompt that extended everything before it, so its sampled ids follow
    with loss mask 1 and the backend's logprobs, and what the harness added in between
    (tool results, user turns) with loss mask 0 and logprob null."""

    token_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float | None] = Field(default_factory=list)
    prompt_length: int = 0
    calls: int = Field(0, description="LLM calls whose tokens are in this segment.")


class HarnessInfo(BaseModel):
    """How a harness-driven rollout's agent command ran (``task.agent``)."""

    command: list[str] = Field(default_factory=list)
    exit_code: int | None = Field(None, description="The command's exit status; null when it "
                                  "was cut (timeout, budget, cancel) before it exited.")
    ended: str | None = Field(None, description="exited, timeout (agent.timeout_s), or the "
                              "rollout's own end (deadline, cancel).")
    calls: int = Field(0, description="LLM calls answered with a completion.")
    merged_calls: int = Field(0, description="Calls whose tokens joined an earlier call's segment.")
    refused_calls: int = Field(0, description="Calls refused with an API error (limits, bad input).")
    output_tail: str = Field("", description="The end of the command's stdout and stderr.")


class Timing(BaseModel):
    queue_s: float = 0.0
    init_s: float = 0.0
    run_s: float = 0.0
    eval_s: float = 0.0
    llm_s: float = 0.0
    tool_s: float = 0.0
    total_s: float = 0.0
    #: When each stage started, in seconds since the rollout was submitted (None: not reached).
    init_start_s: float | None = None
    run_start_s: float | None = None
    eval_start_s: float | None = None


class ReplayInfo(BaseModel):
    """A replay's comparison with the rollout it replays (``POST /v1/rollouts/{id}/replay``)."""

    of: str = Field(description="The id of the replayed rollout.")
    turns: int = Field(0, description="Recorded turns fed back.")
    tool_calls: int = Field(0, description="Tool calls compared.")
    tool_outputs_equal: bool | None = Field(
        None, description="Whether every tool output equals the recorded one (None until compared)."
    )
    first_difference: dict[str, Any] | None = Field(
        None, description="The first tool call whose output differs: turn, call, recorded, replayed."
    )


class Trajectory(BaseModel):
    id: str
    group_id: str | None = None
    batch_id: str | None = Field(None, description="The dynamic-sampling batch (`POST /v1/batches`) "
                                 "the rollout was sampled for; null for a rollout submitted alone.")
    task_id: str | None = None
    sample_index: int = 0
    node_id: str | None = Field(None, description="The daemon (its federation node id) that ran "
                                "the rollout: where it was queued, or the peer that took it over.")
    status: Status = Status.queued
    usable: bool = False
    reward: float | None = None
    reward_info: dict[str, Any] = Field(default_factory=dict)
    error: ErrorInfo | None = None
    token_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float | None] = Field(default_factory=list)
    prompt_length: int = 0
    turns: list[Turn] = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    finish_reason: str | None = None
    timing: Timing = Field(default_factory=Timing)
    labels: list[str] = Field(default_factory=list)
    replay: ReplayInfo | None = None
    segments: list[Segment] = Field(
        default_factory=list,
        description="Harness-driven rollouts: every token-exact sequence, in order; a new one "
        "each time the harness rewrote its history. The top-level ``token_ids``, ``loss_mask`` "
        "and ``logprobs`` repeat the last one. Empty for the built-in agent loop.")
    harness: HarnessInfo | None = Field(None, description="Harness-driven rollouts: the agent command.")

    def sequences(self) -> list[Segment]:
        """What a trainer trains on: the segments, or the one sequence of a built-in loop."""
        if self.segments:
            return list(self.segments)
        return [Segment(token_ids=list(self.token_ids), loss_mask=list(self.loss_mask),
                        logprobs=list(self.logprobs), prompt_length=self.prompt_length,
                        calls=len(self.turns))]
