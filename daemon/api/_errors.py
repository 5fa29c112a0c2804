"""The one place daemon errors become HTTP answers: a status code and an error type each.

A ``RequestError`` whose class (or nearest ancestor) is in ``ANSWERS`` is answered with that
status and its message; anything else that escapes a route is a bug, answered 500 and logged.
"""

from __future__ import annotations

from rolloutd.daemon.errors import (
    BadRequest,
    Draining,
    IdempotencyConflict,
    ImageInUse,
    InvalidBackend,
    InvalidImage,
    InvalidRequest,
    InvalidTask,
    NotFound,
    NotReplayable,
    QueueFullError,
    ReloadFailed,
    RequestError,
    ServiceUnavailable,
    StreamBusy,
    TooManyBatches,
)

#: status code and ``error.type`` per error class; subclasses answer as their nearest
#: listed ancestor.
ANSWERS: dict[type[RequestError], tuple[int, str]] = {
    BadRequest: (400, "bad_request"),
    NotFound: (404, "not_found"),
    IdempotencyConflict: (409, "idempotency_conflict"),
    ImageInUse: (409, "image_in_use"),
    NotReplayable: (409, "not_replayable"),
    StreamBusy: (409, "stream_busy"),
    InvalidRequest: (422, "invalid_request"),
    InvalidTask: (422, "invalid_task"),
    InvalidBackend: (422, "invalid_backend"),
    InvalidImage: (422, "invalid_image"),
    ReloadFailed: (422, "reload_failed"),
    QueueFullError: (429, "queue_full"),
    TooManyBatches: (429, "too_many_batches"),
    Draining: (503, "draining"),
    ServiceUnavailable: (503, "unavailable"),
}

#: ``error.type`` of the answers werkzeug's own HTTP errors give (routing, body size, ...).
HTTP_TYPES = {
    400: "bad_request", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
    413: "body_too_large",
}


def answer_for(exc: RequestError) -> tuple[int, str] | None:
    """The status and type ``exc`` is answered with; None for an unmapped error (a bug)."""
    for cls in type(exc).__mro__:
        if cls in ANSWERS:
            return ANSWERS[cls]
    return None
