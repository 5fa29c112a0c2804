"""The two chat APIs' conversations in one form, and that form as a chat template reads it.

A *canonical message* is a dict: ``role`` (``system``, ``user``, ``assistant``, ``tool``),
``content`` (text) and, for an assistant, ``tool_calls`` (``[{"name", "arguments"}]``, the
arguments a JSON object, or the raw string when the harness sent one that is not). OpenAI
chat messages and Anthropic messages both read into it; :func:`same_history` (over :func:`message_key`) says whether a
message the harness sends back is the one rolloutd answered (ids, whitespace at the ends and
argument formatting aside), which is what lets a call reuse the exact sampled ids.

Tools are kept in OpenAI's shape (``{"type": "function", "function": {...}}``), which is what
the renderer puts into the prompt; Anthropic tools are converted to it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rolloutd.daemon.harness._errors import ApiError

Message = dict[str, Any]


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _text_parts(content: Any, where: str) -> str:
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


def _arguments(raw: Any) -> Any:
    if isinstance(raw, Mapping):
        return dict(raw)
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw
        return value if isinstance(value, dict) else raw
    return raw


# ---- OpenAI ---------------------------------------------------------------------------------

def openai_messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list", "messages")
    out: list[Message] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object", where)
        role = m.get("role")
        if role == "developer":
            role = "system"
        elif role == "function":
            role = "tool"
        if role not in ("system", "user", "assistant", "tool"):
            raise _bad(f"{where}.role must be system, developer, user, assistant or tool; got {role!r}",
                       where)
        msg: Message = {"role": role, "content": _text_parts(m.get("content"), f"{where}.content")}
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise _bad(f"{where}.tool_calls must be a list", where)
            msg["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise _bad(f"{where}.tool_calls[{j}] needs function.name", where)
                msg["tool_calls"].append({"name": fn["name"], "arguments": _arguments(fn.get("arguments"))})
        if role == "tool" and isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
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
                calls.append({"name": block["name"], "arguments": _arguments(block.get("input", {}))})
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


def same_history(history: Sequence[tuple[Any, ...]], keys: Sequence[tuple[Any, ...]]) -> bool:
    """Whether messages with ``keys`` start with the ``history`` (both :func:`message_key`)."""
    return len(keys) >= len(history) and all(a == b for a, b in zip(history, keys, strict=False))


def tools_key(tools: Sequence[Mapping[str, Any]]) -> str:
    return json.dumps(list(tools), sort_keys=True)


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
