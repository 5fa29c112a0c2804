"""``make_backend``: a backend from a JSON spec (config files and ``POST /v1/backends``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from rolloutd.daemon.llm.base import Backend, BackendSpecError
from rolloutd.daemon.llm.chat import ChatRenderer

#: Path segments beside backend ids under /v1/backends: never an id.
RESERVED_IDS = ("pause", "resume")


def _not_reserved(value: str | None) -> str | None:
    if value in RESERVED_IDS:
        raise ValueError(f"{value!r} is a fixed path segment under /v1/backends")
    return value


BackendId = Annotated[
    str | None,
    Field(min_length=1, pattern=r"^[^/]+$", json_schema_extra={"not": {"enum": list(RESERVED_IDS)}},
          description="The backend's id in the pool (default: generated)."),
    AfterValidator(_not_reserved),
]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: BackendId = None


class VLLMSpec(_Spec):
    kind: Literal["vllm"]
    url: str
    model: str | None = None
    name: str | None = None


class ModelServerSpec(_Spec):
    kind: Literal["model-server"]
    url: str
    model: str | None = None
    name: str | None = None


class TransformersSpec(_Spec):
    kind: Literal["transformers"]
    threads: int | None = Field(None, ge=1)


class ScriptedSpec(_Spec):
    """TEST DOUBLE: replays ``replies``; labelled ``scripted (test double)``."""

    kind: Literal["scripted"]
    replies: list[str] = Field(min_length=1)
    latency_s: float = Field(0.0, ge=0.0)
    per_token_s: float = Field(0.0, ge=0.0)


BackendSpec = Annotated[
    VLLMSpec | ModelServerSpec | TransformersSpec | ScriptedSpec, Field(discriminator="kind")
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(BackendSpec)


def parse_spec(spec: dict[str, Any]) -> VLLMSpec | ModelServerSpec | TransformersSpec | ScriptedSpec:
    try:
        return _ADAPTER.validate_python(spec)  # type: ignore[no-any-return]
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "spec"
        raise BackendSpecError(f"backend spec: {where}: {first['msg']}") from None


def make_backend(spec: dict[str, Any], *, renderer: ChatRenderer | None = None) -> Backend:
    """Build (not start) a backend (its ``id``, if given, is for the pool). Kinds::

        {"kind": "vllm", "url": "http://h:8000", "model": "name"?}
        {"kind": "model-server", "url": "http://h:8100"}        # rolloutd model-server
        {"kind": "transformers", "threads": 2?}                 # embedded SmolLM2, loads lazily
        {"kind": "scripted", "replies": ["..."], "latency_s": 0.0}   # TEST DOUBLE

    ``scripted`` tokenizes with ``renderer`` (default: the embedded SmolLM2 renderer, which
    loads the tokenizer: blocking, fast once cached). Raises :class:`BackendSpecError`.
    """
    s = parse_spec(spec)
    if isinstance(s, VLLMSpec | ModelServerSpec):
        from rolloutd.daemon.llm.vllm import http_backend

        return http_backend(s.url, s.model, kind=s.kind, name=s.name)
    if isinstance(s, TransformersSpec):
        from rolloutd.daemon.llm.transformers import TransformersBackend

        return TransformersBackend(threads=s.threads)
    from rolloutd.daemon.llm.chat import embedded_renderer
    from rolloutd.daemon.llm.scripted import ScriptedBackend

    return ScriptedBackend(
        renderer or embedded_renderer(), s.replies, latency_s=s.latency_s, per_token_s=s.per_token_s
    )
