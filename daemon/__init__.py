"""rolloutd's daemon: the HTTP service that runs agent rollouts, and its client.

Public API::

    Client, AsyncClient, Submission, BatchGroup, RolloutdError     talk to a daemon
    Settings, Node, run, create_app                                run one
    RolloutRequest, BatchRequest, GroupFilter, AgentLimits,
    SamplingParams                                                  what a request holds
    Trajectory, Turn, Status, Stage, ErrorInfo                     what comes back
    TaskHandler, TaskRegistry, TaskError                           task kinds
    DaemonError and the request errors (rolloutd.daemon.errors)             the error tree

Names are imported on first use (PEP 562), so ``from rolloutd.daemon import Client`` does not load
the server's dependencies. Where things live: README.md, "Development".
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from rolloutd.daemon.agent import AgentLimits
    from rolloutd.daemon.api import create_app
    from rolloutd.daemon.batch import BatchRequest, GroupFilter
    from rolloutd.daemon.client import AsyncClient, BatchGroup, Client, RolloutdError, Submission
    from rolloutd.daemon.config import ConfigError, Settings
    from rolloutd.daemon.errors import (
        BadRequest,
        DaemonError,
        Draining,
        IdempotencyConflict,
        InvalidBackend,
        InvalidRequest,
        InvalidTask,
        NotFound,
        QueueFullError,
        ReloadFailed,
        RequestError,
        ServiceUnavailable,
        TooManyBatches,
    )
    from rolloutd.daemon.llm.base import SamplingParams
    from rolloutd.daemon.node import Node, run
    from rolloutd.daemon.service import RolloutRequest
    from rolloutd.daemon.tasks.base import TaskError, TaskHandler
    from rolloutd.daemon.tasks.registry import TaskRegistry
    from rolloutd.daemon.trajectory import ErrorInfo, Stage, Status, Trajectory, Turn

_WHERE = {
    "AgentLimits": "rolloutd.daemon.agent",
    "create_app": "rolloutd.daemon.api",
    **dict.fromkeys(("AsyncClient", "BatchGroup", "Client", "RolloutdError", "Submission"),
                    "rolloutd.daemon.client"),
    **dict.fromkeys(("ConfigError", "Settings"), "rolloutd.daemon.config"),
    **dict.fromkeys(
        ("BadRequest", "DaemonError", "Draining", "IdempotencyConflict", "InvalidBackend",
         "InvalidRequest", "InvalidTask", "NotFound", "QueueFullError", "ReloadFailed",
         "RequestError", "ServiceUnavailable", "TooManyBatches"),
        "rolloutd.daemon.errors",
    ),
    "SamplingParams": "rolloutd.daemon.llm.base",
    **dict.fromkeys(("Node", "run"), "rolloutd.daemon.node"),
    **dict.fromkeys(("BatchRequest", "GroupFilter"), "rolloutd.daemon.batch"),
    "RolloutRequest": "rolloutd.daemon.service",
    **dict.fromkeys(("TaskError", "TaskHandler"), "rolloutd.daemon.tasks.base"),
    "TaskRegistry": "rolloutd.daemon.tasks.registry",
    **dict.fromkeys(("ErrorInfo", "Stage", "Status", "Trajectory", "Turn"), "rolloutd.daemon.trajectory"),
}

__all__ = [
    "AgentLimits",
    "AsyncClient",
    "BadRequest",
    "BatchGroup",
    "BatchRequest",
    "Client",
    "ConfigError",
    "DaemonError",
    "Draining",
    "ErrorInfo",
    "GroupFilter",
    "IdempotencyConflict",
    "InvalidBackend",
    "InvalidRequest",
    "InvalidTask",
    "Node",
    "NotFound",
    "QueueFullError",
    "ReloadFailed",
    "RequestError",
    "RolloutRequest",
    "RolloutdError",
    "SamplingParams",
    "ServiceUnavailable",
    "Settings",
    "Stage",
    "Status",
    "Submission",
    "TaskError",
    "TaskHandler",
    "TaskRegistry",
    "TooManyBatches",
    "Trajectory",
    "Turn",
    "create_app",
    "run",
]


def __getattr__(name: str) -> _typing.Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
