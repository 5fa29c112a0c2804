"""The daemon's one error tree. Every error daemon/ raises on purpose is a DaemonError.

    DaemonError
    ├─ RequestError          a request that cannot be served as asked (answered 4xx/503)
    │  ├─ BadRequest             the request cannot be read
    │  ├─ InvalidRequest         it reads, but fails validation
    │  │  ├─ InvalidTask             a task (or a limit beside it) is malformed
    │  │  ├─ InvalidBackend          a backend spec is malformed
    │  │  ├─ InvalidImage            an image that cannot be found or read
    │  │  └─ ReloadFailed            weights that cannot be loaded
    │  ├─ NotFound               no such rollout, batch, backend or route
    │  ├─ IdempotencyConflict    an idempotency key reused with another body
    │  ├─ ImageInUse             an image a live sandbox uses cannot be removed
    │  ├─ QueueFullError         no room now; retry after ``retry_after_s``
    │  ├─ TooManyBatches         too many batches running; retry later
    │  ├─ Draining               the daemon takes no new work
    │  └─ ServiceUnavailable     a part it needs is missing or unreachable
    ├─ ConfigError, JournalError, PipelineError, QueueFull, QueueClosed, JobFinished,
    │  BatchEnded, PeerUnavailable, CliError       (in their modules)
    ├─ rolloutd.daemon.llm.LLMError       the LLM layer's branch
    ├─ rolloutd.daemon.tasks.TaskError    a malformed task
    └─ rolloutd.daemon.client.RolloutdError   what the client raises for an error answer

This module knows nothing of HTTP: the API layer alone maps each RequestError to a status
code and an error type (``rolloutd.daemon.api``'s error table).
"""

from __future__ import annotations

from typing import Any


class DaemonError(Exception):
    """Base of every error the daemon raises on purpose."""


class RequestError(DaemonError):
    """A request that cannot be served as asked; the message is for the client.

    ``retry_after_s``: when the same request may succeed later, how long to wait.
    """

    def __init__(self, message: str, *, retry_after_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after_s = retry_after_s


class BadRequest(RequestError):
    """The request cannot be read: no body, not JSON, nested too deep, a bad query string."""


class InvalidRequest(RequestError):
    """The request reads but fails validation."""


class InvalidTask(InvalidRequest):
    """A task is malformed, or a setting-bounded field beside it is out of range."""


class InvalidBackend(InvalidRequest):
    """A backend spec is malformed."""


class InvalidImage(InvalidRequest):
    """An image (a task's, or one to import) that cannot be found or read."""


class ReloadFailed(InvalidRequest):
    """Weights that cannot be loaded into a backend (the backend keeps its old ones)."""


class NotFound(RequestError):
    """No such rollout, batch or backend."""


class IdempotencyConflict(RequestError):
    """An idempotency key was reused with another request body."""


class NotReplayable(RequestError):
    """A rollout that cannot be replayed: not finished, no turns, or its task is not held."""


class ImageInUse(RequestError):
    """An image that a live sandbox uses cannot be removed now."""


class QueueFullError(RequestError):
    """The intake queue has no room for the request now."""


class StreamBusy(RequestError):
    """A batch of the same sampling stream is still running (a stream runs one at a time)."""


class TooManyBatches(RequestError):
    """As many batches as the sampler runs at once are running."""


class Draining(RequestError):
    """The daemon is draining (or not yet running) and takes no new work."""


class ServiceUnavailable(RequestError):
    """A part the request needs is missing or unreachable (no backend pool, a peer down, the
    journal unwritable)."""


__all__ = [
    "BadRequest",
    "DaemonError",
    "Draining",
    "IdempotencyConflict",
    "ImageInUse",
    "InvalidBackend",
    "InvalidImage",
    "InvalidRequest",
    "InvalidTask",
    "NotFound",
    "NotReplayable",
    "QueueFullError",
    "ReloadFailed",
    "RequestError",
    "ServiceUnavailable",
    "StreamBusy",
    "TooManyBatches",
]
