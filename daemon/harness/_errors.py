"""The harness package's exceptions (one tree)::

    HarnessError           a harness-driven rollout could not run (bad install, no sandbox)
    └── ApiError           a call to the rollout's endpoint is refused: an HTTP status and a
                           message the harness can show (OpenAI or Anthropic error shape)
"""

from __future__ import annotations

from rolloutd.daemon.errors import DaemonError


class HarnessError(DaemonError):
    """A harness-driven rollout could not run."""


class ApiError(HarnessError):
    """A refused endpoint call. ``kind``: the OpenAI ``error.type``; ``code``: its ``error.code``."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.code = code
        self.param = param
