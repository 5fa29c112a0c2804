"""Each built-in kind has one definition of its fields: its pydantic task model. The handler's
``validate``, the JSONL loader, the HTTP API and the OpenAPI document all read that model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import Field

from rolloutd.daemon.tasks.base import (
    EvalContext,
    Prompt,
    Reward,
    TaskError,
    TaskHandler,
    model_kind,
)
from rolloutd.daemon.tasks.jsonl import TaskFileError, parse_tasks
from rolloutd.daemon.tasks.math import MathTask, MathTaskModel
from rolloutd.daemon.tasks.registry import BUILTIN, TaskRegistry
from rolloutd.daemon.tasks.sleep import SleepTask


def test_builtin_handlers_validate_through_their_model():
    reg = TaskRegistry.default()
    for kind in BUILTIN:
        handler = reg.get(kind)
        assert handler.task_model is not None and model_kind(handler.task_model) == kind
        assert type(handler).validate is TaskHandler.validate, f"{kind}: a second definition of its fields"


class LevelledMathModel(MathTaskModel):
    """The math model with one more field, as a change to the model would add it."""

    level: int = Field(1, ge=1)


class LevelledMath(MathTask):
    task_model = LevelledMathModel


def _registry() -> TaskRegistry:
    reg = TaskRegistry.default()
    reg.register(LevelledMath())
    return reg


def test_a_field_added_to_the_model_is_checked_everywhere():
    reg = _registry()
    task = {"kind": "math", "question": "1+1?", "answer": 2}
    assert reg.validate(task)["level"] == 1 and reg.validate(task)["answer"] == "2"
    assert reg.validate({**task, "level": 3})["level"] == 3
    with pytest.raises(TaskError, match=r"^math task: 'level': input should be greater than or equal to 1$"):
        reg.get("math").validate({**task, "level": 0})
    with pytest.raises(TaskError, match="'level'"):
        reg.get("math").validate({**task, "level": "3"})  # JSON types exactly
    good, bad = json.dumps({**task, "level": 2}), json.dumps({**task, "level": 0})
    assert parse_tasks(f"{good}\n", registry=reg) == [{**task, "level": 2}]
    with pytest.raises(TaskFileError, match=r"^t\.jsonl:2: math task: 'level': "):
        parse_tasks(f"{good}\n{bad}\n", source="t.jsonl", registry=reg)


async def test_a_field_added_to_the_model_is_checked_by_the_api(tmp_path: Path):
    from rolloutd.daemon.api import create_app
    from rolloutd.daemon.node import Node
    from rolloutd.daemon.pipeline import Services
    from tests.daemon.conftest import make_settings

    node = Node(make_settings(tmp_path), services=Services(), registry=_registry())
    node.ready = True  # the pipeline is not started: the job stays queued, its task readable
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(node)),
                                 base_url="http://test") as client:
        doc = (await client.get("/openapi.json")).json()
        level = doc["components"]["schemas"]["LevelledMathModel"]["properties"]["level"]
        assert level["minimum"] == 1 and level["type"] == "integer"
        task = {"kind": "math", "question": "1+1?", "answer": "2"}
        r = await client.post("/v1/rollouts", json={"task": {**task, "level": 0}})
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_task", r.text
        assert r.json()["error"]["message"].startswith("math task: 'level': "), r.text
        assert node.service.submitted_total == 0
        r = await client.post("/v1/rollouts", json={"task": {**task, "level": 2}})
        assert r.status_code == 202, r.text
        job = node.service.store.get(r.json()["ids"][0])
        assert job is not None and job.request.task["level"] == 2


def test_a_handler_under_another_kind_reads_its_model():
    """A handler registered under a kind that is not its model's (a test's sandboxed sleep):
    the model still checks the fields, and the task keeps the kind it was submitted as."""
    reg = TaskRegistry()
    reg.register(SleepTask(), kind="sleep-other")
    assert reg.validate({"kind": "sleep-other", "run_s": 2}) == {
        "kind": "sleep-other", "init_s": 0.0, "run_s": 2.0, "eval_s": 0.0, "reward": 1.0, "reward_info": {}}
    with pytest.raises(TaskError, match=r"^sleep-other task: 'run_s'"):
        reg.validate({"kind": "sleep-other", "run_s": -1})


class _NoFields(TaskHandler):
    kind = "no-fields"

    def prompt(self, task: dict[str, Any]) -> Prompt:
        return Prompt(messages=[])

    async def evaluate(self, task: dict[str, Any], trajectory: Any, ctx: EvalContext) -> Reward:
        return Reward(0.0)


def test_a_handler_needs_a_model_or_its_own_validate():
    with pytest.raises(TypeError, match="neither a task_model nor its own validate"):
        TaskRegistry().register(_NoFields())


@pytest.mark.parametrize(("task", "message"), [
    ({"kind": "math", "question": "q"}, "math task: 'answer': required"),
    ({"kind": "math", "question": "q", "answer": True},
     "math task: 'answer': input should be a valid string or input should be a valid number"),
    ({"kind": "math", "answer": "1"}, "math task: give 'question' (or 'problem')"),
    ({"kind": "code", "prompt": "p", "tests": [{"stdin": 1, "stdout": "1"}]},
     "code task: 'tests[0].stdin': input should be a valid string"),
    ({"kind": "code", "prompt": "p", "pytest": "x", "files": {"/etc/x": ""}},
     "code task: 'files[\"/etc/x\"]': string should match pattern"),
    ({"kind": "calc", "expression": "1 / 0"}, "calc task: 'expression': division by zero"),
    ({"kind": "sleep", "fail_stage": "later"}, "sleep task: 'fail_stage': input should be 'init', 'run' or 'eval'"),
])
def test_model_errors_read_as_one_line_naming_the_field(task, message):
    with pytest.raises(TaskError) as err:
        TaskRegistry.default().validate(task)
    assert str(err.value).startswith(message), str(err.value)
