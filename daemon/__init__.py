"""rolloutd's daemon: the HTTP service that runs agent rollouts, and its client.

Public API::

    Client, AsyncClient, Submission, BatchGroup, RolloutdError     talk to a daemon
    Settings, Node, run, create_app                                run one
    RolloutRequest, BatchRequest, GroupFilter, AgentLimits,
    SamplingParams                                                  what a request holds
    Trajectory, Turn, Status, Stage, ErrorInfo                     what comes back
    TaskHandler, TaskRegistry, TaskError                           task kinds
    DaemonError and the request errors (daemon.errors)             the error tree

Names are imported on first use (PEP 562), so ``from daemon import Client`` does not load
the server's dependencies. Where things live: README.md, "Development".
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from daemon.agent import AgentLimits
    from daemon.api import create_app
    from daemon.batch import BatchRequest, GroupFilter
    from daemon.client import AsyncClient, BatchGroup, Client, RolloutdError, Submission
    from daemon.config import ConfigError, Settings
    from daemon.errors import (
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
    from daemon.llm.base import SamplingParams
    from daemon.node import Node, run
    from daemon.service import RolloutRequest
    from daemon.tasks.base import TaskError, TaskHandler
    from daemon.tasks.registry import TaskRegistry
    from daemon.trajectory import ErrorInfo, Stage, Status, Trajectory, Turn

_WHERE = {
    "AgentLimits": "daemon.agent",
    "create_app": "daemon.api",
    **dict.fromkeys(("AsyncClient", "BatchGroup", "Client", "RolloutdError", "Submission"),
                    "daemon.client"),
    **dict.fromkeys(("ConfigError", "Settings"), "daemon.config"),
    **dict.fromkeys(
        ("BadRequest", "DaemonError", "Draining", "IdempotencyConflict", "InvalidBackend",
         "InvalidRequest", "InvalidTask", "NotFound", "QueueFullError", "ReloadFailed",
         "RequestError", "ServiceUnavailable", "TooManyBatches"),
        "daemon.errors",
    ),
    "SamplingParams": "daemon.llm.base",
    **dict.fromkeys(("Node", "run"), "daemon.node"),
    **dict.fromkeys(("BatchRequest", "GroupFilter"), "daemon.batch"),
    "RolloutRequest": "daemon.service",
    **dict.fromkeys(("TaskError", "TaskHandler"), "daemon.tasks.base"),
    "TaskRegistry": "daemon.tasks.registry",
    **dict.fromkeys(("ErrorInfo", "Stage", "Status", "Trajectory", "Turn"), "daemon.trajectory"),
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
