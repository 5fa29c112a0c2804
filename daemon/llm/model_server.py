"""``rolloutd model-server``: the embedded model over HTTP, speaking vLLM's request subset.

Routes (the subset of vLLM's OpenAI server that rolloutd's vllm client and harnesses use):

- ``POST /v1/completions``: ``prompt`` as token ids, ``max_tokens``, ``temperature``,
  ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``seed``, ``stop_token_ids``,
  ``logprobs`` (0 or null), ``return_token_ids``, ``return_tokens_as_token_ids``; answers
  vLLM's ``CompletionResponse`` shape (``choices[0].token_ids``, ``prompt_token_ids``,
  ``logprobs.tokens``/``token_logprobs``, ``finish_reason``, ``usage``). Text prompts,
  ``n > 1``, ``stream``, ``logprobs > 0`` and the vLLM fields it does not implement
  (:data:`UNSUPPORTED`, e.g. ``prompt_logprobs``) answer 400 rather than being ignored; a
  token id outside the vocabulary answers 400 and a ``model`` other than the served one 404,
  as vLLM does.
- ``POST /v1/chat/completions``: OpenAI chat in the shape the per-rollout harness endpoint
  answers (both built by :mod:`rolloutd.daemon.llm.openai_api`): ``messages``, ``tools``
  (hermes tool calls parsed; ``tool_choice`` ``auto``/``none``), ``max_tokens`` /
  ``max_completion_tokens`` (default: the rest of the context), the sampling fields above (the
  request's own: this is a plain inference server), ``logprobs`` (``top_logprobs`` 0),
  ``stream`` (SSE, sent once sampled), and vLLM's ``return_token_ids`` and ``prompt_logprobs``
  (one extra forward pass of the in-process model; 400 on a backend without it).
- ``GET /v1/models``, ``GET /health`` (200, empty), ``GET /metrics`` (Prometheus text).
- ``POST /v1/reload`` ``{"path": dir, "partial": false, "version": N}``
  (:class:`rolloutd.daemon.llm.weights.ReloadRequest`): weight sync; loads the ``*.safetensors`` under
  ``dir`` into the model after the generation in progress and drops the KV cache (the backend's
  :class:`~rolloutd.daemon.llm.weights.Reloadable` ``reload_weights``). 400 when the weights do not fit
  the model.

Errors have vLLM's shape (since vLLM 0.10.1, ``ErrorResponse`` in
``vllm/entrypoints/openai/protocol.py``): ``{"error": {"message", "type", "param", "code"}}``
with ``code`` the HTTP status. A failure of ours answers 500 in that shape, never an empty body.

A client that disconnects aborts its request (the generation thread stops at the next token),
as vLLM does. ``--backend scripted`` serves the labelled test double instead of the model
(fast, deterministic; for tests of failover and routing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rolloutd.daemon.llm import openai_api
from rolloutd.daemon.llm.base import (
    Backend,
    BackendRejected,
    BackendUnavailable,
    Completion,
    LLMError,
    SamplingParams,
)
from rolloutd.daemon.llm.chat import ChatRenderer
from rolloutd.daemon.llm.parsers import get_parser
from rolloutd.daemon.llm.weights import Reloadable, ReloadRequest, WeightsError

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MAX_BODY = 16 * 1024 * 1024

#: vLLM completion fields this server does not implement, with the value that means "off".
#: A request that sets one to anything else answers 400 (``param`` names the field).
UNSUPPORTED: dict[str, Any] = {
    "prompt_logprobs": None, "echo": False, "best_of": 1, "use_beam_search": False,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "length_penalty": 1.0, "stop": None,
    "min_tokens": 0, "ignore_eos": False, "logit_bias": None, "allowed_token_ids": None,
    "bad_words": None, "suffix": None, "truncate_prompt_tokens": None, "prompt_embeds": None,
    "response_format": None, "structured_outputs": None, "guided_json": None,
    "guided_regex": None, "guided_choice": None, "guided_grammar": None, "logits_processors": None,
}

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed",
                413: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class ErrorAnswer(LLMError):
    """A request this server answers with ``status`` and vLLM's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def _is_off(value: Any, off: Any) -> bool:
    return value is None or value == off or value in ([], {}, "")


