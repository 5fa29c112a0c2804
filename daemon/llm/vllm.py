"""The vLLM client: token ids in over ``POST /v1/completions``, sampled ids and logprobs out.

Also the client for ``rolloutd model-server``, which speaks the same subset
(:class:`ModelServerBackend`, which also loads weights through the server's ``POST /v1/reload``). Every request
sends every sampling field explicitly (so ``--generation-config auto`` cannot change what we
sample from), ``max_tokens`` explicitly (vLLM's default is 16), ``logprobs: 0`` (the sampled
token's logprob only), ``return_token_ids`` and ``return_tokens_as_token_ids`` (so ids never
come from decoded strings), ``skip_special_tokens: false`` and ``stop_token_ids``. The
response must carry ``choices[0].token_ids`` and ``logprobs.token_logprobs`` of the same
length; the ``token_id:N`` strings must name the same ids; an echoed ``prompt_token_ids`` must
equal what we sent. Anything else is :class:`BadResponse`.

Run vLLM with ``--logprobs-mode processed_logprobs`` so the logprobs are those of the
distribution actually sampled from (after temperature / top-k / top-p).

Cancelling :meth:`VLLMBackend.complete` closes the HTTP connection; vLLM (and model-server)
abort a request whose client disconnected, so a cancelled rollout frees its slot at once.

Errors: connect/read failures and 5xx are :class:`BackendUnavailable` (the pool retries on
another backend); 4xx is :class:`BackendRejected` (e.g. the prompt exceeds the context, a
token id is out of vocabulary, or the server does not serve ``model``: vLLM's 404). The
message carries the server's error type and message, read from vLLM's error body in either
shape: ``{"error": {"message", "type", "param", "code"}}`` (vLLM >= 0.10.1, model-server) or
the flat ``{"object": "error", "message", "type", "param", "code"}`` of older vLLM.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import httpx
import trio

from rolloutd.daemon.llm.base import (
    BackendRejected,
    BackendUnavailable,
    BadResponse,
    Completion,
    SamplingParams,
)
from rolloutd.daemon.llm.weights import (
    RELOAD_HTTP_TIMEOUT_S,
    WeightsError,
    check_checkpoint,
    reload_unsupported,
)

FINISH_REASONS = {"stop", "length", "abort"}


def error_text(resp: httpx.Response) -> str:
    """``HTTP <status> <type>: <message> (param <param>)`` from vLLM's error body (either
    shape); the start of the raw body when it is not one."""
    try:
        data = resp.json()
    except ValueError:
        data = None
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):  # older vLLM: the fields at the top level
        err = data if isinstance(data, dict) and data.get("object") == "error" else None
    if err is None or not isinstance(err.get("message"), str):
        return f"HTTP {resp.status_code}: {resp.text[:300]}"
    kind = f" {err['type']}" if isinstance(err.get("type"), str) else ""
    param = f" (param {err['param']})" if isinstance(err.get("param"), str) else ""
    return f"HTTP {resp.status_code}{kind}: {err['message'][:300]}{param}"


def build_request(
    model: str, prompt_ids: Sequence[int], params: SamplingParams, *, max_tokens: int
) -> dict[str, Any]:
    """The JSON body of one ``/v1/completions`` request (DESIGN section 7)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": [int(i) for i in prompt_ids],
        "max_tokens": int(max_tokens),
        "n": 1,
        "stream": False,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "stop_token_ids": list(params.stop_token_ids),
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    return body


