"""Where task kinds come from: the built-in handlers and the ``rolloutd.tasks`` entry points."""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points
from typing import Any

from pydantic import BaseModel, ValidationError

from rolloutd.daemon.harness import AgentSpec
from rolloutd.daemon.tasks.base import TaskError, TaskHandler, describe_errors, model_kind

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rolloutd.tasks"

#: kind -> "module:Class" of the handlers that ship with rolloutd.
BUILTIN = {
    "sleep": "rolloutd.daemon.tasks.sleep:SleepTask",
    "math": "rolloutd.daemon.tasks.math:MathTask",
    "code": "rolloutd.daemon.tasks.code:CodeTask",
    "swe": "rolloutd.daemon.tasks.swe:SweTask",
    "calc": "rolloutd.daemon.tasks.calc:CalcTask",
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
        if handler.task_model is None and type(handler).validate is TaskHandler.validate:
            raise TypeError(f"{type(handler).__name__} has neither a task_model nor its own validate")
        self._handlers[kind or handler.kind] = handler

    @property
    def kinds(self) -> list[str]:
        return sorted(self._handlers)

    def get(self, kind: object) -> TaskHandler:
        if not isinstance(kind, str) or kind not in self._handlers:
            raise TaskError(f"unknown task kind {kind!r}; known kinds: {', '.join(self.kinds)}")
        return self._handlers[kind]

    def validate(self, task: object) -> dict[str, Any]:
        """The normalised task, as its handler's ``validate`` reads it (for the built-in kinds:
        through the ``task_model`` the OpenAPI document publishes)."""
        if not isinstance(task, dict):
            raise TaskError(f"a task must be a JSON object, not {type(task).__name__}")
        checked = self.get(task.get("kind")).validate(task)
        if checked.get("agent") is not None:  # any kind may name a harness (section 13)
            checked["agent"] = agent_field(checked["agent"], task.get("kind"))
        return checked

    def _model(self, kind: object) -> type[BaseModel] | None:
        """The handler's task model, if it is the model of this kind (a handler registered
        under another kind than its model's ``kind`` has none)."""
        model = self.get(kind).task_model
        return model if model is not None and model_kind(model) == kind else None

    def task_schemas(self, ref_template: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The JSON schema of a task (one of the registered kinds) and the definitions it
        refers to (``ref_template`` formats their references)."""
        branches: list[dict[str, Any]] = []
        definitions: dict[str, Any] = {}
        for kind in self.kinds:
            model = self._model(kind)
            if model is None:  # a plug-in without a model: only its kind is known
                branches.append({"type": "object", "required": ["kind"],
                                 "properties": {"kind": {"const": kind}}})
                continue
            schema = model.model_json_schema(ref_template=ref_template)
            definitions.update(schema.pop("$defs", {}))
            definitions[model.__name__] = schema
            branches.append({"$ref": ref_template.format(model=model.__name__)})
        return {"oneOf": branches}, definitions


def agent_field(raw: Any, kind: Any) -> dict[str, Any]:
    """A task's ``agent`` checked (:class:`rolloutd.daemon.harness.AgentSpec`), as JSON."""
    try:
        return AgentSpec.model_validate(raw).model_dump()
    except ValidationError as exc:
        raise TaskError(f"{kind} task: agent: {describe_errors(exc)}") from None
