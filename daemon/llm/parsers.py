"""Tool-call parsers: the decoded text of a turn in, tool calls and mistakes out.

Formats (chosen per model family, ``ChatFamily.parser``):

- ``hermes`` (Hermes, Qwen2.5/3, SmolLM2 with our preamble):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them.
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.
- ``llama3_json`` (Llama 3.1/3.2 JSON tool calling): the whole reply is one JSON object
  ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), possibly after ``<|python_tag|>``.

A malformed call is never dropped silently: it becomes a :class:`ToolCallError` whose
``message`` is written for the model (what was wrong and the expected shape); the agent loop
sends it back as the observation. Parsers work on a decoded *copy* of the sampled ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ToolCallError:
    raw: str
    message: str


@dataclass
class ParsedTurn:
    """``content`` is the text outside any tool call (the answer, when there are no calls)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)

    @property
    def has_tool_activity(self) -> bool:
        return bool(self.calls or self.errors)


_HERMES_SHAPE = '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>'


def _call_from_obj(obj: Any, raw: str, shape: str, args_keys: tuple[str, ...]) -> ToolCall | ToolCallError:
    if not isinstance(obj, dict):
        return ToolCallError(raw, f"a tool call must be a JSON object like {shape}; got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(raw, f'the tool call has no "name" string; expected {shape}')
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models emit arguments as a JSON-encoded string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCallError(raw, f'the "arguments" of {name!r} is a string that is not valid JSON ({exc})')
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCallError(raw, f'the "arguments" of {name!r} must be a JSON object; got {type(args).__name__}')
    return ToolCall(name, args)


def _loads(raw: str, shape: str) -> Any | ToolCallError:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCallError(raw, f"the tool call is not valid JSON ({exc}); expected {shape}")


_HERMES_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    turn = ParsedTurn(content="")
    pieces: list[str] = []
    pos = 0
    for m in _HERMES_RE.finditer(text):
        pieces.append(text[pos : m.start()])
        pos = m.end()
        raw = m.group(1).strip()
        if not m.group(2):
            turn.errors.append(ToolCallError(raw, f"the tool call was not closed with </tool_call>; expected {_HERMES_SHAPE}"))
            continue
        obj = _loads(raw, _HERMES_SHAPE)
        parsed = obj if isinstance(obj, ToolCallError) else _call_from_obj(obj, raw, _HERMES_SHAPE, ("arguments", "parameters"))
        (turn.errors if isinstance(parsed, ToolCallError) else turn.calls).append(parsed)  # type: ignore[arg-type]
    pieces.append(text[pos:])
    rest = "".join(pieces)
    if "</tool_call>" in rest:
        turn.errors.append(ToolCallError(rest, f"found </tool_call> without <tool_call>; expected {_HERMES_SHAPE}"))
        rest = rest.replace("</tool_call>", "")
    turn.content = rest.strip()
    return turn


_MISTRAL_SHAPE = '[TOOL_CALLS] [{"name": "<tool name>", "arguments": {<arguments>}}]'


def parse_mistral(text: str) -> ParsedTurn:
    head, sep, tail = text.partition("[TOOL_CALLS]")
    turn = ParsedTurn(content=head.strip())
    if not sep:
        return turn
    raw = tail.strip()
    try:
        obj, end = json.JSONDecoder().raw_decode(raw)
    except json.JSONDecodeError as exc:
        turn.errors.append(ToolCallError(raw, f"the tool calls are not valid JSON ({exc}); expected {_MISTRAL_SHAPE}"))
        return turn
    items = obj if isinstance(obj, list) else [obj]
    for item in items:
        parsed = _call_from_obj(item, json.dumps(item), _MISTRAL_SHAPE, ("arguments", "parameters"))
        (turn.errors if isinstance(parsed, ToolCallError) else turn.calls).append(parsed)  # type: ignore[arg-type]
    if raw[end:].strip():
        turn.content = (turn.content + "\n" + raw[end:].strip()).strip()
    return turn


_LLAMA_SHAPE = '{"name": "<tool name>", "parameters": {<arguments>}}'


def parse_llama3_json(text: str) -> ParsedTurn:
    body = text.replace("<|python_tag|>", "").strip()
    if not body.startswith("{"):
        return ParsedTurn(content=text.strip())
    obj = _loads(body, _LLAMA_SHAPE)
    if isinstance(obj, ToolCallError):
        return ParsedTurn(content="", errors=[obj])
    if not isinstance(obj, dict) or "name" not in obj:
        return ParsedTurn(content=text.strip())  # plain JSON answer, not a call
    parsed = _call_from_obj(obj, body, _LLAMA_SHAPE, ("parameters", "arguments"))
    if isinstance(parsed, ToolCallError):
        return ParsedTurn(content="", errors=[parsed])
    return ParsedTurn(content="", calls=[parsed])


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {
    "hermes": parse_hermes,
    "mistral": parse_mistral,
    "llama3_json": parse_llama3_json,
}


def get_parser(name: str) -> Callable[[str], ParsedTurn]:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}") from None


def error_observation(errors: list[ToolCallError]) -> str:
    """The observation sent back for malformed calls: what was wrong, per call."""
    lines = [f"Error: tool call {i + 1} could not be used: {e.message}" for i, e in enumerate(errors)]
    return "\n".join(lines)
