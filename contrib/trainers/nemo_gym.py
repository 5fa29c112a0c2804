"""NeMo-RL / NeMo-Gym: rolloutd behind a Gym agent server's ``POST /run``.

NeMo-RL runs each task as ``POST /run`` against the agent server named by the dataset's
``agent_ref`` and reads a ``BaseVerifyResponse``. :class:`RunApp` is a small ASGI app with
that route (serve it with hypercorn and name it in ``agent_ref``); :func:`run` is the same
logic as a function. Per request:

- the task is the body's ``task`` field (a rolloutd task), or the body's own fields with a
  ``kind`` (``task_fn`` maps other bodies); ``responses_create_params`` gives ``temperature``,
  ``top_p`` and ``max_output_tokens`` (the per-turn token limit);
- one rollout is submitted; an unusable one is resubmitted, and answered with
  ``mask_sample: true`` if it stays unusable (NeMo-RL then leaves it out of the loss but
  keeps the group's shape).

The answer (``nemo_gym/base_resources_server.py``, ``nemo_gym/openai_utils.py``):
``responses_create_params`` echoed; ``response`` an OpenAI Responses object whose ``output``
holds, per rolloutd turn, the assistant's ``message`` or its ``function_call`` items (the
first item of a turn carries ``prompt_token_ids = T.token_ids[:turn.start]``,
``generation_token_ids = T.token_ids[turn.start:turn.end]`` and ``generation_log_probs``;
later items of the same turn carry empty lists, so NeMo-RL's contiguity check holds), then
the tool results as ``function_call_output`` items (no ids); ``reward``; ``mask_sample``;
``failure_kind`` (``rolloutd:<error type>``, the ``<server>:<kind>`` form NeMo-Gym's failure
vocabulary asks of names it does not register) / ``failure_reason`` from the trajectory's
error. The answer is plain JSON (NeMo-Gym is not needed at run time): rolloutd's dev
environment installs nemo-gym 0.7.0 (``--no-deps``, see the Makefile), and
tests/trainers/test_adapters_real.py parses requests and answers with its own models
(``BaseRunRequest``, ``BaseVerifyResponse`` in ``nemo_gym/base_resources_server.py``) and checks
them with its ``assert_prefix_contiguity``. (NeMo-Gym requires ``responses_create_params.input``
in a ``/run`` body; this route does not, a rolloutd task holding its own prompt.)

**Segments** (harness-driven rollouts whose harness rewrote its history): one ``/run`` is one
sample, and NeMo-RL turns its ``output`` into one message log whose every item must extend all
the ids before it ("Non-contiguous messages found!" otherwise), so segments cannot follow one
another in one answer. The answer is the rollout's LAST segment: its calls
(``turn.segment``), with token ids from that segment, and the assistant messages matched to
them from the end of ``T.messages``. ``response.metadata`` (the Responses object's string map)
records ``rolloutd_segments`` (how many the rollout had) and ``rolloutd_segments_left_out``
(how many are not trained on): ``"1"`` and ``"0"`` for a built-in-loop rollout.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rolloutd.daemon.client import AsyncClient
from rolloutd.daemon.trajectory import Trajectory
from rolloutd.trainers._common import arun_group, last_sequence, segment_info

RUN_FIELDS = ("responses_create_params", "agent_ref", "_ng_rollout_id", "_ng_task_index",
              "_ng_rollout_index")


def default_task(body: Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(body.get("task"), Mapping):
        return dict(body["task"])
    if "kind" in body:
        return {k: v for k, v in body.items() if k not in RUN_FIELDS}
    raise ValueError("the /run body has no rolloutd task: give 'task' or the task's fields with 'kind'")


def _tokens(t: Trajectory, start: int, end: int) -> dict[str, Any]:
    return {"prompt_token_ids": list(t.token_ids[:start]),
            "generation_token_ids": list(t.token_ids[start:end]),
            "generation_log_probs": [float(x or 0.0) for x in t.logprobs[start:end]]}


_EMPTY: dict[str, list[Any]] = {"prompt_token_ids": [], "generation_token_ids": [], "generation_log_probs": []}


def output_items(t: Trajectory) -> list[dict[str, Any]]:
    """The Responses ``output`` list for a trajectory (see the module doc)."""
    items: list[dict[str, Any]] = []
    turns = iter(enumerate(t.turns))
    pending: list[str] = []  # call ids of the last turn's calls, answered in order
    for m in t.messages[len(t.messages) - _tail_len(t):]:
        role = m.get("role")
        if role == "tool":
            call_id = pending.pop(0) if pending else f"call_{t.id}_note{len(items)}"
            items.append({"type": "function_call_output", "call_id": call_id, "output": str(m.get("content", ""))})
            continue
        if role != "assistant":
            continue  # a nudge (user turn): it reappears in the next item's prompt_token_ids
        step = next(turns, None)
        if step is None:
            break
        n, turn = step
        tokens = _tokens(t, turn.start, turn.end)
        calls = m.get("tool_calls") or []
        if not calls:
            items.append({"type": "message", "id": f"msg_{t.id}_{n}", "role": "assistant",
                          "status": "completed",
                          "content": [{"type": "output_text", "text": m.get("content") or "", "annotations": []}],
                          **tokens})
            continue
        pending = []
        for k, call in enumerate(calls):
            fn = call.get("function", {})
            call_id = f"call_{t.id}_{n}_{k}"
            pending.append(call_id)
            items.append({"type": "function_call", "id": f"fc_{t.id}_{n}_{k}", "call_id": call_id,
                          "name": fn.get("name", ""), "arguments": json.dumps(fn.get("arguments", {})),
                          "status": "completed", **(tokens if k == 0 else _EMPTY)})
    return items


def _tail_len(t: Trajectory) -> int:
    """How many messages the agent loop appended (from the first generated assistant message)."""
    if not t.turns:
        return 0
    seen = 0
    for i in range(len(t.messages) - 1, -1, -1):
        if t.messages[i].get("role") == "assistant":
            seen += 1
            if seen == len(t.turns):
                return len(t.messages) - i
    return len(t.messages)


def verify_response(rollout: Trajectory, params: Mapping[str, Any]) -> dict[str, Any]:
    """A ``BaseVerifyResponse`` dict for one trajectory: its last sequence (see the module doc)."""
    t, left_out = last_sequence(rollout)
    info = segment_info(rollout, left_out)
    status = "completed" if t.usable else ("failed" if t.error else "incomplete")
    response = {
        "id": f"resp_{t.id}", "object": "response", "created_at": int(time.time()),
        "model": params.get("model") or "rolloutd", "status": status, "output": output_items(t),
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": list(params.get("tools") or []),
        "usage": {"input_tokens": t.turns[0].start if t.turns else len(t.token_ids),
                  "output_tokens": sum(t.loss_mask), "total_tokens": len(t.token_ids),
                  # required by the Responses usage object (NeMo-Gym's NeMoGymResponse)
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        "metadata": {"rolloutd_segments": str(info["segments"]),
                     "rolloutd_segments_left_out": str(info["segments_left_out"])},
    }
    body: dict[str, Any] = {"responses_create_params": dict(params), "response": response,
                            "reward": float(t.reward or 0.0), "mask_sample": not t.usable}
    if t.error is not None:
        body["failure_kind"] = failure_kind(t.error.type)
        body["failure_reason"] = f"{t.error.stage}: {t.error.message}"
    return body


def failure_kind(error_type: str) -> str:
    """``rolloutd:<error type>`` in snake case: NeMo-Gym's ``<server>:<kind>`` form."""
    kind = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", error_type).lower()
    kind = re.sub(r"[^a-z0-9_]+", "_", kind).strip("_")
    if not kind or not kind[0].isalpha():
        kind = f"error_{kind}".rstrip("_")
    return f"rolloutd:{kind}"