class _Sampling(BaseModel):
    """The sampling fields both routes read (and the served ``model``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=1)

    def params(self, extra_stops: Sequence[int] = ()) -> SamplingParams:
        stops = list(self.stop_token_ids or [])
        stops += [i for i in extra_stops if i not in stops]
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop_token_ids=stops,
        )


class CompletionRequest(_Sampling):
    """The accepted subset. Fields that are neither here nor in :data:`UNSUPPORTED` are
    ignored, as vLLM ignores fields it does not know."""

    prompt: list[int] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=0)
    stream: bool = Field(False, le=False)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None


class ChatSampling(_Sampling):
    """A chat request's fields besides the conversation (read by
    :func:`rolloutd.daemon.llm.openai_api.parse_chat_request`): sampling, ``top_logprobs``
    (0 only: just the sampled token's logprob is known) and vLLM's ``prompt_logprobs``."""

    top_logprobs: int | None = Field(None, ge=0, le=0)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)


#: :data:`UNSUPPORTED` for ``/v1/chat/completions``, which serves ``prompt_logprobs``.
CHAT_UNSUPPORTED: dict[str, Any] = {k: v for k, v in UNSUPPORTED.items() if k != "prompt_logprobs"}


_S = TypeVar("_S", bound=_Sampling)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        p = "rolloutd_model_server_"
        self.requests = Counter(p + "requests", "Completion requests by outcome", ["outcome"], registry=self.registry)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens received", registry=self.registry)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=self.registry)
        self.in_flight = Gauge(p + "requests_in_flight", "Requests being served", registry=self.registry)
        self.reloads = Counter(p + "weight_reloads", "Weight reloads (POST /v1/reload)", registry=self.registry)


class ModelServerApp:
    """A plain ASGI app over one backend (so the disconnect-means-abort path is explicit)."""

    def __init__(
        self, backend: Backend, renderer: ChatRenderer, *, model_name: str, max_model_len: int,
        vocab_size: int | None = None,
    ) -> None:
        self.backend = backend
        self.renderer = renderer
        self.model_name = model_name
        self.max_model_len = max_model_len
        #: Token ids must be below this (the tokenizer's vocabulary unless given).
        self.vocab_size = vocab_size if vocab_size is not None else len(renderer.tokenizer)
        self.metrics = _Metrics()
        self.created = int(time.time())
        self.weights_version: int | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        started = False

        async def tracked_send(msg: dict[str, Any]) -> None:
            nonlocal started
            started = True
            await send(msg)

        try:
            await self._route(scope, receive, tracked_send)
        except Exception as exc:  # a failure of ours: a JSON 500, never an empty body
            log.exception("model-server: %s %s failed", scope["method"], scope["path"])
            while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]  # the error inside a nursery's group
            if not started:
                await _error(send, 500, f"internal error: {type(exc).__name__}: {exc}")

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (scope["method"], scope["path"])
        if route == ("GET", "/health"):
            await _respond(send, 200, b"", "text/plain")
        elif route == ("GET", "/v1/models"):
            await _json(send, 200, {"object": "list", "data": [{
                "id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "rolloutd", "root": self.model_name, "parent": None,
                "max_model_len": self.max_model_len, "weights_version": self.weights_version,
            }]})
        elif route == ("GET", "/metrics"):
            await _respond(send, 200, generate_latest(self.metrics.registry), "text/plain; version=0.0.4")
        elif route == ("POST", "/v1/completions"):
            await self._completions(receive, send)
        elif route == ("POST", "/v1/chat/completions"):
            await self._chat_completions(receive, send)
        elif route == ("POST", "/v1/reload"):
            await self._reload(receive, send)
        elif scope["path"] in ("/health", "/v1/models", "/metrics", "/v1/completions", "/v1/chat/completions",
                               "/v1/reload"):
            await _error(send, 405, "method not allowed")
        else:
            await _error(send, 404, f"no route {scope['path']}")

    async def _reload(self, receive: Receive, send: Send) -> None:
        """Weight sync: ``{"path": dir, "partial": false, "version": N?}`` -> the weights
        under ``path`` are loaded (after the generation in progress) and the cache dropped."""
        body = b""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if not msg.get("more_body") or len(body) > MAX_BODY:
                break
        try:
            req = ReloadRequest.model_validate(json.loads(body or b"null"))
        except (ValueError, ValidationError) as exc:
            await _error(send, 400, f"bad request: {exc}")
            return
        if not isinstance(self.backend, Reloadable):
            await _error(send, 400, f"this server's backend ({self.model_name}) cannot reload weights")
            return
        try:
            result = await self.backend.reload_weights(req.path, partial=req.partial, version=req.version)
        except WeightsError as exc:
            await _error(send, 400, str(exc))
            return
        if req.version is not None:
            self.weights_version = req.version
        self.metrics.reloads.inc()
        await _json(send, 200, {**result, "path": req.path, "version": self.weights_version})

    async def _read_body(self, receive: Receive, send: Send) -> bytes | None:
        """The request body; None when the client left or the body was too large (answered)."""
        body = b""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            body += msg.get("body", b"")
            if len(body) > MAX_BODY:
                await _error(send, 413, "request body too large")
                return None
            if not msg.get("more_body"):
                return body

    async def _generate(
        self, receive: Receive, send: Send, prompt: list[int], params: SamplingParams, max_tokens: int,
        *, prompt_logprobs: int | None = None,
    ) -> tuple[Completion, list[list[tuple[int, float, int]] | None] | None] | None:
        """Sample (and, when asked, score the prompt) until done or the client leaves; None
        when the request was aborted or failed (an error is then answered)."""
        self.metrics.in_flight.inc()
        completion = None
        scored = None
        failure: ErrorAnswer | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                # caught here: out of the nursery they would come wrapped in an ExceptionGroup
                try:
                    completion = await self.backend.complete(prompt, params, max_tokens=max_tokens)
                    if prompt_logprobs is not None:
                        scored = await self.backend.prompt_logprobs(prompt, prompt_logprobs)  # type: ignore[attr-defined]
                except BackendRejected as exc:
                    failure = ErrorAnswer(400, str(exc))
                except (BackendUnavailable, LLMError) as exc:
                    failure = ErrorAnswer(503, str(exc))
                nursery.cancel_scope.cancel()
        finally:
            self.metrics.in_flight.dec()
        if failure is not None:
            self.metrics.requests.labels("bad_request" if failure.status == 400 else "error").inc()
            await _error(send, failure.status, failure.message)
            return None
        if completion is None or (prompt_logprobs is not None and scored is None):
            self.metrics.requests.labels("aborted").inc()  # the client went away
            return None
        self.metrics.requests.labels(completion.finish_reason).inc()
        self.metrics.prompt_tokens.inc(len(prompt))
        self.metrics.generation_tokens.inc(len(completion.token_ids))
        return completion, scored

    async def _completions(self, receive: Receive, send: Send) -> None:
        body = await self._read_body(receive, send)
        if body is None:
            return
        try:
            req, params = self._parse_completion(body)
        except ErrorAnswer as exc:
            self.metrics.requests.labels("bad_request").inc()
            await _error(send, exc.status, exc.message, param=exc.param)
            return
        result = await self._generate(receive, send, req.prompt, params, req.max_tokens)
        if result is None:
            return
        completion = result[0]
        ids = completion.token_ids
        # vLLM names the stop token only for a stop_token_ids hit, not for EOS
        eos = getattr(self.renderer.tokenizer, "eos_token_id", None)
        stopped = completion.finish_reason == "stop" and ids and ids[-1] != eos
        await _json(send, 200, {
            "id": f"cmpl-{trio.current_time():.6f}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{
                "index": 0,
                "text": self.renderer.decode(ids),
                "logprobs": completion_logprobs(ids, completion.logprobs),
                "finish_reason": completion.finish_reason,
                "stop_reason": ids[-1] if stopped else None,
                "token_ids": ids,
                "prompt_logprobs": None,
                "prompt_token_ids": req.prompt,
            }],
            "usage": {
                "prompt_tokens": len(req.prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(req.prompt) + len(ids),
                "prompt_tokens_details": {"cached_tokens": completion.cached_tokens},
            },
        })

    async def _chat_completions(self, receive: Receive, send: Send) -> None:
        body = await self._read_body(receive, send)
        if body is None:
            return
        try:
            req, sampling, prompt, max_tokens = self._parse_chat(body)
        except ErrorAnswer as exc:
            self.metrics.requests.labels("bad_request").inc()
            await _error(send, exc.status, exc.message, param=exc.param)
            return
        try:
            params = sampling.params(self.renderer.stop_ids)
        except ValidationError as exc:
            loc = exc.errors()[0]["loc"]
            await _error(send, 400, f"bad request: {exc}", param=str(loc[0]) if loc else None)
            return
        result = await self._generate(receive, send, prompt, params, max_tokens,
                                      prompt_logprobs=sampling.prompt_logprobs)
        if result is None:
            return
        completion, scored = result
        _, reply = openai_api.parse_reply(self.renderer.turn_text(completion.token_ids), req.tools,
                                          get_parser(self.renderer.family.parser))
        out = openai_api.chat_response(
            req, model=self.model_name, prompt_ids=prompt, completion=completion, reply=reply,
            renderer=self.renderer, prompt_logprobs=None if scored is None else self._prompt_logprobs(scored))
        out["usage"]["prompt_tokens_details"] = {"cached_tokens": completion.cached_tokens}
        if not req.stream:
            await _json(send, 200, out)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        for chunk in openai_api.chat_chunks(req, out):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    def _prompt_logprobs(self, scored: list[list[tuple[int, float, int]] | None]) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: null, then ``{token_id: {logprob, rank, decoded_token}}``."""
        return [None if pos is None else {
            str(tid): {"logprob": max(lp, -9999.0), "rank": rank, "decoded_token": self.renderer.decode([tid])}
            for tid, lp, rank in pos} for pos in scored]

    def _parse_chat(self, body: bytes) -> tuple[openai_api.ChatRequest, ChatSampling, list[int], int]:
        """The conversation, its sampling fields, the rendered prompt and ``max_tokens``."""
        data = self._load(body, CHAT_UNSUPPORTED)
        sampling = self._validate(ChatSampling, data)
        if data.get("tool_choice") not in (None, "auto", "none"):
            raise ErrorAnswer(400, "tool_choice must be 'auto' or 'none': rolloutd model-server "
                                   "does not force tool calls", param="tool_choice")
        try:
            req = openai_api.parse_chat_request(data)
        except openai_api.RequestError as exc:
            raise ErrorAnswer(exc.status, exc.message, param=exc.param) from None
        if sampling.prompt_logprobs is not None and not hasattr(self.backend, "prompt_logprobs"):
            raise ErrorAnswer(400, f"prompt_logprobs is not served by this server's backend "
                                   f"({self.backend.kind})", param="prompt_logprobs")
        msgs = openai_api.template_messages(req.messages, knows_tools=openai_api.template_knows_tools(self.renderer))
        try:
            prompt = self.renderer.render_prompt(msgs, req.tools)
        except Exception as exc:  # the template rejects this conversation
            raise ErrorAnswer(400, f"the chat template cannot render these messages: {exc}",
                              param="messages") from None
        room = self.max_model_len - len(prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else room
        if room < 1 or max_tokens > room:
            raise ErrorAnswer(400, f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds "
                                   f"max_model_len ({self.max_model_len})", param="max_tokens")
        return req, sampling, prompt, max_tokens

    def _load(self, body: bytes, unsupported: Mapping[str, Any]) -> dict[str, Any]:
        try:
            data = json.loads(body or b"null")
        except ValueError as exc:
            raise ErrorAnswer(400, f"the body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ErrorAnswer(400, "the body must be a JSON object")
        for name, off in unsupported.items():
            if name in data and not _is_off(data[name], off):
                raise ErrorAnswer(400, f"{name!r} is not supported by rolloutd model-server", param=name)
        return data

    def _validate(self, model: type[_S], data: dict[str, Any]) -> _S:
        try:
            req = model.model_validate(data)
        except ValidationError as exc:
            loc = exc.errors()[0]["loc"]
            raise ErrorAnswer(400, f"bad request: {exc}", param=str(loc[0]) if loc else None) from None
        if req.model is not None and req.model != self.model_name:
            raise ErrorAnswer(404, f"The model `{req.model}` does not exist.", param="model")
        bad = [i for i in req.stop_token_ids or [] if not 0 <= i < self.vocab_size]
        if bad:
            raise ErrorAnswer(400, f"Token id {bad[0]} is out of vocabulary "
                                    f"(the vocabulary has {self.vocab_size} ids)", param="stop_token_ids")
        return req

    def _parse_completion(self, body: bytes) -> tuple[CompletionRequest, SamplingParams]:
        """The request and its sampling params; :class:`ErrorAnswer` says what is wrong."""
        req = self._validate(CompletionRequest, self._load(body, UNSUPPORTED))
        try:
            params = req.params()
        except ValidationError as exc:
            loc = exc.errors()[0]["loc"]
            raise ErrorAnswer(400, f"bad request: {exc}", param=str(loc[0]) if loc else None) from None
        bad = [i for i in req.prompt if not 0 <= i < self.vocab_size]
        if bad:
            raise ErrorAnswer(400, f"Token id {bad[0]} is out of vocabulary "
                                    f"(the vocabulary has {self.vocab_size} ids)", param="prompt")
        if len(req.prompt) + req.max_tokens > self.max_model_len:
            raise ErrorAnswer(400, f"prompt ({len(req.prompt)}) + max_tokens ({req.max_tokens}) "
                                    f"exceeds max_model_len ({self.max_model_len})", param="max_tokens")
        return req, params


def completion_logprobs(ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    """``choices[0].logprobs`` as vLLM builds it for ``logprobs=0`` and
    ``return_tokens_as_token_ids`` (``_create_completion_logprobs`` in
    vllm/entrypoints/openai/serving_completion.py): ``token_id:N`` tokens, the sampled token
    alone in ``top_logprobs``, logprobs clamped at -9999.0, and ``text_offset`` the running
    sum of the lengths of the previous ``tokens``."""
    tokens = [f"token_id:{i}" for i in ids]
    clamped = [max(x, -9999.0) for x in logprobs]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []
    return {"text_offset": offsets, "token_logprobs": clamped, "tokens": tokens,
            "top_logprobs": [{t: x} for t, x in zip(tokens, clamped, strict=True)]}


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _respond(send: Send, status: int, body: bytes, ctype: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _json(send: Send, status: int, obj: Any) -> None:
    await _respond(send, status, json.dumps(obj).encode(), "application/json")


async def _error(send: Send, status: int, message: str, *, param: str | None = None) -> None:
    """vLLM's error body (``ErrorResponse``/``ErrorInfo``, vLLM >= 0.10.1)."""
    await _json(send, status, {"error": {
        "message": message, "type": _ERROR_TYPES.get(status, "ServiceUnavailableError"),
        "param": param, "code": status,
    }})


async def build_app(
    *, backend: str = "transformers", replies: list[str] | None = None, latency_s: float = 0.0,
    threads: int | None = None,
) -> ModelServerApp:
    """Load the tokenizer (and the model, unless ``backend="scripted"``) and build the app."""
    from rolloutd.daemon.llm.chat import embedded_renderer

    renderer = await trio.to_thread.run_sync(embedded_renderer)
    served: Backend
    if backend == "transformers":
        from rolloutd.daemon.llm.transformers import TransformersBackend

        tb = TransformersBackend(threads=threads)
        await tb.load()
        served, name, max_len = tb, "SmolLM2-135M-Instruct", tb.max_model_len
    elif backend == "scripted":
        from rolloutd.daemon.llm.scripted import ScriptedBackend

        served = ScriptedBackend(renderer, replies or ["Hello from the scripted test double."], latency_s=latency_s)
        name, max_len = "scripted-test-double", renderer.context_length
    else:
        raise ValueError(f"unknown model-server backend {backend!r} (transformers | scripted)")
    return ModelServerApp(served, renderer, model_name=name, max_model_len=max_len)


async def serve_model_server(
    *,
    host: str = "127.0.0.1",
    port: int = 8100,
    backend: str = "transformers",
    replies: list[str] | None = None,
    latency_s: float = 0.0,
    threads: int | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; ``task_status.started(urls)`` once the model is loaded and the
    port is bound (``port=0`` picks a free one; the URL tells which)."""
    app = await build_app(backend=backend, replies=replies, latency_s=latency_s, threads=threads)
    cfg = Config()
    cfg.bind = [f"{host}:{port}"]
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("hypercorn.error")
    cfg.graceful_timeout = 2.0
    await serve(app, cfg, task_status=task_status)  # type: ignore[arg-type]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``model-server`` subcommand's options (the CLI reuses this)."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    parser.add_argument("--backend", choices=["transformers", "scripted"], default="transformers",
                        help="'scripted' serves the labelled test double, not a model")
    parser.add_argument("--reply", action="append", dest="replies",
                        help="scripted replies, per turn (repeatable)")
    parser.add_argument("--latency-s", type=float, default=0.0, help="scripted latency per request")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: half the cores, 1 to 4)")


async def run_from_args(args: argparse.Namespace) -> None:
    """Serve with ``args`` from :func:`add_arguments`; prints ``READY <url>`` when serving."""

    async def _main(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_model_server(host=args.host, port=args.port, backend=args.backend,
                                 replies=args.replies, latency_s=args.latency_s,
                                 threads=args.threads, task_status=task_status)

    async with trio.open_nursery() as nursery:
        urls = await nursery.start(_main)
        print(f"READY {urls[0]}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rolloutd model-server", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        trio.run(run_from_args, args)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
