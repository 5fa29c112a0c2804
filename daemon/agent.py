"""The agent loop: an LLM turn, its tool calls, their observations, until done.

Token bookkeeping (DESIGN section 3): the trajectory's ``token_ids`` start with the rendered
prompt (loss mask 0, logprob null); each turn appends exactly the ids the backend sampled
(loss mask 1, the backend's logprobs), then the observation delta tokenized alone (loss mask
0). The trajectory is written incrementally, in synchronous steps between awaits, so when the
caller's deadline (``trio.fail_after``) or a cancel interrupts the loop, ``token_ids``,
``loss_mask`` and ``logprobs`` still have equal lengths and every recorded turn is complete.

The loop ends (``trajectory.finish_reason``) on:

- ``stop``: a turn without tool calls; its text is the answer (unless
  ``AgentLimits.require_tool_call``, which answers such a turn with a nudge and goes on);
- ``finish_tool``: a tool reported ``finished`` (the finish tool); its ``answer`` is returned;
- ``max_tokens``: a turn without tool calls cut by the per-turn token limit;
- ``max_turns``, ``max_total_tokens``, ``context_full``: a limit stopped it;
- ``abort``: the backend aborted the request.

Malformed tool calls are answered with an observation saying what was wrong (the rollout
goes on). Infrastructure failures raise: ``rolloutd.daemon.llm.LLMError`` (no backend, bad response,
:class:`PrefixMismatch`) and the toolbox's ``ToolError``; the pipeline records them as the
trajectory's error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import trio
from pydantic import BaseModel, ConfigDict, Field

from rolloutd.daemon.llm.base import Completion, PrefixMismatch, SamplingParams
from rolloutd.daemon.llm.chat import ChatRenderer, check_extends
from rolloutd.daemon.llm.parsers import ParsedTurn, error_observation, get_parser
from rolloutd.daemon.trajectory import ToolCallRecord, Trajectory, Turn

if TYPE_CHECKING:
    from rolloutd.daemon.llm.pool import BackendPool
    from rolloutd.daemon.tasks.base import Prompt


class AgentLimits(BaseModel):
    """Per-rollout limits of the loop: the one definition, also the ``limits`` field of
    ``POST /v1/rollouts`` and ``POST /v1/batches``, so every limit can be set over HTTP."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    max_turns: int = Field(8, ge=1, le=1000, description="LLM turns at most.")
    max_tokens_per_turn: int = Field(512, ge=1, le=1_000_000, description="Sampled tokens per turn at most.")
    max_total_tokens: int = Field(
        8192, ge=1, le=10_000_000, description="Sampled tokens over the whole rollout at most."
    )
    tool_timeout_s: float = Field(30.0, gt=0, le=86_400, description="Deadline of one tool call.")
    #: mini-swe-agent's format-error policy: the model gets :data:`NUDGE` as a user turn.
    #: Off by default: a plain answer ends the rollout.
    require_tool_call: bool = Field(
        False,
        description="With tools, a turn without a tool call does not end the rollout: the model "
        "is told to call a tool or finish, and goes on until finish or a limit.",
    )


NUDGE = "You did not call a tool. Call one of the tools, or call finish with your final answer."


class _ToolResult(Protocol):
    output: str
    ok: bool
    exit_code: int | None
    timed_out: bool
    finished: bool
    answer: str | None
    latency_s: float


class ToolboxLike(Protocol):
    """What the loop needs of ``tools.Toolbox`` (CONTRACTS.md)."""

    def schemas(self) -> list[dict[str, Any]]: ...

    async def call(self, name: str, arguments: dict[str, Any], *, timeout_s: float) -> _ToolResult: ...


def _append(tr: Trajectory, ids: Sequence[int], *, sampled: bool, logprobs: Sequence[float] = ()) -> None:
    tr.token_ids.extend(ids)
    tr.loss_mask.extend([1 if sampled else 0] * len(ids))
    tr.logprobs.extend(list(logprobs) if sampled else [None] * len(ids))


def _assistant_message(text: str, parsed: ParsedTurn) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if parsed.calls:
        msg["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls
        ]
    return msg


