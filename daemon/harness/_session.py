"""One rollout's LLM calls from a harness: limits, sampling, and segment assembly.

Every call becomes a prompt of token ids, sampled token-in/token-out on the group's sticky
backend (``BackendPool.complete``), and is recorded exactly:

- **Prompt.** A chat call whose messages repeat an earlier call's messages and the reply
  rolloutd gave it, followed only by tool results or by one user message, is rendered
  *incrementally*: that call's ids, its exact sampled ids, the end token if the turn was cut,
  and the new messages as a template delta (``ChatRenderer.observation_ids`` / ``user_ids``,
  checked against the tokenizer's own template when the renderer is built). Anything else
  (a first call, a rewritten or truncated history, other tools) is rendered whole with the
  chat template. A completions call brings its own prompt (text, or token ids).
- **Segments.** A call whose prompt starts with all the tokens of an existing segment joins
  it: what the harness added goes in with loss mask 0, the sampled ids with loss mask 1 and
  the backend's logprobs. Otherwise the call starts a new segment. So a harness that resends
  its history unchanged yields one sequence, and one that rewrites it (truncation, a summary,
  a dropped reply, a sub-agent) yields one exact sequence per history.
- **Limits.** ``AgentLimits`` apply per rollout: ``max_turns`` calls, ``max_tokens_per_turn``
  per call (the request's own ``max_tokens`` may ask for less), ``max_total_tokens`` sampled
  in all. A call over a limit, or whose prompt fills the context, is refused with an API
  error (:class:`ApiError`, HTTP 400) the harness can show; the rollout goes on.
- **Sampling.** The rollout's sampling parameters (the trainer's) apply to every call; what a
  harness asks for (temperature, top_p, seed) is ignored, so that every sampled token comes
  from the policy the trainer expects.

An infrastructure failure (no backend, a response we cannot trust) is not the harness's doing:
the call gets HTTP 503 and the session keeps the error, which fails the rollout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from rolloutd.daemon.harness._errors import ApiError
from rolloutd.daemon.harness._messages import Message, message_key, same_history, tools_key
from rolloutd.daemon.llm.base import BackendRejected, Completion, LLMError, SamplingParams
from rolloutd.daemon.llm.openai_api import (
    ReadMessages,
    parse_reply,
    template_knows_tools,
    template_messages,
)
from rolloutd.daemon.llm.parsers import ParsedTurn, get_parser
from rolloutd.daemon.trajectory import HarnessInfo, Segment, Trajectory, Turn

if TYPE_CHECKING:
    from rolloutd.daemon.agent import AgentLimits
    from rolloutd.daemon.llm.chat import ChatRenderer
    from rolloutd.daemon.llm.pool import BackendPool


#: A whole render of messages with more text than this runs in a worker thread.
THREAD_RENDER_CHARS = 32_000


@dataclass
class Chat:
    """A chat call's result: the completion, its text and the reply in canonical form."""

    completion: Completion
    prompt_ids: list[int]
    text: str
    parsed: ParsedTurn
    reply: Message


@dataclass
class _History:
    """What a segment's last chat call saw and answered (for incremental rendering)."""

    segment: int
    keys: list[tuple[Any, ...]]  # message_key of each message, the reply included
    tools: str
    ids: list[int]
    sampled: list[int] = field(default_factory=list)


