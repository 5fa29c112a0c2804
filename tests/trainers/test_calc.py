"""The calculator tool (exact, bounded, no eval) and the calc task's checks."""

from __future__ import annotations

import pytest

from daemon.tasks.base import TaskError
from daemon.tasks.calc import CalcTask, example_messages, extract_number
from tools import open_toolbox, tool_schemas
from tools.calculator import CalculatorError, evaluate, format_result


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
