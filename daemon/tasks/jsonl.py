"""Task files: one JSON task per line. A malformed line is an error naming its file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rolloutd.daemon.tasks.base import TaskError
from rolloutd.daemon.tasks.registry import TaskRegistry


class TaskFileError(TaskError):
    """A task file cannot be used; the message starts with ``path:line:``."""


def parse_tasks(text: str, *, source: str = "<tasks>",
                registry: TaskRegistry | None = None) -> list[dict[str, Any]]:
    """Tasks from JSONL text; each is checked by its handler's ``validate`` when a registry is
    given. Blank lines and lines starting with ``#`` are skipped. Returns the tasks as written."""
    tasks: list[dict[str, Any]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{source}:{lineno}"
        try:
            task = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskFileError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(task, dict):
            raise TaskFileError(f"{where}: a task must be a JSON object, got {type(task).__name__}")
        if not isinstance(task.get("kind"), str):
            raise TaskFileError(f"{where}: the task has no string 'kind'")
        if registry is not None:
            try:
                registry.validate(task)
            except TaskError as exc:
                raise TaskFileError(f"{where}: {exc}") from None
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{source}: no tasks")
    return tasks


def load_tasks(path: Path, *, registry: TaskRegistry | None = None) -> list[dict[str, Any]]:
    """Blocking: read and check a task file (see :func:`parse_tasks`)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise TaskFileError(f"{path}: cannot read ({exc.strerror})") from None
    return parse_tasks(text, source=str(path), registry=registry)
