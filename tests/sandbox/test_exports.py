"""The public surface of sandbox/ is exactly __all__ (like httpx's test_exported_members)."""

from __future__ import annotations

import types

from rolloutd import sandbox

EXPECTED = {
    "BACKENDS",
    "ApptainerBackend",
    "Backend",
    "Bind",
    "BwrapBackend",
    "DirEntry",
    "FileStat",
    "LocalBackend",
    "PathEscapeError",
    "RunResult",
    "Sandbox",
    "SandboxClosed",
    "SandboxError",
    "SandboxProcess",
    "SandboxSpec",
    "SandboxStartError",
    "SandboxSupervisor",
    "open_backend",
}


def test_all_is_exactly_the_public_api():
    assert set(sandbox.__all__) == EXPECTED
    for name in sandbox.__all__:
        assert hasattr(sandbox, name), name
    public = {
        n
        for n, v in vars(sandbox).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert public == EXPECTED


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