def parse_response(data: Any, *, prompt_ids: Sequence[int] | None = None, backend: str = "") -> Completion:
    """Read one ``/v1/completions`` answer; raise :class:`BadResponse` if it can't be trusted."""
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise BadResponse(f"{backend}: response has no choices[0]") from None
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise BadResponse(f"{backend}: choices[0].token_ids is missing (needs vLLM >= 0.10.2 and return_token_ids)")
    lp = choice.get("logprobs") or {}
    logprobs = lp.get("token_logprobs")
    if not isinstance(logprobs, list):
        raise BadResponse(f"{backend}: choices[0].logprobs.token_logprobs is missing")
    if len(logprobs) != len(ids):
        raise BadResponse(f"{backend}: {len(ids)} token ids but {len(logprobs)} logprobs")
    if any(not isinstance(x, int | float) or math.isnan(x) for x in logprobs):
        raise BadResponse(f"{backend}: a sampled-token logprob is null or NaN")
    tokens = lp.get("tokens")
    if isinstance(tokens, list) and tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        named = [int(t.removeprefix("token_id:")) for t in tokens]
        if named != ids:
            raise BadResponse(f"{backend}: logprobs.tokens name other ids than token_ids")
    echoed = choice.get("prompt_token_ids")
    if prompt_ids is not None and isinstance(echoed, list) and echoed != list(prompt_ids):
        raise BadResponse(f"{backend}: the server's prompt_token_ids differ from the prompt sent")
    finish = choice.get("finish_reason")
    if finish not in FINISH_REASONS:
        raise BadResponse(f"{backend}: unexpected finish_reason {finish!r}")
    usage = data.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    extra: dict[str, object] = {}
    if choice.get("stop_reason") is not None:
        extra["stop_reason"] = choice["stop_reason"]
    return Completion(
        token_ids=ids,
        logprobs=[float(x) for x in logprobs],
        finish_reason=finish,
        backend=backend,
        cached_tokens=cached if isinstance(cached, int) else None,
        extra=extra,
    )


