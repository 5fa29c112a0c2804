"""What every LLM backend is: token ids in, sampled token ids and their logprobs out.

Errors raised by ``rolloutd.daemon.llm`` (one tree)::

    LLMError
    ├── BackendUnavailable    unreachable / 5xx / died mid-request: the pool retries elsewhere
    ├── BackendRejected       the backend refused the request (4xx): retrying elsewhere won't help
    │   └── WeightsError      weights that cannot be loaded (rolloutd.daemon.llm.weights)
    │       └── ReloadUnsupported   a backend that cannot load weights from a directory
    ├── BadResponse           an answer we cannot trust (ids and logprobs differ in length, ...)
    ├── NoBackend             no healthy, unpaused backend is registered
    ├── BackendSpecError      a backend spec (``make_backend``) is malformed; also a ValueError
    ├── RequestError          a chat request that cannot be served (``openai_api``; its HTTP
    │                         status and field); also a ValueError
    ├── ServerFailed          a supervised server cannot be kept running (``spawn``)
    ├── EngineUnavailable     the vLLM CPU engine was required where it cannot run (``cpu_engine``)
    └── RenderError           the token renderer could not keep the conversation append-only
        └── PrefixMismatch    a new prompt does not extend the previous one (a trajectory error)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from rolloutd.daemon.errors import DaemonError


class SamplingParams(BaseModel):
    """Sampling fields sent explicitly with every request (never left to server defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    seed: int | None = Field(
        None,
        description="Makes sampling reproducible. Each LLM call of a rollout gets its own seed, "
        "derived from this one, the sample's index in its group and the call's index, so the "
        "samples of a group differ and a rerun draws the same tokens (see docs/llm.md).",
    )
    stop_token_ids: list[int] = Field(default_factory=list)

    def for_call(self, sample: int, call: int) -> SamplingParams:
        """The parameters of call ``call`` of sample ``sample``: with a ``seed``, that call's
        own seed (:func:`call_seed`); without one, these."""
        if self.seed is None:
            return self
        return self.model_copy(update={"seed": call_seed(self.seed, sample, call)})


def call_seed(seed: int, sample: int, call: int) -> int:
    """The seed of one LLM call: a hash of (seed, sample index, call index), in [0, 2**31)
    (every server takes it)."""
    digest = hashlib.blake2b(f"{seed}:{sample}:{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFF_FFFF


@dataclass
class Completion:
    """One sampled continuation. ``token_ids`` and ``logprobs`` have equal length."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    backend: str = ""
    cached_tokens: int | None = None
    extra: dict[str, object] = field(default_factory=dict)


class LLMError(DaemonError):
    """Base of every error raised by rolloutd.daemon.llm."""


class BackendUnavailable(LLMError):
    """The backend could not be reached or answered 5xx; another backend may serve the turn."""


class BadResponse(LLMError):
    """The backend answered something we cannot trust (e.g. ids and logprobs of different length)."""


class BackendRejected(LLMError):
    """The backend refused the request (4xx, e.g. prompt longer than its context)."""


class NoBackend(LLMError):
    """No healthy, unpaused backend is registered."""


class BackendSpecError(LLMError, ValueError):
    """A backend spec given to ``make_backend`` is malformed; the message names the field."""


class RenderError(LLMError):
    """The chat renderer cannot produce an append-only continuation of the conversation."""


class PrefixMismatch(RenderError):
    """A new prompt does not start with the previous one: never silently re-encoded."""

    def __init__(self, message: str, *, position: int) -> None:
        super().__init__(message)
        self.position = position


class Backend(Protocol):
    """A single inference endpoint (a vLLM server, the embedded model, a test double).

    ``name`` labels completions; ``kind`` is the spec kind (``vllm``, ``model-server``,
    ``transformers``, ``scripted``); ``url`` is None for in-process backends.
    ``complete`` must be cancellable: cancelling it aborts the request on the backend.
    """

    name: str

    @property
    def kind(self) -> str: ...

    @property
    def url(self) -> str | None: ...

    async def complete(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, max_tokens: int
    ) -> Completion: ...

    async def health(self) -> bool: ...

    async def aclose(self) -> None: ...
