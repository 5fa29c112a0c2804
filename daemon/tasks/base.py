"""The task-handler interface: how a kind of task is set up, prompted and scored."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, get_args

from pydantic import BaseModel, ValidationError

from rolloutd.daemon.errors import DaemonError

if TYPE_CHECKING:
    from rolloutd.daemon.trajectory import Trajectory
    from rolloutd.sandbox import Sandbox, SandboxSpec


class TaskError(DaemonError):
    """A task is malformed; the message names the field. The API answers 422."""


class TaskFailure(DaemonError):
    """A stage could not do its work for a reason that is not the model's (a test patch that
    does not apply to the instance, an eval script that never reaches its tests, listed tests
    the log parser cannot find). The rollout is ``failed`` and not usable, never reward 0:
    ``error.type`` is :attr:`error_type` and ``reward_info`` keeps :attr:`info`."""

    def __init__(self, error_type: str, message: str, info: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.info = dict(info or {})


@dataclass
class Prompt:
    """The first messages of a rollout and the names of the tools offered to the model."""

    messages: list[dict[str, Any]]
    tools: list[str] = field(default_factory=list)


@dataclass
class Reward:
    reward: float
    info: dict[str, Any] = field(default_factory=dict)


OpenSandbox = Callable[["SandboxSpec"], AbstractAsyncContextManager["Sandbox"]]


@dataclass
class EvalContext:
    """What ``evaluate`` may use: the rollout's own sandbox (if any), a way to open a fresh
    one, and the daemon's options for handlers (``swe_grader``)."""

    sandbox: Sandbox | None
    open_sandbox: OpenSandbox
    final_answer: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


class TaskHandler(ABC):
    """One kind of task. Instances are stateless and shared by all jobs of that kind."""

    kind: ClassVar[str]
    #: The handler drives RUN itself (no agent loop); only labelled test tasks do this.
    custom_run: ClassVar[bool] = False
    #: The task's fields, their defaults and normalisation: a pydantic model with
    #: ``kind: Literal[...]`` (rules JSON Schema cannot say are its validators). The OpenAPI
    #: document publishes it and :meth:`validate` checks a task with it: the one definition.
    task_model: ClassVar[type[BaseModel] | None] = None

    def validate(self, task: dict[str, Any]) -> dict[str, Any]:
        """Return the normalised task, or raise TaskError naming what is wrong.

        By default the task as :attr:`task_model` reads it: the model's fields (defaults
        filled in, values normalised by its validators) over the task's own keys (the ``kind``
        it was submitted as is kept). A handler without a model overrides this."""
        model = self.task_model
        if model is None:
            raise NotImplementedError(f"{type(self).__name__} has no task_model: it must define validate")
        kind, own = task.get("kind"), model_kind(model)
        try:  # a handler registered under another kind reads its tasks as its model's kind
            parsed = model.model_validate(task if own is None else {**task, "kind": own})
        except ValidationError as exc:
            raise TaskError(f"{kind} task: {describe_errors(exc)}") from None
        fields = model.model_fields
        values = parsed.model_dump()
        return {**task, **{k: v for k, v in values.items()
                           if k != "kind" and (v is not None or k not in fields)}}

    def sandbox_spec(self, task: dict[str, Any]) -> SandboxSpec | None:
        """The sandbox the rollout needs, or None when it needs none."""
        return None

    async def setup(self, sandbox: Sandbox | None, task: dict[str, Any]) -> None:  # noqa: B027
        """Prepare the workspace (write files, check out a repo)."""

    @abstractmethod
    def prompt(self, task: dict[str, Any]) -> Prompt: ...

    async def run(
        self, task: dict[str, Any], trajectory: Trajectory, sandbox: Sandbox | None
    ) -> str | None:
        """Only for ``custom_run`` handlers: do the RUN stage, return the final answer."""
        raise NotImplementedError

    @abstractmethod
    async def evaluate(
        self, task: dict[str, Any], trajectory: Trajectory, ctx: EvalContext
    ) -> Reward: ...



def model_kind(model: type[BaseModel]) -> str | None:
    """The kind a task model describes (its ``kind: Literal["..."]``), or None."""
    field = model.model_fields.get("kind")
    kinds = get_args(field.annotation) if field is not None else ()
    return kinds[0] if len(kinds) == 1 and isinstance(kinds[0], str) else None


#: A step of an error's location that names a member of a union, not a field or an index.
_UNION_MEMBER = re.compile(r"(?:str|int|float|bool|none|[a-z]+(?:-[a-z]+)+|[a-z-]+\[.*\])\Z",
                           re.DOTALL)


def _where(loc: tuple[int | str, ...]) -> str:
    """``('tests', 0, 'stdin')`` -> ``tests[0].stdin``; union members are left out."""
    text = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            text += f"[{part}]"
        elif i == 0:
            text = part
        elif part == "[key]" or _UNION_MEMBER.match(part):
            continue
        elif part.isidentifier():
            text += f".{part}"
        else:
            text += f"[{json.dumps(part)}]"
    return text


def _message(error: Any) -> str:
    if error["type"] == "missing":
        return "required"
    if error["type"] in ("value_error", "assertion_error") and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    msg = str(error["msg"])
    return msg[:1].lower() + msg[1:]


def describe_errors(exc: ValidationError) -> str:
    """The errors of the first field a task model refused, as one line naming the field:
    ``'tests[0].stdin': input should be a valid string``; the alternatives of a field that
    may be one of several types are joined with "or"."""
    errors = exc.errors()
    first = errors[0]["loc"][:1]
    by_field: dict[str, list[str]] = {}
    for error in errors:
        if tuple(error["loc"][:1]) == tuple(first):
            msgs = by_field.setdefault(_where(tuple(error["loc"])), [])
            if _message(error) not in msgs:
                msgs.append(_message(error))
    return "; ".join(f"{f'{where!r}: ' if where else ''}{' or '.join(msgs)}" for where, msgs in by_field.items())
