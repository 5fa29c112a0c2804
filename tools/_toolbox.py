"""The Toolbox: the tools of one rollout, bound to its sandbox.

``async with open_toolbox(sb, ["bash", "editor", "finish"]) as tb:`` then
``await tb.call("bash", {"command": "ls"}, timeout_s=30)``. Tools start lazily (the shell on
the first bash call, the kernel on the first ipython call) and are all closed when the
context exits (shielded, bounded). The model's mistakes come back as ``ok=False`` results;
only infrastructure failure raises :class:`ToolError`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from rolloutd.sandbox import SandboxError

from ._errors import ToolError
from .bash import BashSession
from .editor import Editor
from .ipython import KernelSession
from .schemas import TOOL_NAMES, canonical_name, tool_schemas

if TYPE_CHECKING:
    from rolloutd.sandbox import Sandbox

__all__ = ["ToolResult", "Toolbox", "open_toolbox"]

CLOSE_TIMEOUT_S = 10.0
SANDBOX_TOOLS = ("bash", "ipython", "editor")
OPTIONS = {
    "max_output_chars": 10_000,  # bash / ipython observations (head + tail)
    "bash_env": None,  # extra environment for the shell
    "bash_startup_timeout_s": 30.0,
    "interrupt_grace_s": 0.5,  # bash: after SIGINT and again after SIGKILL
    "kernel_startup_timeout_s": 60.0,
    "kernel_interrupt_grace_s": 2.0,
    "editor_max_file_bytes": 10 * 1024 * 1024,
    "editor_max_output_chars": 16_000,
}


@dataclass
class ToolResult:
    output: str
    ok: bool = True
    exit_code: int | None = None
    timed_out: bool = False
    finished: bool = False
    answer: str | None = None  # set by the finish tool
    latency_s: float = 0.0


class _BadArgs(Exception):
    pass


def _string(args: dict[str, Any], key: str, *, required: bool = True) -> str | None:
    value = args.get(key)
    if value is None:
        if required:
            raise _BadArgs(f"Missing required parameter `{key}`.")
        return None
    if not isinstance(value, str):
        raise _BadArgs(f"Parameter `{key}` must be a string, got {type(value).__name__}.")
    return value


class Toolbox:
    """The tools named at :func:`open_toolbox`. ``call`` serialises calls per tool."""

    def __init__(self, sandbox: Sandbox | None, names: Sequence[str], nursery: trio.Nursery,
                 options: dict[str, Any]) -> None:
        self.names = list(names)
        self._sb = sandbox
        self._nursery = nursery
        self._opt = options
        self._schemas = tool_schemas(self.names)
        self._by_name = {n: canonical_name(n) for n in self.names}
        self._locks = {c: trio.Lock() for c in set(self._by_name.values())}
        self._bash: BashSession | None = None
        self._kernel: KernelSession | None = None
        self._editor: Editor | None = None
        self._closed = False

    def schemas(self) -> list[dict[str, Any]]:
        return [dict(s) for s in self._schemas]

    def statistics(self) -> dict[str, Any]:
        return {
            "bash_commands": self._bash.commands_run if self._bash else 0,
            "bash_restarts": self._bash.restarts if self._bash else 0,
            "kernel_restarts": self._kernel.restarts if self._kernel else 0,
        }

    async def call(self, name: str, arguments: dict[str, Any] | str | None, *,
                   timeout_s: float) -> ToolResult:
        """Run one tool call. Never raises for the model's mistakes; raises
        :class:`ToolError` when the sandbox (or a tool's process) cannot be used at all."""
        t0 = time.perf_counter()
        result = await self._call(name, arguments, timeout_s)
        result.latency_s = time.perf_counter() - t0
        return result

    async def _call(self, name: str, arguments: dict[str, Any] | str | None,
                    timeout_s: float) -> ToolResult:
        if self._closed:
            raise ToolError("the toolbox is closed")
        tool = self._by_name.get(name)
        if tool is None:
            return ToolResult(f"Unknown tool `{name}`. Available tools: "
                              f"{', '.join(self.names)}.", ok=False)
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                return ToolResult(f"The arguments of `{name}` are not valid JSON: {exc}.",
                                  ok=False)
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return ToolResult(f"The arguments of `{name}` must be a JSON object.", ok=False)
        try:
            async with self._locks[tool]:
                if tool == "bash":
                    return await self._call_bash(arguments, timeout_s)
                if tool == "ipython":
                    return await self._call_ipython(arguments, timeout_s)
                if tool == "editor":
                    return await self._call_editor(arguments, timeout_s)
                if tool == "calculator":
                    return _call_calculator(arguments)
                return self._call_finish(arguments)
        except _BadArgs as exc:
            return ToolResult(f"Invalid arguments for `{name}`: {exc}", ok=False)
        except ToolError:
            raise
        except trio.Cancelled:
            raise
        except SandboxError as exc:
            raise ToolError(f"{name}: the sandbox failed: {exc}") from exc

    # ------------------------------------------------------------------ tools
    def _need_sandbox(self) -> Sandbox:
        if self._sb is None:
            raise ToolError("this toolbox has no sandbox")
        return self._sb

    async def _call_bash(self, args: dict[str, Any], timeout_s: float) -> ToolResult:
        restart = bool(args.get("restart"))
        command = _string(args, "command", required=not restart) or ""
        if self._bash is None:
            self._bash = BashSession(
                self._need_sandbox(), self._nursery,
                max_output_chars=self._opt["max_output_chars"], env=self._opt["bash_env"],
                startup_timeout_s=self._opt["bash_startup_timeout_s"],
                interrupt_grace_s=self._opt["interrupt_grace_s"])
        if restart:
            await self._bash.restart()
            if not command.strip():
                return ToolResult("[The shell was restarted.]", exit_code=0)
        if not command.strip():
            return ToolResult("The command is empty; nothing was run.", ok=False)
        r = await self._bash.run(command, timeout_s=timeout_s)
        return ToolResult(r.output, ok=r.exit_code == 0 and not r.timed_out,
                          exit_code=r.exit_code, timed_out=r.timed_out)

    async def _call_ipython(self, args: dict[str, Any], timeout_s: float) -> ToolResult:
        code = _string(args, "code") or ""
        if self._kernel is None:
            self._kernel = KernelSession(
                self._need_sandbox(), self._nursery,
                max_output_chars=self._opt["max_output_chars"],
                startup_timeout_s=self._opt["kernel_startup_timeout_s"],
                interrupt_grace_s=self._opt["kernel_interrupt_grace_s"])
        r = await self._kernel.execute(code, timeout_s=timeout_s)
        return ToolResult(r.output, ok=r.ok, timed_out=r.timed_out)

    async def _call_editor(self, args: dict[str, Any], timeout_s: float) -> ToolResult:
        if self._editor is None:
            self._editor = Editor(self._need_sandbox(),
                                  max_file_bytes=self._opt["editor_max_file_bytes"],
                                  max_output_chars=self._opt["editor_max_output_chars"])
        with trio.move_on_after(timeout_s):
            r = await self._editor(args)
            return ToolResult(r.output, ok=r.ok)
        return ToolResult(f"The editor operation timed out after {timeout_s:g} s.", ok=False,
                          timed_out=True)

    def _call_finish(self, args: dict[str, Any]) -> ToolResult:
        answer = args.get("answer", args.get("result", ""))
        if answer is None:
            answer = ""
        if not isinstance(answer, str):
            answer = json.dumps(answer)
        return ToolResult("[Finished.]", finished=True, answer=answer)

    async def aclose(self) -> None:
        """Close every tool (kill the shell, the kernel). Shielded and bounded."""
        self._closed = True
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            if self._bash is not None:
                await self._bash.aclose()
            if self._kernel is not None:
                await self._kernel.aclose()


def _call_calculator(args: dict[str, Any]) -> ToolResult:
    from .calculator import CalculatorError, evaluate, format_result

    expression = _string(args, "expression") or ""
    try:
        return ToolResult(format_result(evaluate(expression)), exit_code=0)
    except CalculatorError as exc:
        return ToolResult(f"Error: {exc}", ok=False, exit_code=1)


@asynccontextmanager
async def open_toolbox(sandbox: Sandbox | None, names: Sequence[str],
                       **options: Any) -> AsyncIterator[Toolbox]:
    """A :class:`Toolbox` with the tools ``names`` (``bash``, ``ipython``, ``editor``,
    ``finish``; aliases ``str_replace_editor``, ``submit``). ``sandbox`` may be None only when
    no tool needs one. Options (all optional): see :data:`OPTIONS`."""
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(f"unknown toolbox options: {', '.join(sorted(unknown))}")
    for n in names:
        if canonical_name(n) not in TOOL_NAMES:
            raise ValueError(f"unknown tool {n!r}; known: {', '.join(TOOL_NAMES)}")
    if sandbox is None and any(canonical_name(n) in SANDBOX_TOOLS for n in names):
        raise ValueError("bash, ipython and editor need a sandbox")
    opts = {**OPTIONS, **options}
    async with trio.open_nursery() as nursery:
        box = Toolbox(sandbox, names, nursery, opts)
        try:
            yield box
        finally:
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await box.aclose()
            nursery.cancel_scope.cancel()
