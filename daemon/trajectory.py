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
