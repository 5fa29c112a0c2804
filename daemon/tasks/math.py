"""``math``: a question with a known final answer, checked with math-verify.

Task fields::

    {"kind": "math", "id": "add-1", "question": "What is 2+3?", "answer": "5",
     "tools": []}                       # optional; only "finish" may be offered

A numeric ``answer`` (JSON number) becomes its exact decimal text without an exponent
(``_common.number_text``: ``1e20`` -> ``100000000000000000000``, ``1e-7`` -> ``0.0000001``):
math-verify would read ``1e+20`` as Euler's number plus 20.

The model is asked for its final answer in ``\\boxed{}``. EVAL parses the final answer
(the finish tool's answer, else the last assistant message; the other one is tried when the
first has no parsable answer) and the gold answer with ``math_verify.parse`` and compares
them with ``math_verify.verify``: reward 1.0 when they are equivalent, else 0.0.

math-verify's own timeouts use SIGALRM, which works only in the main thread, so they are
off here: parsing and verifying run in a worker thread (at most ``VERIFY_THREADS`` at once)
under our own deadline; an answer that takes longer than ``VERIFY_TIMEOUT_S`` scores 0,
as math-verify's timeout would.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import trio
from pydantic import ConfigDict, Field, model_validator

from rolloutd.daemon.tasks._common import (
    NonBlank,
    TaskModel,
    answer_text,
    answer_texts,
    omitted,
    tools_type,
)
from rolloutd.daemon.tasks.base import EvalContext, Prompt, Reward, TaskError, TaskHandler
from rolloutd.daemon.trajectory import Trajectory

VERIFY_THREADS = 2
VERIFY_TIMEOUT_S = 10.0
#: Only the end of a long answer is parsed (the boxed answer is at the end).
MAX_ANSWER_CHARS = 4000

SYSTEM = (
    "You are a careful math assistant. Solve the problem, then give the final answer "
    "in \\boxed{}, for example \\boxed{42}."
)

_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("math_verify_limiter")


def _verify_limiter() -> trio.CapacityLimiter:
    try:
        return _LIMITER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(VERIFY_THREADS)
        _LIMITER.set(limiter)
        return limiter


def _quiet_math_verify() -> None:
    # It warns once per process that its (signal) timeout is off: we time it out ourselves.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _gold_text(answer: str) -> str:
    stripped = answer.strip()
    if "$" in stripped or "\\boxed" in stripped:
        return stripped
    return f"${stripped}$"


def check_answer(gold: str, candidates: list[tuple[str, str]]) -> dict[str, Any]:
    """Blocking: compare each candidate with ``gold``; the first parsable one decides."""
    from math_verify import parse, verify

    _quiet_math_verify()
    gold_parsed = parse(_gold_text(gold), parsing_timeout=None)  # type: ignore[arg-type]
    if not gold_parsed:
        gold_parsed = parse(gold, parsing_timeout=None)  # type: ignore[arg-type]
    if not gold_parsed:
        raise TaskError(f"math task: cannot parse the gold answer {gold!r}")
    for source, text in candidates:
        pred = parse(text[-MAX_ANSWER_CHARS:], parsing_timeout=None)  # type: ignore[arg-type]
        if not pred:
            continue
        correct = bool(verify(gold_parsed, pred, timeout_seconds=None))
        return {"correct": correct, "extracted": str(pred[-1]), "source": source}
    return {"correct": False, "extracted": None, "source": None, "reason": "no_answer"}


class MathTaskModel(TaskModel):
    """A ``math`` task: ``question`` (or its alias ``problem``) and the gold ``answer``."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [{"required": ["question"]}, {"required": ["problem"]}]})

    kind: Literal["math"]
    question: NonBlank = omitted()  # one of the two is required (not null)
    problem: NonBlank = omitted()
    answer: answer_text(NonBlank)  # type: ignore[valid-type]
    tools: tools_type(["finish"]) = Field(default_factory=list)  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _has_question(self) -> MathTaskModel:
        if self.question is None and self.problem is None:
            raise ValueError("give 'question' (or 'problem')")
        if self.question is None:
            self.question = self.problem
        return self


class MathTask(TaskHandler):
    kind = "math"
    task_model = MathTaskModel

    def prompt(self, task: dict[str, Any]) -> Prompt:
        return Prompt(
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": task["question"]},
            ],
            tools=list(task["tools"]),
        )

    async def evaluate(self, task: dict[str, Any], trajectory: Trajectory, ctx: EvalContext) -> Reward:
        candidates = answer_texts(ctx.final_answer, trajectory)
        info: dict[str, Any] = {"gold": task["answer"]}
        if not candidates:
            return Reward(0.0, {**info, "correct": False, "extracted": None, "reason": "no_answer"})
        with trio.move_on_after(VERIFY_TIMEOUT_S) as scope:
            result = await trio.to_thread.run_sync(
                check_answer, task["answer"], candidates,
                limiter=_verify_limiter(), abandon_on_cancel=True,
            )
        if scope.cancelled_caught:
            return Reward(0.0, {**info, "correct": False, "extracted": None, "reason": "verify_timeout"})
        return Reward(1.0 if result["correct"] else 0.0, {**info, **result})
