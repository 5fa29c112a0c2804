"""The HTTP API v1: quart-trio routes over a node's parts. No business logic.

``create_app(node)`` builds the application. Routes live in one module per resource
(``_rollouts``, ``_batches``, ``_backends``, ``_operations``, ``_federation``, ``_ui``
for the dashboard's files), each with a
``register(app, part)`` that depends on a narrow protocol of what it calls; ``_http`` holds
what they share and ``_errors`` maps daemon errors to status codes (the only place that does).
"""

from rolloutd.daemon.api._app import Parts, create_app
from rolloutd.daemon.api._backends import BackendRegistration, PolicyVersion, ReloadRequest
from rolloutd.daemon.api._batches import BatchStatus, GroupSummary, KeptGroup
from rolloutd.daemon.api._errors import ANSWERS
from rolloutd.daemon.api._http import NDJSON, ErrorResponse
from rolloutd.daemon.api._rollouts import SubmitResponse, WaitResponse

__all__ = [
    "ANSWERS",
    "NDJSON",
    "BackendRegistration",
    "BatchStatus",
    "ErrorResponse",
    "GroupSummary",
    "KeptGroup",
    "Parts",
    "PolicyVersion",
    "ReloadRequest",
    "SubmitResponse",
    "WaitResponse",
    "create_app",
]
