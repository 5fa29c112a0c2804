"""Where task kinds come from: the built-in handlers and the ``rolloutd.tasks`` entry points."""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

from daemon.tasks.base import TaskError, TaskHandler

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rolloutd.tasks"

#: kind -> "module:Class" of the handlers that ship with rolloutd.
BUILTIN = {
    "sleep": "daemon.tasks.sleep:SleepTask",
    "math": "daemon.tasks.math:MathTask",
    "code": "daemon.tasks.code:CodeTask",
    "swe": "daemon.tasks.swe:SweTask",
    "calc": "daemon.tasks.calc:CalcTask",
}


def _load(ref: str) -> type[TaskHandler]:
    module, _, name = ref.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, TaskHandler)):
        raise TypeError(f"{ref} is not a TaskHandler subclass")
    return cls


class TaskRegistry:
    """Maps a task's ``kind`` to one shared handler instance."""

    def __init__(self, handlers: dict[str, TaskHandler] | None = None) -> None:
        self._handlers: dict[str, TaskHandler] = dict(handlers or {})

    @classmethod
    def default(cls) -> TaskRegistry:
        reg = cls()
        for kind, ref in BUILTIN.items():
            try:
                reg.register(_load(ref)(), kind=kind)
            except ModuleNotFoundError as exc:
                if not ref.startswith(exc.name or "\0"):
                    raise
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                handler_cls = ep.load()
                reg.register(handler_cls(), kind=ep.name)
            except Exception:
                log.exception("cannot load task handler %r from entry point %s", ep.name, ep.value)
        return reg

    def register(self, handler: TaskHandler, *, kind: str | None = None) -> None:
        self._handlers[kind or handler.kind] = handler

    @property
    def kinds(self) -> list[str]:
        return sorted(self._handlers)

    def get(self, kind: object) -> TaskHandler:
        if not isinstance(kind, str) or kind not in self._handlers:
            raise TaskError(f"unknown task kind {kind!r}; known kinds: {', '.join(self.kinds)}")
        return self._handlers[kind]
