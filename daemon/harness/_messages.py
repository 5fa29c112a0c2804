"""The two chat APIs' conversations in one form, and that form as a chat template reads it.

A *canonical message* is a dict: ``role`` (``system``, ``user``, ``assistant``, ``tool``),
``content`` (text) and, for an assistant, ``tool_calls`` (``[{"name", "arguments"}]``, the
arguments a JSON object, or the raw string when the harness sent one that is not). OpenAI
chat messages and Anthropic messages both read into it; :func:`same_history` (over :func:`message_key`) says whether a
message the harness sends back is the one rolloutd answered (ids, whitespace at the ends and
argument formatting aside), which is what lets a call reuse the exact sampled ids.

Tools are kept in OpenAI's shape (``{"type": "function", "function": {...}}``), which is what
the renderer puts into the prompt; Anthropic tools are converted to it.

The OpenAI side (``openai_messages``, ``openai_tools``, ``template_messages``) is defined in
:mod:`rolloutd.daemon.llm.openai_api`, shared with ``rolloutd model-server``, and re-exported
here; the Anthropic side and the history comparison are the harness's own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rolloutd.daemon.harness._errors import ApiError
from rolloutd.daemon.llm.openai_api import (
    Message,
    RequestError,
    openai_messages,
    openai_tools,
    template_messages,
    text_parts,
    tool_arguments,
)

__all__ = [
    "Message",
    "anthropic_messages",
    "anthropic_tools",
    "message_key",
    "openai_messages",
    "openai_tools",
    "same_history",
    "template_messages",
    "tools_key",
]


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _text_parts(content: Any, where: str) -> str:
    try:
        return text_parts(content, where)
    except RequestError as exc:
        raise ApiError(exc.status, exc.message, param=exc.param) from None


# ---- Anthropic ------------------------------------------------------------------------------

def anthropic_messages(system: Any, raw: Any) -> list[Message]:
    out: list[Message] = []
    if system is not None:
        text = _text_parts(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list", "messages")
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where} must be an object with role user or assistant", where)
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content must be a string or a list of blocks", where)
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            bwhere = f"{where}.content[{j}]"
            if kind == "text":
                texts.append(_text_parts(block.get("text"), f"{bwhere}.text"))
            elif kind in ("thinking", "redacted_thinking"):
                continue  # not part of the template's history
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("name"), str):
                    raise _bad(f"{bwhere}.name must be a string", where)
                calls.append({"name": block["name"], "arguments": tool_arguments(block.get("input", {}))})
            elif kind == "tool_result" and role == "user":
                result = block.get("content")
                if isinstance(result, list):
                    result = _text_parts(result, f"{bwhere}.content")
                out.append({"role": "tool", "content": "" if result is None else str(result)})
            else:
                raise _bad(f"{bwhere}: unsupported block type {kind!r} in a {role} message", where)
        if role == "assistant":
            msg: Message = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def anthropic_tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise _bad(f"tools[{i}] needs a name", "tools")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


# ---- comparison and templates ---------------------------------------------------------------

def message_key(m: Mapping[str, Any]) -> tuple[Any, ...]:
    """What identifies a message for :func:`same_history` (computed once per message)."""
    calls = m.get("tool_calls")
    if calls:
        return m.get("role"), (m.get("content") or "").strip(), tuple(
            (c.get("name"), json.dumps(c.get("arguments"), sort_keys=True, ensure_ascii=False))
            for c in calls)
    return m.get("role"), (m.get("content") or "").strip()


def same_history(history: list[tuple[Any, ...]], keys: list[tuple[Any, ...]]) -> bool:
    """Whether messages with ``keys`` start with the ``history`` (both :func:`message_key`)."""
    return len(keys) >= len(history) and keys[: len(history)] == history  # compared in C


def tools_key(tools: Sequence[Mapping[str, Any]]) -> str:
    return json.dumps(list(tools), sort_keys=True)
