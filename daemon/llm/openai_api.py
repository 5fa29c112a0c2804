"""OpenAI chat completions, shared by every endpoint that serves them.

One definition of the request and response shapes for ``POST /v1/chat/completions``, used by
the per-rollout harness endpoint (:mod:`rolloutd.daemon.harness`) and by
``rolloutd model-server`` (:mod:`rolloutd.daemon.llm.model_server`):

- **Request.** :func:`openai_messages` / :func:`openai_tools` read OpenAI messages and tools
  into *canonical messages* (``role``, ``content`` text, an assistant's ``tool_calls`` as
  ``[{"name", "arguments"}]``); :func:`template_messages` turns those into what a chat
  template reads; :func:`parse_chat_request` reads a whole body into a :class:`ChatRequest`.
- **Reply.** :func:`parse_reply` parses a turn's text (hermes ``<tool_call>`` blocks, or the
  family's parser) into the canonical assistant message.
- **Response.** :func:`chat_response` builds ``chat.completion`` (message content and
  ``tool_calls``, ``finish_reason`` ``tool_calls`` / ``stop`` / ``length``, ``usage``,
  ``logprobs.content``; with vLLM's ``return_token_ids`` ``prompt_token_ids`` top-level and
  ``choices[0].token_ids``; with ``prompt_logprobs`` vLLM's top-level ``prompt_logprobs``), and
  :func:`chat_chunks` the same answer as server-sent ``chat.completion.chunk`` events (sent
  once the completion is sampled: the backends answer whole completions).

A request this module refuses raises :class:`RequestError` (HTTP status, message, ``param``);
each server answers it in its own error shape.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rolloutd.daemon.llm.base import Completion, LLMError
from rolloutd.daemon.llm.parsers import ParsedTurn

if TYPE_CHECKING:
    from rolloutd.daemon.llm.chat import ChatRenderer

Message = dict[str, Any]


class RequestError(LLMError, ValueError):
    """A chat request refused with ``status`` (400 unless told); ``param`` names the field."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def _bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(message, param=param)


# ---- request --------------------------------------------------------------------------------

def text_parts(content: Any, where: str) -> str:
    """Text of a content field: a string, null, or a list of text parts/blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
                continue
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"{where}[{i}]: only text content is supported, not {kind!r}", where)
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"{where}[{i}].text must be a string", where)
            out.append(text)
        return "".join(out)
    raise _bad(f"{where} must be a string, null or a list of text parts", where)


def tool_arguments(raw: Any) -> Any:
    """A call's arguments as a JSON object, or the raw value when it is not one."""
    if isinstance(raw, Mapping):
        return dict(raw)
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw
        return value if isinstance(value, dict) else raw
    return raw


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool", "function": "tool"}


@dataclass
class ReadMessages:
    """The raw messages of one request and what :func:`openai_messages` read from them: the
    next request of the same conversation reuses what it repeats."""

    raw: list[Any]
    messages: list[Message]


def openai_messages(raw: Any, *, previous: ReadMessages | None = None) -> list[Message]:
    """OpenAI chat messages in canonical form. Called on a harness's whole history at every
    call, so the common case (a known role, string content, no tool calls) takes no detour,
    and with ``previous`` a history that starts with the previous request's raw messages (a
    comparison done in C) reuses their canonical forms (the same objects) and reads only what
    follows."""
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list", "messages")
    out: list[Message] = []
    start = 0
    if previous is not None and len(previous.raw) <= len(raw) and raw[: len(previous.raw)] == previous.raw:
        out, start = list(previous.messages), len(previous.raw)
    for i in range(start, len(raw)):
        m = raw[i]
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = _ROLES.get(m.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise _bad(f"messages[{i}].role must be system, developer, user, assistant or tool; "
                       f"got {m.get('role')!r}", f"messages[{i}]")
        content = m.get("content")
        if content.__class__ is not str:
            content = text_parts(content, f"messages[{i}].content")
        msg: Message = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}]")
        elif role == "tool" and isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls must be a list", where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}.tool_calls[{j}] needs function.name", where)
        out.append({"name": fn["name"], "arguments": tool_arguments(fn.get("arguments"))})
    return out


def openai_tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
        out.append({"type": "function", "function": dict(fn)})
    return out


