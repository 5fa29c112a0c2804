"""``sleep``: a labelled test task that only waits, for pipeline tests and benchmarks.

It exercises the real pipeline (queues, workers, deadlines, cancellation) with no sandbox
and no model: INIT sleeps ``init_s``, RUN sleeps ``run_s``, EVAL sleeps ``eval_s`` and
returns ``reward``. ``fail_stage`` makes one stage raise, to test failure reporting.
Scripted groups: ``rewards: [..]`` gives per-sample rewards and ``run_s: [..]`` per-sample
RUN times, both indexed by ``trajectory.sample_index`` (wrapping around); ``reward_info``
(a dict, or a list of dicts indexed the same way) is merged into the reward's info.
Every trajectory it produces carries the label ``test-task:sleep``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import trio
from pydantic import Field

from rolloutd.daemon.tasks._common import Number, TaskModel
from rolloutd.daemon.tasks.base import EvalContext, Prompt, Reward, TaskHandler
from rolloutd.daemon.trajectory import Trajectory

_Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class SleepTaskModel(TaskModel):
    """A ``sleep`` test task (see daemon/tasks/sleep.py)."""

    kind: Literal["sleep"]
    init_s: _Seconds = 0.0
    run_s: _Seconds | Annotated[list[_Seconds], Field(min_length=1)] = 0.0
    eval_s: _Seconds = 0.0
    reward: Number = 1.0
    rewards: Annotated[list[Number], Field(min_length=1)] | None = None
    reward_info: dict[str, Any] | Annotated[list[dict[str, Any]], Field(min_length=1)] = Field(
        default_factory=dict
    )
    fail_stage: Literal["init", "run", "eval"] | None = None


class SleepTask(TaskHandler):
    kind = "sleep"
    custom_run = True
    label = "test-task:sleep"
    task_model = SleepTaskModel

    async def setup(self, sandbox: object, task: dict[str, Any]) -> None:
        await self._sleep(task, "init")

    def prompt(self, task: dict[str, Any]) -> Prompt:
        return Prompt(messages=[{"role": "user", "content": f"sleep {task['run_s']}s"}])

    async def run(self, task: dict[str, Any], trajectory: Trajectory, sandbox: object) -> str:
        trajectory.messages = self.prompt(task).messages
        run_s = task["run_s"]
        if isinstance(run_s, list):
            await trio.sleep(run_s[trajectory.sample_index % len(run_s)])
            if task.get("fail_stage") == "run":
                raise RuntimeError("sleep task asked to fail in run")
        else:
            await self._sleep(task, "run")
        return "slept"

    async def evaluate(self, task: dict[str, Any], trajectory: Trajectory, ctx: EvalContext) -> Reward:
        await self._sleep(task, "eval")
        i = trajectory.sample_index
        rewards = task.get("rewards") or [task["reward"]]
        info = task.get("reward_info", {})
        extra = info[i % len(info)] if isinstance(info, list) else info
        return Reward(rewards[i % len(rewards)], {"test_task": "sleep", **extra})

    @staticmethod
    async def _sleep(task: dict[str, Any], stage: str) -> None:
        await trio.sleep(task[f"{stage}_s"])
        if task.get("fail_stage") == stage:
            raise RuntimeError(f"sleep task asked to fail in {stage}")

