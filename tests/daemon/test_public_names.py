"""daemon/'s names load on first use, and every error daemon/ defines is in its one tree
(that the public names are exactly ``__all__``: tests/test_exports.py)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutd import daemon
from rolloutd.daemon.errors import DaemonError

REPO = Path(__file__).resolve().parents[2]


def test_daemon_names_load_lazily() -> None:
    assert set(dir(daemon)) >= set(daemon.__all__)
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
