"""Small pieces the built-in handlers share: field types, answers, a test runner script."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)

from rolloutd.daemon.harness import AgentSpec

if TYPE_CHECKING:
    from rolloutd.daemon.trajectory import Trajectory
    from rolloutd.sandbox import RunResult

#: The test runner written into evaluation sandboxes (runs pytest, or a tiny fallback).
RUNNER_SOURCE = Path(__file__).with_name("_runner.py")
#: Kept from long outputs in reward_info.
TAIL_CHARS = 2000

KNOWN_TOOLS = ("bash", "ipython", "editor", "finish")

# ---- field types of the task models (``TaskHandler.task_model``) ------------------------

#: A string with a character ``str.strip`` keeps (``\x1c``-``\x1f`` are Python whitespace).
NonBlank = Annotated[str, Field(pattern=r"[^\s\x1c-\x1f]")]
_SEGMENT = r"(?:[^/\x00.][^/\x00]*|\.[^/\x00.][^/\x00]*|\.\.[^/\x00]+)"
#: A path inside the workspace: relative, no empty, ``.`` or ``..`` part, no NUL.
RelPath = Annotated[str, Field(pattern=rf"^{_SEGMENT}(?:/{_SEGMENT})*$")]
#: An absolute path usable as a bind mount (no ``,`` ``:`` or NUL).
AbsPath = Annotated[str, Field(pattern=r"^/[^,:\x00]*$")]
Number = Annotated[float, Field(allow_inf_nan=False)]
PositiveNumber = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def _keys_are_paths(schema: dict[str, Any]) -> None:
    # pydantic writes a dict[RelPath, ...] as patternProperties, which admits other keys too.
    (pattern, value), = schema.pop("patternProperties").items()
    schema.update(propertyNames={"pattern": pattern}, additionalProperties=value)


#: ``{relative path: text}``
PathMap = Annotated[dict[RelPath, str], Field(json_schema_extra=_keys_are_paths)]


def omitted(**kwargs: Any) -> Any:
    """The default of a field that may be left out but is never null (the handler's own
    default applies): the schema says so, a field that is not required and not nullable."""
    return Field(None, **kwargs)


class TaskModel(BaseModel):
    """Base of the task models: JSON types exactly (no coercion); other keys are kept."""

    model_config = ConfigDict(strict=True, extra="allow")

    agent: AgentSpec = omitted(description="Run this agent harness in the sandbox instead of "
                               "the built-in loop (docs/agents.md).")


def tools_type(allowed: Sequence[str]) -> Any:
    """A list of tool names from ``allowed``; a name given twice is offered once."""
    return Annotated[list[Literal[tuple(allowed)]],  # type: ignore[misc]
                     AfterValidator(lambda tools: list(dict.fromkeys(tools)))]


def _exact_text(value: Any, handler: ValidatorFunctionWrapHandler) -> str:
    checked = handler(value)
    if isinstance(checked, str):
        return checked
    return number_text(value if isinstance(value, int) else checked)


def answer_text(text: Any) -> Any:
    """An answer field: ``text`` (a string type) or a finite JSON number, always read as text
    (a number as :func:`number_text` writes it, an integer exactly)."""
    return Annotated[text | Number, WrapValidator(_exact_text)]


def last_assistant_text(trajectory: Trajectory) -> str | None:
    for msg in reversed(trajectory.messages):
        if msg.get("role") == "assistant" and isinstance(msg.get("content"), str):
            return str(msg["content"])
    return None


def answer_texts(final_answer: str | None, trajectory: Trajectory) -> list[tuple[str, str]]:
    """Where an answer may be, best first: (source, text)."""
    out: list[tuple[str, str]] = []
    if final_answer and final_answer.strip():
        out.append(("final_answer", final_answer))
    last = last_assistant_text(trajectory)
    if last and last.strip() and last != final_answer:
        out.append(("last_message", last))
    return out


_CODE_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def code_block(text: str) -> str | None:
    """The last fenced code block of ``text`` (```python ... ```), or None."""
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


def tail(data: bytes | str, limit: int = TAIL_CHARS) -> str:
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    return text if len(text) <= limit else "..." + text[-limit:]


def describe_run(res: RunResult) -> str:
    """One line about a failed infrastructure command, for error messages."""
    why = "timed out" if res.timed_out else f"exit {res.exit_code}"
    return f"{why}: {tail(res.stderr or res.stdout, 500).strip()}"


def runner_argv(python: str, runner: str, *, tests: Sequence[str], paths: Sequence[str],
                out: str) -> list[str]:
    """Run ``tests`` (pytest node ids) or every test under ``paths``; results go to ``out``."""
    return [python, runner, json.dumps({"tests": list(tests), "paths": list(paths), "out": out})]


def read_runner_output(raw: bytes) -> dict[str, Any]:
    data = json.loads(raw)
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        raise ValueError("the test runner wrote an unexpected result")
    return data


def number_text(value: int | float) -> str:
    """A JSON number as decimal text, never in exponent form (``str(1e20)`` is ``1e+20``,
    which math-verify reads as Euler's e + 20): ints exactly, floats as the shortest decimal
    that reads back as the same float (``0.1`` stays ``0.1``)."""
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {value!r}")
    text = format(Decimal(repr(value)), "f")
    return "0" if text in ("-0", "-0.0") else text
