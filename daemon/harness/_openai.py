"""OpenAI ``POST /v1/chat/completions`` and ``POST /v1/completions`` for a harness.

Answers as the OpenAI API and vLLM do: ``usage`` counts the prompt and sampled tokens,
``finish_reason`` is ``tool_calls`` / ``stop`` / ``length``, ``logprobs`` (when asked) carry
each sampled token's logprob (``top_logprobs`` empty: only the sampled token's is known), and
vLLM's ``return_token_ids`` adds ``prompt_token_ids`` and ``choices[0].token_ids``. A streamed
call is sampled first, then sent as chunks (the backends answer whole completions). The chat
request and answer shapes are :mod:`rolloutd.daemon.llm.openai_api`'s, which ``rolloutd
model-server`` serves too; what is the rollout endpoint's own is :func:`check_common` (fields it
refuses) and that the session, not the request, chooses the sampling parameters.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any

from rolloutd.daemon.harness._errors import ApiError
from rolloutd.daemon.harness._http import Response
from rolloutd.daemon.harness._session import Session
from rolloutd.daemon.llm.openai_api import (
    SSE_DONE,
    ReadMessages,
    RequestError,
    chat_chunks,
    chat_response,
    check_flags,
    int_field,
    iterate,
    parse_chat_request,
    sse,
    usage,
)


def error_body(exc: ApiError) -> dict[str, Any]:
    return {"error": {"message": str(exc), "type": exc.kind, "param": exc.param, "code": exc.code}}


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
    try:
        check_flags(body)
    except RequestError as exc:
        raise ApiError(exc.status, exc.message, param=exc.param) from None


async def chat_completions(session: Session, body: Mapping[str, Any], model: str) -> Response:
    check_common(body)
    req = parse_chat_request(body, previous=session.read_messages)
    session.read_messages = ReadMessages(raw=body["messages"], messages=req.messages)
    chat = await session.chat(req.messages, req.tools, max_tokens=req.max_tokens)
    out = chat_response(req, model=model, prompt_ids=chat.prompt_ids, completion=chat.completion,
                        reply=chat.reply, renderer=session.renderer)
    if not req.stream:
        return Response(200, out)
    return Response(200, stream=iterate(chat_chunks(req, out)))


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
    max_tokens = int_field(body, "max_tokens") or 16  # the OpenAI default
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
                           "choices": [choice], "usage": usage(prompt, c)}
    if with_ids:
        choice["prompt_token_ids"] = list(prompt)
    if not body.get("stream"):
        return Response(200, out)
    items = [sse({**out, "usage": None}), ]
    options = body.get("stream_options")
    if isinstance(options, Mapping) and options.get("include_usage"):
        items.append(sse({"id": ident, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": out["usage"]}))
    items.append(SSE_DONE)
    return Response(200, stream=iterate(items))