async def run_agent(
    *,
    trajectory: Trajectory,
    prompt: Prompt,
    pool: BackendPool,
    renderer: ChatRenderer,
    toolbox: ToolboxLike | None,
    params: SamplingParams,
    limits: AgentLimits,
    sticky_key: str,
    group_key: str | None,
    origin: float | None = None,
) -> str | None:
    """Run the loop, filling ``trajectory``; return the final answer (or None).

    ``origin`` (a ``trio.current_time()``, by default now) is what the turns' and tool calls'
    ``start_s`` count from: the pipeline passes the rollout's submit time."""
    tr = trajectory
    origin = trio.current_time() if origin is None else origin
    parser = get_parser(renderer.family.parser)
    schemas = toolbox.schemas() if toolbox is not None else []
    params = params.model_copy(
        update={"stop_token_ids": sorted(set(params.stop_token_ids) | set(renderer.stop_ids))}
    )
    dropping = renderer.think_ids is not None
    if dropping:
        tr.labels.append("reasoning-dropped")

    prompt_ids = renderer.render_prompt(prompt.messages, schemas)
    _append(tr, prompt_ids, sampled=False)
    tr.prompt_length = len(prompt_ids)
    tr.messages.extend(dict(m) for m in prompt.messages)
    context = list(prompt_ids)  # what the backend sees (== token_ids unless reasoning is dropped)
    sampled_total = 0
    answer: str | None = None

    for turn_no in range(limits.max_turns):
        budget = min(
            limits.max_tokens_per_turn,
            renderer.context_length - len(context),
            limits.max_total_tokens - sampled_total,
        )
        if budget <= 0:
            tr.finish_reason = "context_full" if renderer.context_length <= len(context) else "max_total_tokens"
            return answer
        t0 = trio.current_time()
        try:
            c: Completion = await pool.complete(
                context, params.for_call(tr.sample_index, turn_no), max_tokens=budget,
                sticky_key=sticky_key, group_key=group_key,
            )
        finally:
            llm_s = trio.current_time() - t0
            tr.timing.llm_s += llm_s
        start = len(tr.token_ids)
        _append(tr, c.token_ids, sampled=True, logprobs=c.logprobs)
        sampled_total += len(c.token_ids)
        switches = c.extra.get("switches") or []
        turn = Turn(
            start=start,
            end=len(tr.token_ids),
            backend=str(c.extra.get("backend_id") or c.backend),
            policy_version_start=int(c.extra.get("policy_version_start", 0)),  # type: ignore[call-overload]
            policy_version_end=int(c.extra.get("policy_version_end", 0)),  # type: ignore[call-overload]
            finish_reason=c.finish_reason,
            retries=int(c.extra.get("retries", 0)),  # type: ignore[call-overload]
            backend_switches=[str(s) for s in switches],  # type: ignore[attr-defined]
            llm_s=llm_s,
            start_s=round(t0 - origin, 6),
        )
        tr.turns.append(turn)

        text = renderer.turn_text(c.token_ids)
        parsed = parser(text) if toolbox is not None else ParsedTurn(content=text.strip())
        tr.messages.append(_assistant_message(text, parsed))
        if c.finish_reason == "abort":
            tr.finish_reason = "abort"
            return answer
        nudge = toolbox is not None and limits.require_tool_call and not parsed.has_tool_activity
        if toolbox is None or not (parsed.has_tool_activity or nudge):
            tr.finish_reason = "max_tokens" if c.finish_reason == "length" else "stop"
            return parsed.content
        if nudge:
            answer = parsed.content

        outputs: list[str] = []
        for call in parsed.calls:
            t1 = trio.current_time()
            res = await toolbox.call(call.name, call.arguments, timeout_s=limits.tool_timeout_s)
            took = trio.current_time() - t1
            tr.timing.tool_s += took
            turn.tool_calls.append(
                ToolCallRecord(
                    name=call.name,
                    arguments=call.arguments,
                    exit_code=res.exit_code,
                    ok=res.ok,
                    latency_s=res.latency_s or took,
                    error=None if res.ok else ("timed out" if res.timed_out else res.output[:500]),
                    start_s=round(t1 - origin, 6),
                )
            )
            tr.messages.append({"role": "tool", "name": call.name, "content": res.output})
            outputs.append(res.output)
            if res.finished:
                tr.finish_reason = "finish_tool"
                return res.answer
        if parsed.errors:
            note = error_observation(parsed.errors)
            for err in parsed.errors:
                turn.tool_calls.append(ToolCallRecord(name="<malformed>", ok=False, error=err.message))
            tr.messages.append({"role": "tool", "content": note})
            outputs.append(note)

        if turn_no == limits.max_turns - 1:
            break
        if nudge:
            tr.messages.append({"role": "user", "content": NUDGE})
            delta = renderer.user_ids(NUDGE)
        else:
            delta = renderer.observation_ids(outputs)
        appended = [*renderer.close_turn(c.token_ids), *delta]
        new_context = [*context, *renderer.context_of_turn(c.token_ids), *appended]
        if len(new_context) >= renderer.context_length:
            tr.finish_reason = "context_full"
            return answer
        try:
            check_extends(context, new_context)
            _append(tr, appended, sampled=False)
            if not dropping and new_context != tr.token_ids:
                raise PrefixMismatch("the backend context and the trajectory diverged", position=len(context))
        except PrefixMismatch as exc:
            turn.error = str(exc)
            tr.finish_reason = "error"
            raise
        context = new_context
    tr.finish_reason = "max_turns"
    return answer