class Session:
    def __init__(self, *, trajectory: Trajectory, pool: BackendPool, renderer: ChatRenderer,
                 params: SamplingParams, limits: AgentLimits, sticky_key: str,
                 group_key: str | None, origin: float) -> None:
        self.trajectory = trajectory
        self.pool = pool
        self.renderer = renderer
        self.limits = limits
        self.sticky_key = sticky_key
        self.group_key = group_key
        self.origin = origin
        self.params = params.model_copy(update={
            "stop_token_ids": sorted(set(params.stop_token_ids) | set(renderer.stop_ids))})
        self.parser = get_parser(renderer.family.parser)
        self.info = trajectory.harness if trajectory.harness is not None else HarnessInfo()
        trajectory.harness = self.info
        self.started = 0
        self.sampled_total = 0
        self.fatal: LLMError | None = None
        self.failed = trio.Event()  # set with ``fatal``: RUN stops the harness and fails
        self.final_text: str | None = None
        self.conversation: list[Message] = []
        #: What the OpenAI route read last (its next request reuses what it repeats).
        self.read_messages: ReadMessages | None = None
        self._last_keyed: tuple[list[Message], list[tuple[Any, ...]]] = ([], [])
        self._histories: list[_History] = []
        self._knows_tools = template_knows_tools(renderer)

    # ---- the two kinds of call ----------------------------------------------------------

    async def chat(self, messages: list[Message], tools: list[dict[str, Any]], *,
                   max_tokens: int | None) -> Chat:
        keys = self._keys(messages)
        prompt = await self._chat_prompt(messages, keys, tools)
        c, segment = await self._sample(prompt, max_tokens)
        text = self.renderer.turn_text(c.token_ids)
        parsed, reply = parse_reply(text, tools, self.parser)
        self._remember(_History(segment, [*keys, message_key(reply)], tools_key(tools), prompt,
                                c.token_ids))
        self.conversation = [*messages, reply]  # the trajectory's messages, at the end
        self.final_text = reply["content"]
        return Chat(c, prompt, text, parsed, reply)

    def _keys(self, messages: list[Message]) -> list[tuple[Any, ...]]:
        """``message_key`` of each message; messages that are the very objects of the last
        call's (``openai_messages`` reuses what a harness repeats) keep their keys."""
        last, keys = self._last_keyed
        n = 0
        for a, b in zip(messages, last, strict=False):
            if a is not b:
                break
            n += 1
        out = keys[:n] + [message_key(m) for m in messages[n:]]
        self._last_keyed = (messages, out)
        return out

    def close(self) -> None:
        """At the end of RUN: the last chat call's conversation becomes the trajectory's
        ``messages`` (converted once, not at every call)."""
        if self.conversation:
            self.trajectory.messages = template_messages(self.conversation, knows_tools=True)

    async def complete(self, prompt_ids: list[int], *, max_tokens: int | None) -> Completion:
        c, _ = await self._sample(prompt_ids, max_tokens)
        self.final_text = self.renderer.turn_text(c.token_ids)
        return c

    # ---- prompts ----------------------------------------------------------------------------

    async def _chat_prompt(self, messages: list[Message], keys: list[tuple[Any, ...]],
                           tools: list[dict[str, Any]]) -> list[int]:
        key = tools_key(tools)
        for h in reversed(self._histories):
            if h.tools != key or len(keys) <= len(h.keys) or not same_history(h.keys, keys):
                continue
            delta = self._delta(messages[len(h.keys):])
            if delta is None:
                break
            return [*h.ids, *h.sampled, *self.renderer.close_turn(h.sampled), *delta]
        msgs = template_messages(messages, knows_tools=self._knows_tools)
        size = sum(len(m.get("content") or "") for m in msgs)
        try:
            if size < THREAD_RENDER_CHARS:
                return self.renderer.render_prompt(msgs, tools)
            # a long history: the template and the tokenizer would hold the event loop
            return await trio.to_thread.run_sync(self.renderer.render_prompt, msgs, tools)
        except Exception as exc:  # the template rejects this conversation
            raise ApiError(400, f"the chat template cannot render these messages: {exc}",
                           param="messages") from None

    def _delta(self, new: Sequence[Mapping[str, Any]]) -> list[int] | None:
        """The template delta for messages appended after an assistant reply, or None when
        only a whole render is exact (a mix of roles, a system or assistant message)."""
        roles = {m["role"] for m in new}
        if roles == {"tool"}:
            return self.renderer.observation_ids([m.get("content") or "" for m in new])
        if roles == {"user"} and len(new) == 1:
            return self.renderer.user_ids(new[0].get("content") or "")
        return None

    def _remember(self, h: _History) -> None:
        self._histories = [x for x in self._histories if x.segment != h.segment]
        self._histories.append(h)

    # ---- sampling and recording -------------------------------------------------------------

    def _budget(self, prompt: Sequence[int], asked: int | None) -> int:
        lim = self.limits
        if self.started >= lim.max_turns:
            self.info.refused_calls += 1
            raise ApiError(400, f"this rollout's limit of {lim.max_turns} LLM calls is reached "
                           "(limits.max_turns)", code="rollout_budget_exhausted")
        left = lim.max_total_tokens - self.sampled_total
        if left <= 0:
            self.info.refused_calls += 1
            raise ApiError(400, f"this rollout's limit of {lim.max_total_tokens} sampled tokens is "
                           "reached (limits.max_total_tokens)", code="rollout_budget_exhausted")
        room = self.renderer.context_length - len(prompt)
        if room <= 0:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; the model's context is "
                           f"{self.renderer.context_length}", code="context_length_exceeded",
                           param="messages")
        return max(1, min(lim.max_tokens_per_turn, asked or lim.max_tokens_per_turn, room, left))

    async def _sample(self, prompt: list[int], asked: int | None) -> tuple[Completion, int]:
        if self.fatal is not None:
            raise ApiError(503, f"this rollout has failed: {self.fatal}", kind="server_error")
        budget = self._budget(prompt, asked)
        params = self.params.for_call(self.trajectory.sample_index, self.started)
        self.started += 1
        t0 = trio.current_time()
        try:
            c = await self.pool.complete(prompt, params, max_tokens=budget,
                                         sticky_key=self.sticky_key, group_key=self.group_key)
        except BackendRejected as exc:
            self.info.refused_calls += 1
            raise ApiError(400, f"the model server refused the request: {exc}") from None
        except LLMError as exc:
            self.fatal = exc
            self.failed.set()
            raise ApiError(503, f"no model answered: {exc}", kind="server_error") from None
        finally:
            llm_s = trio.current_time() - t0
            self.trajectory.timing.llm_s += llm_s
        return c, self._record(prompt, c, t0, llm_s)

    def _record(self, prompt: list[int], c: Completion, t0: float, llm_s: float) -> int:
        """Put one call's tokens into its segment (a new one if it extends none); its index."""
        tr = self.trajectory
        index = None
        for i in reversed(range(len(tr.segments))):
            ids = tr.segments[i].token_ids
            if len(prompt) >= len(ids) and prompt[: len(ids)] == ids:
                index = i
                break
        merged = index is not None
        if index is None:
            tr.segments.append(Segment(prompt_length=len(prompt)))
            index = len(tr.segments) - 1
        seg = tr.segments[index]
        added = prompt[len(seg.token_ids):]
        seg.token_ids.extend(added)
        seg.loss_mask.extend([0] * len(added))
        seg.logprobs.extend([None] * len(added))
        start = len(seg.token_ids)
        seg.token_ids.extend(c.token_ids)
        seg.loss_mask.extend([1] * len(c.token_ids))
        seg.logprobs.extend(c.logprobs)
        seg.calls += 1
        self.sampled_total += len(c.token_ids)
        self.info.calls += 1
        self.info.merged_calls += int(merged)
        switches = c.extra.get("switches") or []
        tr.turns.append(Turn(
            start=start, end=len(seg.token_ids),
            backend=str(c.extra.get("backend_id") or c.backend),
            policy_version_start=int(c.extra.get("policy_version_start", 0)),  # type: ignore[call-overload]
            policy_version_end=int(c.extra.get("policy_version_end", 0)),  # type: ignore[call-overload]
            finish_reason=c.finish_reason, retries=int(c.extra.get("retries", 0)),  # type: ignore[call-overload]
            backend_switches=[str(s) for s in switches],  # type: ignore[attr-defined]
            llm_s=llm_s, start_s=round(t0 - self.origin, 6), segment=index, merged=merged,
        ))
        last = tr.segments[-1]
        tr.token_ids, tr.loss_mask, tr.logprobs = list(last.token_ids), list(last.loss_mask), list(last.logprobs)
        tr.prompt_length = last.prompt_length
        return index