async def run(
    client: AsyncClient, body: Mapping[str, Any], *,
    task_fn: Callable[[Mapping[str, Any]], Mapping[str, Any]] = default_task, max_resubmits: int = 2,
    **options: Any,
) -> dict[str, Any]:
    """Handle one ``/run`` body: submit, resubmit if unusable, answer ``BaseVerifyResponse``."""
    params = dict(body.get("responses_create_params") or {})
    sampling = {k: params[k] for k in ("temperature", "top_p") if params.get(k) is not None}
    limits = dict(options.pop("limits", {}) or {})
    if params.get("max_output_tokens"):
        limits["max_tokens_per_turn"] = int(params["max_output_tokens"])
    rid = body.get("_ng_rollout_id")
    group = await arun_group(client, task_fn(body), 1, group_id=f"gym-{rid}" if rid else None,
                             max_resubmits=max_resubmits, sampling=sampling or None,
                             limits=limits or None, **options)
    return verify_response(group.rollouts[0], params)


class RunApp:
    """ASGI: ``POST /run`` (a Gym agent server's route) in front of a rolloutd daemon."""

    def __init__(self, rolloutd_url: str, **run_options: Any) -> None:
        self.url = rolloutd_url
        self.options = run_options

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        if (scope["method"], scope["path"]) != ("POST", "/run"):
            await _send(send, 404, {"detail": "Not Found"})
            return
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            async with AsyncClient(self.url) as client:
                answer = await run(client, body, **self.options)
        except ValueError as exc:
            await _send(send, 422, {"detail": str(exc)})
            return
        await _send(send, 200, answer)


async def _send(send: Callable[[dict[str, Any]], Awaitable[None]], status: int, obj: Any) -> None:
    data = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
