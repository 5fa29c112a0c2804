"""OpenAI ``POST /v1/chat/completions`` and ``POST /v1/completions`` for a harness.

Answers as the OpenAI API and vLLM do: ``usage`` counts the prompt and sampled tokens,
``finish_reason`` is ``tool_calls`` / ``stop`` / ``length``, ``logprobs`` (when asked) carry
each sampled token's logprob (``top_logprobs`` empty: only the sampled token's is known), and
vLLM's ``return_token_ids`` adds ``prompt_token_ids`` and ``choices[0].token_ids``. A streamed
call is sampled first, then sent as chunks (the backends answer whole completions).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from rolloutd.daemon.harness._errors import ApiError
from rolloutd.daemon.harness._http import Response
from rolloutd.daemon.harness._messages import openai_messages, openai_tools
from rolloutd.daemon.harness._session import Session
from rolloutd.daemon.llm.base import Completion


def error_body(exc: ApiError) -> dict[str, Any]:
    return {"error": {"message": str(exc), "type": exc.kind, "param": exc.param, "code": exc.code}}


def _int_field(body: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ApiError(400, f"{name} must be a positive integer", param=name)
        return value
    return None


def check_common(body: Mapping[str, Any]) -> None:
    """Fields the endpoint does not serve get a clear 400 rather than being ignored."""
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, "n must be 1: each call samples one completion (the trainer sets "
                       "the group size)", param="n")
    if body.get("stop"):
        raise ApiError(400, "stop strings are not supported: the model's own end tokens end a "
                       "turn (a cut would make the recorded tokens differ from the text)", param="stop")
    if body.get("prompt_logprobs"):
        raise ApiError(400, "prompt_logprobs is not served by the rollout endpoint",
                       param="prompt_logprobs")
    for name in ("stream", "logprobs", "return_token_ids"):
        if name in body and body[name] is not None and not isinstance(body[name], bool | int):
            raise ApiError(400, f"{name} must be a boolean", param=name)


def _logprob_content(session: Session, c: Completion) -> list[dict[str, Any]]:
    pieces = session.renderer.token_pieces(c.token_ids)
    return [{"token": p, "logprob": max(lp, -9999.0), "bytes": list(p.encode()), "top_logprobs": []}
            for p, lp in zip(pieces, c.logprobs, strict=True)]


def _finish(c: Completion, has_calls: bool) -> str:
    if c.finish_reason == "length":
        return "length"
    return "tool_calls" if has_calls else "stop"


def _usage(prompt: list[int], c: Completion) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(c.token_ids),
            "total_tokens": len(prompt) + len(c.token_ids)}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _chunks(items: list[bytes]) -> AsyncIterator[bytes]:
    for item in items:
        yield item


async def chat_completions(session: Session, body: Mapping[str, Any], model: str) -> Response:
    check_common(body)
    messages = openai_messages(body.get("messages"))
    tools = [] if body.get("tool_choice") == "none" else openai_tools(body.get("tools"))
    max_tokens = _int_field(body, "max_completion_tokens", "max_tokens")
    chat = await session.chat(messages, tools, max_tokens=max_tokens)
    c = chat.completion
    calls = [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
              "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
             for call in chat.reply.get("tool_calls", [])]
    content = chat.reply["content"]
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": _finish(c, bool(calls)),
                              "logprobs": {"content": _logprob_content(session, c)} if body.get("logprobs") else None}
    ident, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
    with_ids = bool(body.get("return_token_ids"))
    if with_ids:
        choice["token_ids"] = list(c.token_ids)
    out: dict[str, Any] = {"id": ident, "object": "chat.completion", "created": created, "model": model,
                           "choices": [choice], "usage": _usage(chat.prompt_ids, c)}
    if with_ids:
        out["prompt_token_ids"] = list(chat.prompt_ids)
    if not body.get("stream"):
        return Response(200, out)
    base = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model}
    first: dict[str, Any] = {"role": "assistant", "content": ""}
    base_first = {**base, "prompt_token_ids": list(chat.prompt_ids)} if with_ids else base
    items = [_sse({**base_first, "choices": [{"index": 0, "delta": first, "finish_reason": None}]})]
    delta_choice: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": None}
    if content:
        delta_choice["delta"]["content"] = content
    if calls:
        delta_choice["delta"]["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
    if choice["logprobs"] is not None:
        delta_choice["logprobs"] = choice["logprobs"]
    if with_ids:
        delta_choice["token_ids"] = list(c.token_ids)
    items.append(_sse({**base, "choices": [delta_choice]}))
    items.append(_sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]}))
    options = body.get("stream_options")
    if isinstance(options, Mapping) and options.get("include_usage"):
        items.append(_sse({**base, "choices": [], "usage": out["usage"]}))
    items.append(b"data: [DONE]\n\n")
    return Response(200, stream=_chunks(items))


def _prompt_ids(session: Session, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt is empty", param="prompt")
        tok = session.renderer.tokenizer
        result = tok(prompt, add_special_tokens=False)
        ids = result["input_ids"] if isinstance(result, Mapping) or hasattr(result, "input_ids") else result
        return [int(i) for i in ids]
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool)
                                                   and i >= 0 for i in prompt):
        return list(prompt)
    raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per call)",
                   param="prompt")


async def completions(session: Session, body: Mapping[str, Any], model: str) -> Response:
    check_common(body)
    if body.get("echo"):
        raise ApiError(400, "echo is not supported", param="echo")
    prompt = _prompt_ids(session, body.get("prompt"))
    max_tokens = _int_field(body, "max_tokens") or 16  # the OpenAI default
    c = await session.complete(prompt, max_tokens=max_tokens)
    text = session.renderer.decode(c.token_ids)
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "length" if c.finish_reason == "length" else "stop",
                              "logprobs": None}
    if body.get("logprobs") is not None and body.get("logprobs") is not False:
        pieces = session.renderer.token_pieces(c.token_ids)
        lps = [max(x, -9999.0) for x in c.logprobs]
        offsets, at = [], 0
        for p in pieces:
            offsets.append(at)
            at += len(p)
        choice["logprobs"] = {"tokens": pieces, "token_logprobs": lps, "text_offset": offsets,
                              "top_logprobs": [{p: x} for p, x in zip(pieces, lps, strict=True)]}
    with_ids = bool(body.get("return_token_ids"))
    if with_ids:
        choice["token_ids"] = list(c.token_ids)
    ident, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
    out: dict[str, Any] = {"id": ident, "object": "text_completion", "created": created, "model": model,
                           "choices": [choice], "usage": _usage(prompt, c)}
    if with_ids:
        choice["prompt_token_ids"] = list(prompt)
    if not body.get("stream"):
        return Response(200, out)
    items = [_sse({**out, "usage": None}), ]
    options = body.get("stream_options")
    if isinstance(options, Mapping) and options.get("include_usage"):
        items.append(_sse({"id": ident, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": out["usage"]}))
    items.append(b"data: [DONE]\n\n")
    return Response(200, stream=_chunks(items))
