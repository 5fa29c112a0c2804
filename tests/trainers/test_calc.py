"""The calculator tool (exact, bounded, no eval) and the calc task's checks."""

from __future__ import annotations

import pytest

from rolloutd.daemon.tasks.base import TaskError
from rolloutd.daemon.tasks.calc import CalcTask, example_messages, extract_number
from rolloutd.tools import open_toolbox, tool_schemas
from rolloutd.tools.calculator import CalculatorError, evaluate, format_result


@pytest.mark.parametrize(("expr", "want"), [
    ("4821 * 392", "1889832"), ("(12 + 3) * 45", "675"), ("7 / 2", "3.5"), ("8 / 2", "4"),
    ("2 ** 10", "1024"), ("-3 + +4", "1"), ("17 // 5 + 17 % 5", "5"), ("3 × 4", "12"), ("2^3", "8"),
    ("123456789 * 987654321", "121932631112635269"),
])
def test_exact_results(expr, want):
    assert format_result(evaluate(expr)) == want


@pytest.mark.parametrize(("expr", "why"), [
    ("__import__('os').system('id')", "only numbers"), ("a + 1", "only numbers"), ("'x' * 3", "only numbers"),
    ("1 / 0", "division by zero"), ("2 ** 100000", "exponents"), ("9 ** 64 * 9 ** 64", "digits"),
    ("1 +", "cannot parse"), ("", "empty"), ("1" * 300, "longer"),
])
def test_refusals(expr, why):
    with pytest.raises(CalculatorError, match=why):
        evaluate(expr)


async def test_toolbox_calculator_needs_no_sandbox():
    assert tool_schemas(["calculator"])[0]["function"]["parameters"]["required"] == ["expression"]
    async with open_toolbox(None, ["calculator"]) as tb:
        ok = await tb.call("calculator", {"expression": "12 * 34"}, timeout_s=1)
        assert (ok.output, ok.ok, ok.exit_code) == ("408", True, 0)
        bad = await tb.call("calculator", {"expression": "x"}, timeout_s=1)
        assert not bad.ok and bad.output.startswith("Error:")
        missing = await tb.call("calculator", {}, timeout_s=1)
        assert not missing.ok and "expression" in missing.output


def test_calc_task_fields_and_answers():
    h = CalcTask()
    task = h.validate({"kind": "calc", "expression": " 4821 * 392 "})
    assert task["answer"] == "1889832" and task["question"] == "What is 4821 * 392?" and task["examples"] == 1
    assert len(h.prompt(task).messages) == 2 + 4 and h.prompt(task).tools == ["calculator"]
    assert example_messages(1)[2] == {"role": "tool", "content": "10063"}
    for bad in ({"kind": "calc"}, {"kind": "calc", "expression": "a*b"}, {"kind": "calc", "expression": "1", "examples": 9}):
        with pytest.raises(TaskError):
            h.validate(bad)
    assert extract_number("The answer is 1,889,832.") == "1889832"
    assert extract_number("1 889 832") == "1889832"
    assert extract_number("408 then 409") == "409"
    assert extract_number("no number") is None


async def _reward(task, answer_text):
    """Evaluate ``answer_text`` as the last assistant message of a calc trajectory."""
    from rolloutd.daemon.tasks.base import EvalContext
    from rolloutd.daemon.trajectory import Trajectory

    async def no_sandbox(*args, **kwargs):
        raise AssertionError("calc needs no sandbox")

    tr = Trajectory(id="t", messages=[{"role": "user", "content": task["question"]},
                                      {"role": "assistant", "content": answer_text}])
    return await CalcTask().evaluate(task, tr, EvalContext(sandbox=None, open_sandbox=no_sandbox))


@pytest.mark.parametrize(("expr", "gold"), [
    ("7 / 2", "3.5"), ("-7 / 2", "-3.5"), ("1 / 3", "0.333333333333"), ("0.1 + 0.2", "0.3"),
    ("1e-5 / 3", "3.33333333333e-06"), ("4821 * 392", "1889832"),
])
async def test_non_integer_results_can_score(expr, gold):
    """The answer the calculator tool gives scores 1 (a non-integer never could: only the
    last integer of the answer was read, so "3.5" was read as "5")."""
    task = CalcTask().validate({"kind": "calc", "expression": expr})
    assert task["answer"] == gold
    async with open_toolbox(None, ["calculator"]) as tb:
        shown = (await tb.call("calculator", {"expression": expr}, timeout_s=1)).output
    assert shown == gold
    r = await _reward(task, f"The answer is {shown}.")
    assert r.reward == 1.0 and r.info["correct"] and r.info["extracted"] == gold, r.info


async def test_calc_answers_compare_as_numbers():
    task = CalcTask().validate({"kind": "calc", "expression": "7 / 2"})
    assert (await _reward(task, "3.50")).reward == 1.0
    assert (await _reward(task, "It is 3.")).reward == 0.0
    assert (await _reward(task, "5")).reward == 0.0
    assert (await _reward(task, "-3.5")).reward == 0.0
    big = CalcTask().validate({"kind": "calc", "expression": "4821 * 392", "answer": 1889832})
    assert big["answer"] == "1889832" and (await _reward(big, "1,889,832")).reward == 1.0
    given = CalcTask().validate({"kind": "calc", "expression": "1 / 4", "answer": 0.25})
    assert given["answer"] == "0.25" and (await _reward(given, "0.25")).reward == 1.0
    assert CalcTask().validate({"kind": "calc", "expression": "1", "answer": "1,000"})["answer"] == "1000"
    for bad in ("abc", "3.5.1", "", True, [1]):
        with pytest.raises(TaskError, match="answer"):
            CalcTask().validate({"kind": "calc", "expression": "1", "answer": bad})


def test_extract_number_reads_decimals():
    assert extract_number("7 / 2 = 3.5.") == "3.5"
    assert extract_number("x = -0.25") == "-0.25"
    assert extract_number("1,234.5") == "1234.5"
    assert extract_number("3.33333333333e-06") == "3.33333333333e-06"
