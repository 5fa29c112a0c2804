"""Small pieces the built-in handlers share: field checks, answers, a test runner script."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from daemon.tasks.base import TaskError

if TYPE_CHECKING:
    from daemon.trajectory import Trajectory
    from sandbox import RunResult

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


def tools_type(allowed: Sequence[str]) -> Any:
    return list[Literal[tuple(allowed)]]  # type: ignore[misc]


def text_field(task: dict[str, Any], key: str, kind: str, *, aliases: Sequence[str] = ()) -> str:
    """A required non-empty string (``aliases`` are accepted spellings of ``key``)."""
    for name in (key, *aliases):
        if name in task:
            value = task[name]
            if not isinstance(value, str) or not value.strip():
                raise TaskError(f"{kind} task: {name!r} must be a non-empty string")
            return value
    raise TaskError(f"{kind} task: missing field {key!r}")


def number_field(
    task: dict[str, Any], key: str, kind: str, default: float, *, minimum: float = 0.0
) -> float:
    value = task.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= minimum:
        raise TaskError(f"{kind} task: {key!r} must be a number > {minimum:g}")
    return float(value)


def int_field(task: dict[str, Any], key: str, kind: str, default: int, *, minimum: int = 1) -> int:
    value = task.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TaskError(f"{kind} task: {key!r} must be an integer >= {minimum}")
    return value


def tools_field(task: dict[str, Any], kind: str, default: Sequence[str],
                allowed: Sequence[str] = KNOWN_TOOLS) -> list[str]:
    tools = task.get("tools", list(default))
    if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
        raise TaskError(f"{kind} task: 'tools' must be a list of tool names")
    unknown = [t for t in tools if t not in allowed]
    if unknown:
        raise TaskError(f"{kind} task: unknown tools {unknown}; allowed: {', '.join(allowed)}")
    return list(dict.fromkeys(tools))


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


def number_text(value: int | float, kind: str) -> str:
    """A JSON number as decimal text, never in exponent form (``str(1e20)`` is ``1e+20``,
    which math-verify reads as Euler's e + 20): ints exactly, floats as the shortest decimal
    that reads back as the same float (``0.1`` stays ``0.1``)."""
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        raise TaskError(f"{kind} task: 'answer' must be a finite number, not {value!r}")
    text = format(Decimal(repr(value)), "f")
    return "0" if text in ("-0", "-0.0") else text
