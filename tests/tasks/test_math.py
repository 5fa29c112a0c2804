"""math: right and wrong answers through the real pipeline with a scripted policy (TEST DOUBLE)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolloutd.daemon.tasks.base import TaskError
from rolloutd.daemon.tasks.math import MathTask, check_answer
from rolloutd.daemon.tasks.registry import TaskRegistry
from rolloutd.daemon.trajectory import Status

from .conftest import tool_call

TASK = {"kind": "math", "id": "frac", "question": "What is 1/2 + 1/3?", "answer": "\\frac{5}{6}"}


async def test_right_answer_in_boxed_text(harness):
    await harness.script(["Adding: 3/6 + 2/6 = 5/6. The answer is \\boxed{\\frac{5}{6}}."])
    tr = await harness.run(TASK)
    assert tr.status is Status.completed, tr.error
    assert tr.usable and tr.reward == 1.0
    assert tr.reward_info["correct"] is True
    assert tr.reward_info["source"] == "final_answer"
    assert tr.task_id == "frac"


async def test_wrong_answer(harness):
    await harness.script(["I think it is \\boxed{\\frac{2}{5}}."])
    tr = await harness.run(TASK)
    assert tr.status is Status.completed and tr.usable
    assert tr.reward == 0.0
    assert tr.reward_info["correct"] is False
    assert tr.reward_info["extracted"] is not None


async def test_equivalent_forms_and_finish_tool(harness):
    task = {**TASK, "tools": ["finish"]}
    await harness.script([tool_call("finish", answer="0.8333333333")])
    tr = await harness.run(task)
    assert tr.finish_reason == "finish_tool"
    assert tr.reward == 1.0, tr.reward_info


async def test_no_answer_scores_zero(harness):
    await harness.script(["I don't know."])
    tr = await harness.run({**TASK, "answer": "7"})
    assert tr.status is Status.completed and tr.reward == 0.0
    assert tr.reward_info["reason"] == "no_answer"


def test_check_answer_variants():
    assert check_answer("12", [("final_answer", "so \\boxed{12}")])["correct"]
    assert check_answer("x^2 + 2x + 1", [("final_answer", "\\boxed{(x+1)^2}")])["correct"]
    assert not check_answer("12", [("final_answer", "\\boxed{13}")])["correct"]
    # an unparsable final answer falls back to the last message
    res = check_answer("5", [("final_answer", "done"), ("last_message", "x = \\boxed{5}")])
    assert res["correct"] and res["source"] == "last_message"


@pytest.mark.parametrize("bad, field", [
    ({"kind": "math", "answer": "1"}, "question"),
    ({"kind": "math", "question": "q"}, "answer"),
    ({"kind": "math", "question": "q", "answer": True}, "answer"),
    ({"kind": "math", "question": "q", "answer": "1", "tools": ["bash"]}, "tools"),
])
def test_validate_names_the_field(bad, field):
    with pytest.raises(TaskError, match=field):
        MathTask().validate(bad)


def test_example_math_tasks_are_valid_and_self_consistent(repo_root: Path):
    reg = TaskRegistry.default()
    lines = (repo_root / "examples/tasks/math.jsonl").read_text().splitlines()
    assert len(lines) >= 20
    for line in lines:
        task = reg.get("math").validate(json.loads(line))
        assert check_answer(task["answer"], [("final_answer", f"\\boxed{{{task['answer']}}}")])["correct"], task


@pytest.mark.parametrize("number, text", [
    (1e20, "100000000000000000000"), (-1e20, "-100000000000000000000"), (1e-7, "0.0000001"),
    (0.1, "0.1"), (-2.5e-3, "-0.0025"), (3.0, "3.0"), (7, "7"), (10**30, "1" + "0" * 30),
])
def test_numeric_answer_becomes_exact_decimal_text(number, text):
    task = MathTask().validate({"kind": "math", "question": "q", "answer": number})
    assert task["answer"] == text
    assert check_answer(task["answer"], [("final_answer", f"\\boxed{{{text}}}")])["correct"]


def test_numeric_gold_is_not_read_as_eulers_number():
    """``str(1e20)`` is ``1e+20``, which math-verify parses as E + 20: ``e + 20`` scored 1."""
    gold = MathTask().validate({"kind": "math", "question": "q", "answer": 1e20})["answer"]
    assert check_answer(gold, [("final_answer", "\\boxed{10^{20}}")])["correct"]
    assert not check_answer(gold, [("final_answer", "\\boxed{e + 20}")])["correct"]
    small = MathTask().validate({"kind": "math", "question": "q", "answer": 1e-7})["answer"]
    assert check_answer(small, [("final_answer", "\\boxed{10^{-7}}")])["correct"]
    assert not check_answer(small, [("final_answer", "\\boxed{e - 7}")])["correct"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numeric_answer_is_refused(bad):
    with pytest.raises(TaskError, match="finite"):
        MathTask().validate({"kind": "math", "question": "q", "answer": bad})


async def test_numeric_answer_through_the_pipeline(harness):
    await harness.script(["10^20 is \\boxed{100000000000000000000}."])
    tr = await harness.run({"kind": "math", "id": "big", "question": "What is 10^20?", "answer": 1e20})
    assert tr.status is Status.completed and tr.reward == 1.0, tr.reward_info
    assert tr.reward_info["gold"] == "100000000000000000000"
