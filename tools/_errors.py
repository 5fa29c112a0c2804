"""The tools package's exception tree.

::

    ToolError                 infrastructure failure: the sandbox is gone, a shell or kernel
    └── ToolStartError        cannot be started at all

The model's own mistakes (unknown tool, bad arguments, a failing command, a missing file)
are never exceptions: they come back as a :class:`~tools.ToolResult` with ``ok=False``.
"""

from __future__ import annotations

__all__ = ["ToolError", "ToolStartError"]


class ToolError(Exception):
    """A tool cannot run because of the infrastructure (sandbox closed, helper gone)."""


class ToolStartError(ToolError):
    """A shell or kernel could not be started inside the sandbox."""