class VLLMBackend:
    """A vLLM (or ``rolloutd model-server``) endpoint at ``url``.

    ``model`` is discovered from ``GET /v1/models`` when not given. ``uds``: reach the server
    over that Unix socket (``vllm serve --uds``; ``url`` is then only a label). ``transport``
    is for tests (``httpx.MockTransport`` replaying the vLLM responses in tests/llm/data).

    Weight sync (:meth:`reload_weights`) uses vLLM's own development routes, present when the
    server runs with ``VLLM_SERVER_DEV_MODE=1`` (the embedded CPU engine does, on a private
    Unix socket: those routes have no authentication).
    """

    def __init__(
        self,
        url: str,
        model: str | None = None,
        *,
        kind: str = "vllm",
        name: str | None = None,
        connect_timeout_s: float = 5.0,
        uds: str | None = None,
        checkpoint: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.kind = kind
        self.uds = uds
        #: the directory the server was started from, where known (a server we supervise):
        #: reloads are checked against it first (a bad checkpoint kills vLLM's engine)
        self.checkpoint = checkpoint
        #: the last checkpoint :meth:`reload_weights` loaded (None: the weights it started with);
        #: a supervisor restarting the server loads it again before it serves
        self.weights_path: str | None = None
        #: set while a restarted server gets its weights back: it is not healthy meanwhile
        self.restoring = False
        self.name = name or (f"{kind}:unix:{uds}" if uds else f"{kind}:{self.url}")
        if transport is None and uds is not None:
            transport = httpx.AsyncHTTPTransport(uds=uds)
        self.max_model_len: int | None = None
        timeout = httpx.Timeout(connect=connect_timeout_s, read=None, write=30.0, pool=None)
        self._client = httpx.AsyncClient(
            base_url=self.url, timeout=timeout, transport=transport,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def _request(
        self, method: str, path: str, *, what: str = "", rejected: type[BackendRejected] = BackendRejected,
        **kw: Any,
    ) -> httpx.Response:
        """The server's answer; no answer or 5xx is BackendUnavailable, 4xx ``rejected``."""
        where = f"{self.name}: {what}: " if what else f"{self.name}: "
        try:
            resp = await self._client.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise BackendUnavailable(f"{where}{type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 500:
            raise BackendUnavailable(f"{where}{error_text(resp)}")
        if resp.status_code >= 400:
            raise rejected(f"{where}{error_text(resp)}")
        return resp

    async def discover(self) -> str:
        """Read the served model name (and ``max_model_len``) from ``GET /v1/models``."""
        resp = await self._request("GET", "/v1/models")
        try:
            entry = resp.json()["data"][0]
            model = str(entry["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise BadResponse(f"{self.name}: /v1/models lists no model") from None
        if isinstance(entry.get("max_model_len"), int):
            self.max_model_len = entry["max_model_len"]
        self.model = model
        return model

    async def complete(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, max_tokens: int
    ) -> Completion:
        model = self.model or await self.discover()
        body = build_request(model, prompt_ids, params, max_tokens=max_tokens)
        resp = await self._request("POST", "/v1/completions", json=body)
        try:
            data = resp.json()
        except ValueError:
            raise BadResponse(f"{self.name}: response is not JSON") from None
        return parse_response(data, prompt_ids=prompt_ids, backend=self.name)

    async def health(self) -> bool:
        if self.restoring:
            return False
        try:
            resp = await self._client.get("/health")
        except httpx.TransportError:
            return False
        return resp.status_code == 200

    async def aclose(self) -> None:
        await self._client.aclose()

    async def reload_weights(self, path: str, *, partial: bool = False, version: int | None = None) -> dict[str, Any]:
        """Load the safetensors in ``path`` (a directory the server can read) with vLLM's own
        in-place reload: ``POST /collective_rpc {"method": "reload_weights", "kwargs":
        {"weights_path": path}}`` (every worker's ``reload_weights``), then ``POST
        /reset_prefix_cache`` (cached keys were computed by the old weights). The pool has
        paused dispatch and drained this server first (:meth:`BackendPool.reload`). vLLM's
        reload takes a whole checkpoint, so ``partial`` is refused. Without the development
        routes (a server not started with ``VLLM_SERVER_DEV_MODE=1``) this raises
        :class:`ReloadUnsupported <rolloutd.daemon.llm.weights.ReloadUnsupported>`."""
        if partial:
            raise WeightsError(f"{self.name}: vLLM reloads a whole checkpoint; partial=true is not supported")
        if self.checkpoint is not None:
            await trio.to_thread.run_sync(check_checkpoint, path, self.checkpoint)
        started = time.monotonic()
        try:
            await self._request(
                "POST", "/collective_rpc", what="reload", rejected=WeightsError,
                json={"method": "reload_weights", "kwargs": {"weights_path": path}},
                timeout=httpx.Timeout(RELOAD_HTTP_TIMEOUT_S),
            )
        except WeightsError as exc:
            if "HTTP 404" in str(exc):
                raise reload_unsupported(self, "start vLLM with VLLM_SERVER_DEV_MODE=1 for /collective_rpc") from None
            raise
        except BackendUnavailable as exc:
            # vLLM answers 500 when a worker's reload_weights raised (no such path, a tensor
            # of the wrong shape); the server itself is still up.
            if await self.health():
                raise WeightsError(f"{self.name}: reload_weights failed: {exc}") from None
            raise
        await self._request("POST", "/reset_prefix_cache", what="reset prefix cache")
        self.weights_path = path
        return {"path": path, "weights_version": version, "engine": "vllm",
                "seconds": round(time.monotonic() - started, 3)}


class ModelServerBackend(VLLMBackend):
    """A ``rolloutd model-server`` at ``url`` (kind ``model-server``): the vLLM client, plus
    weight sync through the server's own ``POST /v1/reload`` (:class:`~rolloutd.daemon.llm.weights.Reloadable`)."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        *,
        name: str | None = None,
        connect_timeout_s: float = 5.0,
        uds: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            url, model, kind="model-server", name=name, connect_timeout_s=connect_timeout_s, uds=uds,
            transport=transport,
        )

    async def reload_weights(self, path: str, *, partial: bool = False, version: int | None = None) -> dict[str, Any]:
        """``POST {url}/v1/reload {"path", "partial", "version"}``: the server loads the weights
        after the generation in progress, drops its cache and reports ``version`` as
        ``weights_version``. 4xx is :class:`WeightsError`; no answer or 5xx, :class:`BackendUnavailable`."""
        if not self.url:
            raise reload_unsupported(self)
        resp = await self._request(
            "POST", "/v1/reload", what="reload", rejected=WeightsError,
            json={"path": path, "partial": partial, "version": version},
            timeout=httpx.Timeout(RELOAD_HTTP_TIMEOUT_S),
        )
        return dict(resp.json())


def http_backend(
    url: str, model: str | None = None, *, kind: str = "vllm", name: str | None = None, uds: str | None = None,
    checkpoint: str | None = None,
) -> VLLMBackend:
    """The client for a server of ``kind`` at ``url`` (or on the Unix socket ``uds``;
    ``make_backend`` and ``spawn`` build theirs here): a :class:`ModelServerBackend` for
    ``model-server``, else a :class:`VLLMBackend` labelled ``kind``."""
    if kind == "model-server":
        return ModelServerBackend(url, model, name=name, uds=uds)
    return VLLMBackend(url, model, kind=kind, name=name, uds=uds, checkpoint=checkpoint)
