"""LLM backends, token rendering, tool-call parsing and routing.

Public API (the daemon uses only these names)::

    BackendPool, make_backend, parse_spec          routing and backends from JSON specs
    ChatRenderer, ChatFamily, FAMILIES, check_extends, load_embedded_tokenizer, embedded_renderer
    SamplingParams, Completion, Backend            the backend contract
    ReloadRequest, Reloadable, load_weights, weight_files
                                                   weight sync from a directory (rolloutd.daemon.llm.weights;
                                                   BackendPool.reload does the whole sync)
    LLMError and its subclasses                    the error tree (see rolloutd.daemon.llm.base), with
                                                   WeightsError and ReloadUnsupported

Backends live in their modules: ``rolloutd.daemon.llm.vllm.VLLMBackend`` and its
``ModelServerBackend`` (``rolloutd model-server``, which can reload weights),
``rolloutd.daemon.llm.transformers.TransformersBackend`` (embedded SmolLM2),
``rolloutd.daemon.llm.scripted.ScriptedBackend`` (test double); ``rolloutd.daemon.llm.model_server`` serves the
embedded model over HTTP; ``rolloutd.daemon.llm.spawn`` supervises ``vllm serve`` children.

Inside the package, modules import each other by their own names (never ``from rolloutd.daemon.llm
import ...``, which would import this file), and ``rolloutd.daemon.llm.weights`` imports no backend,
pool or factory: there is no import cycle.
"""

from rolloutd.daemon.llm._factory import RESERVED_IDS, BackendSpec, make_backend, parse_spec
from rolloutd.daemon.llm.base import (
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
from rolloutd.daemon.llm.chat import (
    FAMILIES,
    ChatFamily,
    ChatRenderer,
    check_extends,
    embedded_renderer,
    load_embedded_tokenizer,
)
from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.llm.weights import (
    Reloadable,
    ReloadRequest,
    ReloadUnsupported,
    WeightsError,
    load_weights,
    weight_files,
)

__all__ = [
    "FAMILIES",
    "RESERVED_IDS",
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
    "ReloadRequest",
    "ReloadUnsupported",
    "Reloadable",
    "RenderError",
    "SamplingParams",
    "WeightsError",
    "check_extends",
    "embedded_renderer",
    "load_embedded_tokenizer",
    "load_weights",
    "make_backend",
    "parse_spec",
    "weight_files",
]