def hermes_call_text(call: Mapping[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": call["name"], "arguments": call["arguments"]},
                                        ensure_ascii=False) + "\n</tool_call>"


def template_messages(messages: Sequence[Mapping[str, Any]], *, knows_tools: bool) -> list[Message]:
    """Messages as a chat template reads them: tool calls as the template's own ``tool_calls``
    when it knows tools, else written into the content the way the model writes them
    (hermes ``<tool_call>`` blocks)."""
    out: list[Message] = []
    for m in messages:
        msg: Message = {"role": m["role"], "content": m.get("content") or ""}
        calls = m.get("tool_calls") or []
        if calls and knows_tools:
            msg["tool_calls"] = [{"type": "function", "function": {"name": c["name"],
                                                                   "arguments": c["arguments"]}}
                                 for c in calls]
        elif calls:
            blocks = "\n".join(hermes_call_text(c) for c in calls)
            msg["content"] = f"{msg['content']}\n{blocks}" if msg["content"] else blocks
        if m["role"] == "tool" and m.get("name"):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def template_knows_tools(renderer: ChatRenderer) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` itself."""
    return "tools" in (getattr(renderer.tokenizer, "chat_template", None) or "")


def int_field(body: Mapping[str, Any], *names: str) -> int | None:
    """The first of ``names`` that is set, as a positive integer (None when none is)."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _bad(f"{name} must be a positive integer", name)
        return value
    return None


def check_flags(body: Mapping[str, Any], names: Sequence[str] = ("stream", "logprobs", "return_token_ids")) -> None:
    for name in names:
        if name in body and body[name] is not None and not isinstance(body[name], bool | int):
            raise _bad(f"{name} must be a boolean", name)


@dataclass
class ChatRequest:
    """A chat request's conversation and the flags that shape its answer."""

    messages: list[Message]
    tools: list[dict[str, Any]]
    max_tokens: int | None
    stream: bool = False
    logprobs: bool = False
    return_token_ids: bool = False
    include_usage: bool = False


def parse_chat_request(body: Mapping[str, Any], *, previous: ReadMessages | None = None) -> ChatRequest:
    """Read a ``/v1/chat/completions`` body (``tool_choice: "none"`` drops the tools);
    ``previous``: see :func:`openai_messages`."""
    check_flags(body)
    messages = openai_messages(body.get("messages"), previous=previous)
    tools = [] if body.get("tool_choice") == "none" else openai_tools(body.get("tools"))
    max_tokens = int_field(body, "max_completion_tokens", "max_tokens")
    options = body.get("stream_options")
    return ChatRequest(
        messages=messages, tools=tools, max_tokens=max_tokens, stream=bool(body.get("stream")),
        logprobs=bool(body.get("logprobs")), return_token_ids=bool(body.get("return_token_ids")),
        include_usage=isinstance(options, Mapping) and bool(options.get("include_usage")),
    )


# ---- reply ----------------------------------------------------------------------------------

def parse_reply(text: str, tools: Sequence[Mapping[str, Any]],
                parser: Callable[[str], ParsedTurn]) -> tuple[ParsedTurn, Message]:
    """A turn's text as the canonical assistant message (tool calls parsed when there are
    tools; without tools the whole text is the content)."""
    parsed = parser(text) if tools else ParsedTurn(content=text)
    reply: Message = {"role": "assistant", "content": parsed.content if tools else text}
    if parsed.calls:
        reply["tool_calls"] = [{"name": call.name, "arguments": call.arguments} for call in parsed.calls]
    return parsed, reply


# ---- response -------------------------------------------------------------------------------

def logprob_content(renderer: ChatRenderer, c: Completion) -> list[dict[str, Any]]:
    pieces = renderer.token_pieces(c.token_ids)
    return [{"token": p, "logprob": max(lp, -9999.0), "bytes": list(p.encode()), "top_logprobs": []}
            for p, lp in zip(pieces, c.logprobs, strict=True)]


def finish_reason(c: Completion, has_calls: bool) -> str:
    if c.finish_reason == "length":
        return "length"
    return "tool_calls" if has_calls else "stop"


def usage(prompt: Sequence[int], c: Completion) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(c.token_ids),
            "total_tokens": len(prompt) + len(c.token_ids)}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def iterate(items: Sequence[bytes]) -> AsyncIterator[bytes]:
    for item in items:
        yield item


def chat_response(req: ChatRequest, *, model: str, prompt_ids: Sequence[int], completion: Completion,
                  reply: Mapping[str, Any], renderer: ChatRenderer,
                  prompt_logprobs: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """The ``chat.completion`` answer for one sampled ``completion`` and its parsed ``reply``."""
    c = completion
    calls = [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
              "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
             for call in reply.get("tool_calls", [])]
    content = reply["content"]
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason(c, bool(calls)),
                              "logprobs": {"content": logprob_content(renderer, c)} if req.logprobs else None}
    if req.return_token_ids:
        choice["token_ids"] = list(c.token_ids)
    out: dict[str, Any] = {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion",
                           "created": int(time.time()), "model": model,
                           "choices": [choice], "usage": usage(prompt_ids, c)}
    if req.return_token_ids:
        out["prompt_token_ids"] = list(prompt_ids)
    if prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs
    return out


def chat_chunks(req: ChatRequest, out: Mapping[str, Any]) -> list[bytes]:
    """``out`` (a :func:`chat_response`) as server-sent ``chat.completion.chunk`` events: the
    role, then content / tool calls / logprobs / token ids in one delta, then the finish
    reason, the usage when ``stream_options.include_usage``, and ``[DONE]``."""
    choice = out["choices"][0]
    message = choice["message"]
    base = {"id": out["id"], "object": "chat.completion.chunk", "created": out["created"], "model": out["model"]}
    first: dict[str, Any] = {"role": "assistant", "content": ""}
    base_first = dict(base)
    if req.return_token_ids:
        base_first["prompt_token_ids"] = out["prompt_token_ids"]
    if "prompt_logprobs" in out:
        base_first["prompt_logprobs"] = out["prompt_logprobs"]
    items = [sse({**base_first, "choices": [{"index": 0, "delta": first, "finish_reason": None}]})]
    delta_choice: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": None}
    if message["content"]:
        delta_choice["delta"]["content"] = message["content"]
    calls = message.get("tool_calls") or []
    if calls:
        delta_choice["delta"]["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
    if choice["logprobs"] is not None:
        delta_choice["logprobs"] = choice["logprobs"]
    if req.return_token_ids:
        delta_choice["token_ids"] = choice["token_ids"]
    items.append(sse({**base, "choices": [delta_choice]}))
    items.append(sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]}))
    if req.include_usage:
        items.append(sse({**base, "choices": [], "usage": out["usage"]}))
    items.append(SSE_DONE)
    return items
