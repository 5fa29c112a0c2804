"""Anthropic ``POST /v1/messages`` for a harness: the same session as the OpenAI routes,
answered as the Messages API does (content blocks ``text`` and ``tool_use``, ``stop_reason``
``end_turn`` / ``tool_use`` / ``max_tokens``, ``usage`` in input and output tokens; a stream as
its server-sent events, sent once the completion is sampled)."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Mapping
from typing import Any

from rolloutd.daemon.harness._errors import ApiError
from rolloutd.daemon.harness._http import Response
from rolloutd.daemon.harness._messages import anthropic_messages, anthropic_tools
from rolloutd.daemon.harness._session import Session


def error_body(exc: ApiError) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "request_too_large", 503: "api_error"}.get(exc.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": str(exc)}}


def _event(name: str, obj: Any) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _chunks(items: list[bytes]) -> AsyncIterator[bytes]:
    for item in items:
        yield item


async def messages(session: Session, body: Mapping[str, Any], model: str) -> Response:
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(400, "max_tokens: a positive integer is required", param="max_tokens")
    if body.get("stop_sequences"):
        raise ApiError(400, "stop_sequences are not supported: the model's own end tokens end a turn",
                       param="stop_sequences")
    msgs = anthropic_messages(body.get("system"), body.get("messages"))
    choice = body.get("tool_choice")
    tools = [] if isinstance(choice, Mapping) and choice.get("type") == "none" else anthropic_tools(body.get("tools"))
    chat = await session.chat(msgs, tools, max_tokens=max_tokens)
    c = chat.completion
    blocks: list[dict[str, Any]] = []
    if chat.reply["content"]:
        blocks.append({"type": "text", "text": chat.reply["content"]})
    calls = chat.reply.get("tool_calls", [])
    for call in calls:
        args = call["arguments"] if isinstance(call["arguments"], dict) else {}
        blocks.append({"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": call["name"],
                       "input": args})
    stop = "max_tokens" if c.finish_reason == "length" else ("tool_use" if calls else "end_turn")
    usage = {"input_tokens": len(chat.prompt_ids), "output_tokens": len(c.token_ids)}
    out = {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant", "model": model,
           "content": blocks, "stop_reason": stop, "stop_sequence": None, "usage": usage}
    if not body.get("stream"):
        return Response(200, out)
    start = {**out, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 0}}
    items = [_event("message_start", {"type": "message_start", "message": start})]
    for i, block in enumerate(blocks):
        if block["type"] == "text":
            items.append(_event("content_block_start", {"type": "content_block_start", "index": i,
                                                        "content_block": {"type": "text", "text": ""}}))
            items.append(_event("content_block_delta", {"type": "content_block_delta", "index": i,
                                                        "delta": {"type": "text_delta", "text": block["text"]}}))
        else:
            items.append(_event("content_block_start", {"type": "content_block_start", "index": i,
                                                        "content_block": {**block, "input": {}}}))
            items.append(_event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
        items.append(_event("content_block_stop", {"type": "content_block_stop", "index": i}))
    items.append(_event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": stop, "stop_sequence": None},
                                          "usage": {"output_tokens": len(c.token_ids)}}))
    items.append(_event("message_stop", {"type": "message_stop"}))
    return Response(200, stream=_chunks(items))
