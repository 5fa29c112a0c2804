"""The task-handler interface: how a kind of task is set up, prompted and scored."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

if TYPE_CHECKING:
    from daemon.trajectory import Trajectory
    from sandbox import Sandbox, SandboxSpec


class TaskError(Exception):
    """A task is malformed; the message names the field. The API answers 422."""


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
    """What ``evaluate`` may use: the rollout's own sandbox (if any) and a way to open a fresh one."""

    sandbox: Sandbox | None
    open_sandbox: OpenSandbox
    final_answer: str | None = None


class TaskHandler(ABC):
    """One kind of task. Instances are stateless and shared by all jobs of that kind."""

    kind: ClassVar[str]
    #: The handler drives RUN itself (no agent loop); only labelled test tasks do this.
    custom_run: ClassVar[bool] = False
    #: The task's JSON shape (a pydantic model with ``kind: Literal[...]``): the OpenAPI
    #: document publishes it and :meth:`TaskRegistry.validate` checks it before
    #: :meth:`validate`, so a request the schema admits is one ``validate`` accepts.
    task_model: ClassVar[type[BaseModel] | None] = None

    @abstractmethod
    def validate(self, task: dict[str, Any]) -> dict[str, Any]:
        """Return the normalised task, or raise TaskError naming what is wrong."""

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


Hook = Callable[[], Awaitable[None]]
