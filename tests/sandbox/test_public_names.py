"""What sandbox/'s public names mean (that they are exactly ``__all__``: tests/test_exports.py)."""

from __future__ import annotations

from rolloutd import sandbox
from rolloutd.sandbox import images  # noqa: F401  (sandbox.images below)


def test_backends():
    assert sandbox.BACKENDS == {
        "bwrap": sandbox.BwrapBackend,
        "apptainer": sandbox.ApptainerBackend,
        "local": sandbox.LocalBackend,
    }
    for backend in sandbox.BACKENDS.values():
        assert issubclass(backend, sandbox.Backend)


def test_error_tree():
    for name in ("SandboxStartError", "SandboxClosed", "PathEscapeError"):
        assert issubclass(getattr(sandbox, name), sandbox.SandboxError)
    assert issubclass(sandbox.PathEscapeError, PermissionError)
    assert issubclass(sandbox.ImageNotFound, sandbox.ImageError)
    assert issubclass(sandbox.ImageError, sandbox.SandboxStartError)
    assert sandbox.images.ImageError is sandbox.ImageError
