"""The public surfaces of daemon/ and its packages are exactly their ``__all__`` (like httpx's
test_exported_members), and every error daemon/ defines is in its one tree."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest

from rolloutd import daemon
from rolloutd.daemon import api, llm, tasks
from rolloutd.daemon.errors import DaemonError

REPO = Path(__file__).resolve().parents[2]

DAEMON = {
    "AgentLimits", "AsyncClient", "BadRequest", "BatchGroup", "BatchRequest", "Client",
    "ConfigError", "DaemonError", "Draining", "ErrorInfo", "GroupFilter", "IdempotencyConflict",
    "InvalidBackend", "InvalidRequest", "InvalidTask", "Node", "NotFound", "QueueFullError",
    "ReloadFailed", "RequestError", "RolloutRequest", "RolloutdError", "SamplingParams",
    "ServiceUnavailable", "Settings", "Stage", "Status", "Submission", "TaskError", "TaskHandler",
    "TaskRegistry", "TooManyBatches", "Trajectory", "Turn", "create_app", "run",
}
API = {
    "ANSWERS", "NDJSON", "BackendRegistration", "BatchStatus", "ErrorResponse", "GroupSummary",
    "KeptGroup", "Parts", "PolicyVersion", "ReloadRequest", "SubmitResponse", "WaitResponse",
    "create_app",
}
LLM = {
    "Backend", "BackendPool", "BackendRejected", "BackendSpec", "BackendSpecError",
    "BackendUnavailable", "BadResponse", "ChatFamily", "ChatRenderer", "Completion", "FAMILIES",
    "LLMError", "NoBackend", "PrefixMismatch", "RESERVED_IDS", "ReloadRequest", "ReloadUnsupported",
    "Reloadable", "RenderError", "SamplingParams", "WeightsError", "check_extends",
    "embedded_renderer", "load_embedded_tokenizer", "load_weights", "make_backend", "parse_spec",
    "weight_files",
}
TASKS = {
    "ENTRY_POINT_GROUP", "EvalContext", "Prompt", "Reward", "TaskError", "TaskFileError",
    "TaskHandler", "TaskRegistry", "describe_errors", "load_tasks", "model_kind", "parse_tasks",
}


def _public(module: types.ModuleType) -> set[str]:
    """Public attributes that are not submodules."""
    return {n for n, v in vars(module).items()
            if not n.startswith("_") and not isinstance(v, types.ModuleType)} - {"annotations"}


@pytest.mark.parametrize(("module", "expected"),
                         [(api, API), (llm, LLM), (tasks, TASKS)])
def test_all_is_exactly_the_public_api(module: types.ModuleType, expected: set[str]) -> None:
    assert set(module.__all__) == expected
    for name in module.__all__:
        assert hasattr(module, name), name
    assert _public(module) == expected


def test_daemon_all_is_exactly_the_public_api_and_loads_lazily() -> None:
    assert set(daemon.__all__) == DAEMON
    for name in daemon.__all__:
        assert getattr(daemon, name) is not None, name
    assert _public(daemon) == DAEMON
    assert set(dir(daemon)) >= DAEMON
    with pytest.raises(AttributeError):
        daemon.nothing_here  # noqa: B018
    # the client does not load the server's dependencies
    name = daemon.__name__
    code = (f"import importlib, sys; importlib.import_module({name!r}).Client; "
            f"print('quart' in sys.modules, {name + '.node'!r} in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout.split()
    assert out == ["False", "False"]


def _error_classes() -> list[type[BaseException]]:
    """Every exception class defined in daemon/ (found in the source, then imported)."""
    found = []
    for path in sorted((REPO / "daemon").rglob("*.py")):
        rel = path.relative_to(REPO / "daemon").with_suffix("")
        name = ".".join([daemon.__name__, *(rel.parts[:-1] if rel.name == "__init__" else rel.parts)])
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                module = importlib.import_module(name)
                cls = getattr(module, node.name)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    found.append(cls)
    return found


def test_every_daemon_error_is_a_daemon_error() -> None:
    classes = _error_classes()
    assert len(classes) > 20
    outside = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, DaemonError)]
    assert outside == []


def test_every_request_error_has_an_answer() -> None:
    from rolloutd.daemon.api import ANSWERS
    from rolloutd.daemon.api._errors import answer_for
    from rolloutd.daemon.errors import RequestError

    for cls in _error_classes():
        if issubclass(cls, RequestError) and cls is not RequestError:
            status, etype = answer_for(cls("x"))  # type: ignore[misc]
            assert 400 <= status < 600 and etype, cls
    assert {s for s, _ in ANSWERS.values()} == {400, 404, 409, 422, 429, 503}
