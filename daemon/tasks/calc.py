"""``calc``: arithmetic that needs the calculator tool; reward 1 for the exact answer.

Task fields::

    {"kind": "calc", "id": "c-1", "expression": "4821 * 392",
     "answer": "1889832",      # optional (a number or its text): computed from the expression when absent
     "question": "...",        # optional: default "What is {expression}?"
     "examples": 1}            # optional: worked tool-call examples put before the question

The question is large-number arithmetic a small model cannot do in its head, so a correct
answer needs a tool call: the model calls ``calculator``, reads the result, and answers with
the number. The prompt shows ``examples`` worked conversations (question, tool call, tool
result, answer) as real earlier turns, which is how a 135M-parameter model learns the call
format at all. EVAL takes the final answer (the last assistant message, or the finish tool's
answer), reads its last number (an integer or a decimal such as ``3.5`` or ``3.3e-06``;
commas and spaces between digit groups allowed) and gives reward 1.0 when it equals the
answer as a number (``3.50`` equals ``3.5``), else 0.0. A division that does not terminate
has the calculator's answer, rounded to 12 significant digits (``1/3`` is ``0.333333333333``).
``reward_info`` records
``correct``, ``extracted``, ``called_tool`` (whether any turn called the calculator) and
``tool_ok`` (whether such a call succeeded).
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from rolloutd.daemon.tasks._common import NonBlank, TaskModel, answer_text, omitted
from rolloutd.daemon.tasks.base import EvalContext, Prompt, Reward, TaskHandler
from rolloutd.daemon.trajectory import Trajectory
from rolloutd.tools.calculator import CalculatorError, evaluate, format_result

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

#: An integer (digit groups may be separated by "," or " ") or a decimal, with an exponent.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:[, ]\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][+-]?\d+)?")


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
    """The last number in ``text`` (``1,234,567`` and ``1 234 567`` read as one; ``3.5``
    and ``3.3e-06`` whole), without separators, or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    return re.sub(r"[, ]", "", found[-1])


def same_number(a: str, b: str) -> bool:
    """``a`` and ``b`` (texts :data:`_NUMBER` matches, separators removed) are equal numbers."""
    return Decimal(a) == Decimal(b)


_NumberText = Annotated[str, Field(pattern=r"^-?(?:[0-9]{1,3}(?:[, ][0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?$")]


class CalcTaskModel(TaskModel):
    """A ``calc`` task. ``expression`` has the format ``arithmetic-expression``: one that the
    calculator tool evaluates (numbers, parentheses, + - * / // % **; see tools/calculator.py)."""

    kind: Literal["calc"]
    expression: Annotated[NonBlank, AfterValidator(str.strip)] = Field(
        json_schema_extra={"format": "arithmetic-expression"}
    )
    answer: answer_text(_NumberText) = omitted(description="Default: the expression's value.")  # type: ignore[valid-type]
    question: NonBlank = omitted(description="Default: What is {expression}?")
    examples: int = Field(1, ge=0, le=MAX_EXAMPLES)

    @model_validator(mode="after")
    def _defaults(self) -> CalcTaskModel:
        try:
            exact = format_result(evaluate(self.expression))
        except CalculatorError as exc:
            raise ValueError(f"'expression': {exc}") from None
        # "1,000" and "1 000" are 1000
        self.answer = exact if self.answer is None else re.sub(r"[, ]", "", self.answer)
        if self.question is None:
            self.question = f"What is {self.expression}?"
        return self


class CalcTask(TaskHandler):
    kind = "calc"
    task_model = CalcTaskModel

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
        correct = extracted is not None and same_number(extracted, task["answer"])
        return Reward(1.0 if correct else 0.0, {
            "correct": correct,
            "extracted": extracted,
            "gold": task["answer"],
            "called_tool": bool(calls),
            "tool_ok": any(c.ok for c in calls),
        })
