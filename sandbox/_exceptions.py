"""The sandbox package's exception tree.

    SandboxError
    ├── SandboxStartError      a sandbox (or its backend) could not be started
    │   └── ImageError         an image cannot be found, read or unpacked
    │       └── ImageNotFound  a ref that is neither a stored image nor an existing source
    ├── SandboxClosed          the sandbox is gone: released, expired, or its helper died
    └── PathEscapeError        a file path resolves outside the sandbox's file roots
                               (also a PermissionError)

File operations raise the builtin ``OSError`` subclasses (``FileNotFoundError``,
``IsADirectoryError``, ...) for ordinary file-system errors inside the sandbox.
"""

from __future__ import annotations


class SandboxError(Exception):
    """Base class of every error raised by the sandbox package."""


class SandboxStartError(SandboxError):
    """A sandbox could not be opened, or its backend is unavailable."""


class SandboxClosed(SandboxError):
    """The sandbox is closed: released, past its lifetime, or its helper is gone."""


class PathEscapeError(SandboxError, PermissionError):
    """A path resolves (through ``..`` or a symlink) outside the sandbox's file roots."""


class ImageError(SandboxStartError):
    """An image cannot be found, read or unpacked; the message says which and why."""


class ImageNotFound(ImageError):
    """A ref that is neither a stored image (name, digest, prefix) nor an existing source."""
