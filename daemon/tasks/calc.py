"""``calc``: arithmetic that needs the calculator tool; reward 1 for the exact answer.

Task fields::

    {"kind": "calc", "id": "c-1", "expression": "4821 * 392",
     "answer": "1889832",      # optional: computed exactly from the expression when absent
     "question": "...",        # optional: default "What is {expression}?"
     "examples": 1}            # optional: worked tool-call examples put before the question

The question is large-number arithmetic a small model cannot do in its head, so a correct
answer needs a tool call: the model calls ``calculator``, reads the result, and answers with
the number. The prompt shows ``examples`` worked conversations (question, tool call, tool
result, answer) as real earlier turns, which is how a 135M-parameter model learns the call
format at all. EVAL takes the final answer (the last assistant message, or the finish tool's
answer), reads its last integer (commas and spaces between digit groups allowed) and gives
reward 1.0 when it equals the answer exactly, else 0.0. ``reward_info`` records
``correct``, ``extracted``, ``called_tool`` (whether any turn called the calculator) and
``tool_ok`` (whether such a call succeeded).
"""

from __future__ import annotations

import json
import re
from typing import Any

from daemon.tasks.base import EvalContext, Prompt, Reward, TaskError, TaskHandler
from daemon.trajectory import Trajectory
from tools.calculator import CalculatorError, evaluate, format_result

SYSTEM = (
    "You are a calculator assistant. Always use the calculator tool for arithmetic, then "
    "reply with only the final number."
)

#: Worked examples (question, expression, result), shown as earlier turns of the conversation.
EXAMPLES = [
    ("What is 347 * 29?", "347 * 29"),
    ("What is 5126 + 8875?", "5126 + 8875"),
    ("What is 918 * 764?", "918 * 764"),
]
MAX_EXAMPLES = len(EXAMPLES)

_NUMBER = re.compile(r"-?\d{1,3}(?:[, ]\d{3})+(?!\d)|-?\d+")


def _call_text(expression: str) -> str:
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def example_messages(count: int) -> list[dict[str, Any]]:
    """``count`` worked conversations as chat messages (user, assistant call, tool, answer)."""
    out: list[dict[str, Any]] = []
    for question, expression in EXAMPLES[:count]:
        result = format_result(evaluate(expression))
        out += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": _call_text(expression)},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": result},
        ]
    return out


def extract_number(text: str) -> str | None:
    """The last integer in ``text`` (``1,234,567`` and ``1 234 567`` read as one), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    return re.sub(r"[, ]", "", found[-1])


class CalcTask(TaskHandler):
    kind = "calc"

    def validate(self, task: dict[str, Any]) -> dict[str, Any]:
        expression = task.get("expression")
        if not isinstance(expression, str) or not expression.strip():
            raise TaskError("calc task: 'expression' must be a non-empty string")
        try:
            exact = format_result(evaluate(expression))
        except CalculatorError as exc:
            raise TaskError(f"calc task: 'expression': {exc}") from None
        answer = task.get("answer", exact)
        if isinstance(answer, bool) or not isinstance(answer, str | int) or not str(answer).strip():
            raise TaskError("calc task: 'answer' must be an integer or a string of one")
        question = task.get("question", f"What is {expression.strip()}?")
        if not isinstance(question, str) or not question.strip():
            raise TaskError("calc task: 'question' must be a non-empty string")
        examples = task.get("examples", 1)
        if isinstance(examples, bool) or not isinstance(examples, int) or not 0 <= examples <= MAX_EXAMPLES:
            raise TaskError(f"calc task: 'examples' must be an integer from 0 to {MAX_EXAMPLES}")
        return {**task, "expression": expression.strip(), "answer": str(answer).strip(),
                "question": question, "examples": examples}

    def prompt(self, task: dict[str, Any]) -> Prompt:
        return Prompt(
            messages=[
                {"role": "system", "content": SYSTEM},
                *example_messages(task["examples"]),
                {"role": "user", "content": task["question"]},
            ],
            tools=["calculator"],
        )

    async def evaluate(self, task: dict[str, Any], trajectory: Trajectory, ctx: EvalContext) -> Reward:
        calls = [c for t in trajectory.turns for c in t.tool_calls if c.name == "calculator"]
        final = ctx.final_answer
        if final is None:  # the last assistant message, when it is not itself a tool call
            last = trajectory.messages[-1] if trajectory.messages else {}
            if last.get("role") == "assistant" and not last.get("tool_calls"):
                final = str(last.get("content") or "")
        extracted = extract_number(final) if final else None
        correct = extracted is not None and extracted == task["answer"]
        return Reward(1.0 if correct else 0.0, {
            "correct": correct,
            "extracted": extracted,
            "gold": task["answer"],
            "called_tool": bool(calls),
            "tool_ok": any(c.ok for c in calls),
        })
