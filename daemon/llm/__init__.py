"""LLM backends, token rendering, tool-call parsing and routing.

Public API (the daemon uses only these names)::

    BackendPool, make_backend, parse_spec          routing and backends from JSON specs
    ChatRenderer, ChatFamily, FAMILIES, check_extends, load_embedded_tokenizer, embedded_renderer
    SamplingParams, Completion, Backend            the backend contract
    LLMError and its subclasses                    the error tree (see daemon.llm.base)

Backends live in their modules: ``daemon.llm.vllm.VLLMBackend``,
``daemon.llm.transformers.TransformersBackend`` (embedded SmolLM2),
``daemon.llm.scripted.ScriptedBackend`` (test double); ``daemon.llm.model_server`` serves the
embedded model over HTTP; ``daemon.llm.spawn`` supervises ``vllm serve`` children.
"""

from daemon.llm._factory import BackendSpec, make_backend, parse_spec
from daemon.llm.base import (
    Backend,
    BackendRejected,
    BackendSpecError,
    BackendUnavailable,
    BadResponse,
    Completion,
    LLMError,
    NoBackend,
    PrefixMismatch,
    RenderError,
    SamplingParams,
)
from daemon.llm.chat import (
    FAMILIES,
    ChatFamily,
    ChatRenderer,
    check_extends,
    embedded_renderer,
    load_embedded_tokenizer,
)
from daemon.llm.pool import BackendPool

__all__ = [
    "FAMILIES",
    "Backend",
    "BackendPool",
    "BackendRejected",
    "BackendSpec",
    "BackendSpecError",
    "BackendUnavailable",
    "BadResponse",
    "ChatFamily",
    "ChatRenderer",
    "Completion",
    "LLMError",
    "NoBackend",
    "PrefixMismatch",
    "RenderError",
    "SamplingParams",
    "check_extends",
    "embedded_renderer",
    "load_embedded_tokenizer",
    "make_backend",
    "parse_spec",
]
