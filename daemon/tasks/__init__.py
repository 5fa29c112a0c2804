"""Task kinds: what a task is, how its prompt and sandbox are made, and how it is scored.

Public API (a plug-in kind subclasses TaskHandler; see docs/tasks.md)::

    TaskHandler, Prompt, Reward, EvalContext      a kind's contract
    TaskRegistry, ENTRY_POINT_GROUP               the kinds a daemon knows (built-in + plug-ins)
    TaskError, TaskFileError                      a malformed task or task file
    TaskFailure                                   a stage failed, not the model (failed, unusable)
    load_tasks, parse_tasks                       JSONL task files
    model_kind, describe_errors                   helpers for a kind's pydantic model

The built-in kinds live in their modules (``rolloutd.daemon.tasks.math`` ...; ``registry.BUILTIN``).
"""

from rolloutd.daemon.tasks.base import (
    EvalContext,
    Prompt,
    Reward,
    TaskError,
    TaskFailure,
    TaskHandler,
    describe_errors,
    model_kind,
)
from rolloutd.daemon.tasks.jsonl import TaskFileError, load_tasks, parse_tasks
from rolloutd.daemon.tasks.registry import ENTRY_POINT_GROUP, TaskRegistry

__all__ = [
    "ENTRY_POINT_GROUP",
    "EvalContext",
    "Prompt",
    "Reward",
    "TaskError",
    "TaskFailure",
    "TaskFileError",
    "TaskHandler",
    "TaskRegistry",
    "describe_errors",
    "load_tasks",
    "model_kind",
    "parse_tasks",
]
