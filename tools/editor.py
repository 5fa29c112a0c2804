"""The ``str_replace_editor`` file editor (view / create / str_replace / insert / undo_edit).

Messages follow the OpenHands-ACI / Anthropic contract so models trained on it behave. Every
file access goes through the sandbox's file operations, which resolve paths inside the
sandbox: a symlink pointing outside it is refused (``PathEscapeError``), never followed.

Deliberate choices:
- tabs are never expanded; a file's trailing newline (or its absence) is kept;
- ``str_replace`` needs exactly one match; otherwise the error says how many and on which
  lines;
- files over ``max_file_bytes`` (10 MB) or that look binary (NUL bytes, invalid UTF-8) are
  refused with a hint to use bash;
- undo keeps the last ``history`` (10) versions per file, in memory, for this toolbox.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from rolloutd.sandbox import PathEscapeError, SandboxError

from ._errors import ToolError

if TYPE_CHECKING:
    from rolloutd.sandbox import Sandbox

__all__ = ["COMMANDS", "Editor", "EditorResult"]

COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")
SNIPPET_LINES = 4
MAX_FILE_BYTES = 10 * 1024 * 1024
MAX_OUTPUT_CHARS = 16_000
MAX_DIR_ENTRIES = 1000
CLIPPED_NOTE = (
    "<response clipped><NOTE>To save on context only part of this file has been shown to you. "
    "You should retry this tool after you have searched inside the file with `grep -n` in order "
    "to find the line numbers of what you are looking for.</NOTE>"
)


@dataclass
class EditorResult:
    output: str
    ok: bool = True


class _Fail(Exception):
    """An error message for the model."""


class _IsDir(_Fail):
    def __init__(self, path: str) -> None:
        super().__init__(f"The path {path} is a directory and only the `view` command can be "
                         "used on directories.")


@dataclass
class _Content:
    path: str  # normalised absolute path inside the sandbox (history key)
    text: str


def _number(lines: list[str], start: int) -> str:
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(lines, start))


def _lines(text: str) -> list[str]:
    """Lines as ``cat -n`` shows them: a final newline does not start an extra line."""
    if not text:
        return []
    parts = text.split("\n")
    if text.endswith("\n"):
        parts.pop()
    return parts


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + CLIPPED_NOTE


@dataclass
class Editor:
    sandbox: Sandbox
    max_file_bytes: int = MAX_FILE_BYTES
    max_output_chars: int = MAX_OUTPUT_CHARS
    history: int = 10
    _undo: dict[str, list[str | None]] = field(default_factory=dict)

    async def __call__(self, args: dict[str, Any]) -> EditorResult:
        try:
            return EditorResult(await self._dispatch(args))
        except _Fail as exc:
            return EditorResult(str(exc), ok=False)

    # ------------------------------------------------------------------ plumbing
    async def _fs(self, what: str, path: str, coro: Any) -> Any:
        """Await a sandbox file operation, turning its errors into model-facing messages."""
        try:
            return await coro
        except trio.Cancelled:
            raise
        except PathEscapeError:
            raise _Fail(f"The path {path} resolves to a location outside the sandbox (for "
                        "example through a symlink); the editor cannot access it.") from None
        except FileNotFoundError:
            raise _Fail(f"The path {path} does not exist. Please provide a valid path.") from None
        except IsADirectoryError:
            raise _IsDir(path) from None
        except SandboxError as exc:
            raise ToolError(f"sandbox file operation failed: {exc}") from exc
        except OSError as exc:
            raise _Fail(f"Ran into {exc.strerror or exc} while trying to {what} {path}") from None

    def _check_path(self, path: Any, command: str) -> str:
        if not isinstance(path, str) or not path:
            raise _Fail(f"Parameter `path` is required for command: {command}.")
        if not path.startswith("/"):
            guess = posixpath.join(self.sandbox.workdir, path)
            raise _Fail(f"Invalid `path` parameter: {path}. The path should be an absolute path, "
                        f"starting with `/`. Maybe you meant {guess}?")
        return posixpath.normpath(path)

    async def _read(self, path: str) -> _Content:
        """One helper round trip: no stat first (the read reports directories, missing
        files and escapes itself; the size check uses ``max_bytes``)."""
        data = await self._fs("read", path, self.sandbox.read_file(
            path, max_bytes=self.max_file_bytes + 1))
        if len(data) > self.max_file_bytes:
            raise _Fail(f"File validation failed for {path}: File is too large (more than "
                        f"{self.max_file_bytes / 1e6:.0f}MB). Maximum allowed size is "
                        f"{self.max_file_bytes / 1e6:.0f}MB. Use bash commands (head, sed -n, "
                        "grep -n) for it.")
        if b"\x00" in data[:8192]:
            raise _Fail(f"File validation failed for {path}: File appears to be binary and this "
                        "file type cannot be read or edited by this tool.")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Fail(f"The editor only supports UTF-8 encoding files (byte {exc.start} is not "
                        f"valid UTF-8), please use bash commands for files with other encoding: "
                        f"{path}") from None
        return _Content(path, text)

    async def _write(self, path: str, text: str) -> None:
        await self._fs("write to", path, self.sandbox.write_file(path, text.encode("utf-8")))

    def _remember(self, key: str, old: str | None) -> None:
        stack = self._undo.setdefault(key, [])
        stack.append(old)
        del stack[: -self.history]

    def _snippet(self, text: str, first: int, n_new: int) -> str:
        """``cat -n`` of lines [first - 4, first + n_new + 4] (0-based ``first``)."""
        lines = _lines(text)
        lo = max(0, first - SNIPPET_LINES)
        hi = min(len(lines), first + n_new + SNIPPET_LINES)
        return _number(lines[lo:hi], lo + 1)

    # ------------------------------------------------------------------ commands
    async def _dispatch(self, args: dict[str, Any]) -> str:
        command = args.get("command")
        if command not in COMMANDS:
            raise _Fail(f"Unrecognized command {command}. The allowed commands for the editor "
                        f"tool are: {', '.join(COMMANDS)}")
        path = self._check_path(args.get("path"), command)
        if command == "view":
            return await self._view(path, args.get("view_range"))
        if command == "create":
            return await self._create(path, args.get("file_text"))
        if command == "str_replace":
            return await self._str_replace(path, args.get("old_str"), args.get("new_str"))
        if command == "insert":
            return await self._insert(path, args.get("insert_line"), args.get("new_str"))
        return await self._undo_edit(path)

    async def _view(self, path: str, view_range: Any) -> str:
        try:
            content = await self._read(path)
        except _IsDir:
            if view_range is not None:
                raise _Fail("The `view_range` parameter is not allowed when `path` points to a "
                            "directory.") from None
            return await self._view_dir(path)
        lines = _lines(content.text)
        start, note = 1, ""
        if view_range is not None:
            if (not isinstance(view_range, list) or len(view_range) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool)
                               for v in view_range)):
                raise _Fail(f"Invalid `view_range` parameter: {view_range}. It should be a list "
                            "of two integers.")
            start, end = view_range
            n = len(lines)
            if not 1 <= start <= max(n, 1):
                raise _Fail(f"Invalid `view_range` parameter: {view_range}. Its first element "
                            f"`{start}` should be within the range of lines of the file: "
                            f"[1, {n}].")
            if end == -1:
                end = n
            elif end < start:
                raise _Fail(f"Invalid `view_range` parameter: {view_range}. Its second element "
                            f"`{end}` should be greater than or equal to the first element "
                            f"`{start}`.")
            elif end > n:
                note = f"NOTE: We only show up to {n} since there's only {n} lines in this file.\n"
                end = n
            lines = lines[start - 1:end]
        body = _number(lines, start)
        return _clip(f"{note}Here's the result of running `cat -n` on {path}:\n{body}\n",
                     self.max_output_chars)

    async def _view_dir(self, path: str) -> str:
        entries = await self._fs("list", path, self.sandbox.list_dir(path))
        out: list[str] = []
        hidden = sum(1 for e in entries if e.name.startswith("."))
        more = 0
        for e in entries:
            if e.name.startswith("."):
                continue
            child = posixpath.join(path, e.name)
            if len(out) >= MAX_DIR_ENTRIES:
                more += 1
                continue
            out.append(child + ("/" if e.type == "dir" else ""))
            if e.type == "dir":
                try:
                    sub = await self._fs("list", child, self.sandbox.list_dir(child))
                except _Fail:
                    continue
                for s in sub:
                    if s.name.startswith("."):
                        continue
                    if len(out) >= MAX_DIR_ENTRIES:
                        more += 1
                        continue
                    out.append(posixpath.join(child, s.name) + ("/" if s.type == "dir" else ""))
        text = (f"Here's the files and directories up to 2 levels deep in {path}, excluding "
                f"hidden items:\n{path}/\n" + "\n".join(out) + "\n")
        if more:
            text += f"[... {more} more entries not shown; use `ls` or `find` to see them.]\n"
        if hidden:
            text += (f"\n{hidden} hidden files/directories in this directory are excluded. You "
                     f"can use 'ls -la {path}' to see them.\n")
        return text

    async def _create(self, path: str, file_text: Any) -> str:
        if not isinstance(file_text, str):
            raise _Fail("Parameter `file_text` is required for command: create.")
        st = await self._fs("create", path, self.sandbox.stat(path))
        if st is not None:
            if st.type == "dir":
                raise _Fail(f"The path {path} is a directory and only the `view` command can be "
                            "used on directories.")
            raise _Fail(f"File already exists at: {path}. Cannot overwrite files using command "
                        "`create`.")
        parent = posixpath.dirname(path)
        if parent and parent != "/":
            await self._fs("create the directory for", path, self.sandbox.mkdir(parent))
        await self._write(path, file_text)
        self._remember(path, None)
        return f"File created successfully at: {path}"

    async def _str_replace(self, path: str, old: Any, new: Any) -> str:
        if not isinstance(old, str):
            raise _Fail("Parameter `old_str` is required for command: str_replace.")
        if new is None:
            new = ""
        if not isinstance(new, str):
            raise _Fail(f"Invalid `new_str` parameter: {new!r}. It should be a string.")
        if old == "":
            raise _Fail("No replacement was performed. `old_str` must not be empty; use "
                        "`insert` or `create` to add text.")
        if old == new:
            raise _Fail("No replacement was performed. `new_str` and `old_str` must be different.")
        content = await self._read(path)
        text = content.text
        count = text.count(old)
        if count == 0:
            hint = ""
            if old.strip() and old.strip() in text:
                hint = (" It does appear when leading/trailing whitespace is ignored: check "
                        "indentation (tabs vs spaces) and line breaks.")
            raise _Fail(f"No replacement was performed, old_str `{old}` did not appear verbatim "
                        f"in {path}.{hint}")
        if count > 1:
            lines, pos = [], text.find(old)
            while pos >= 0:
                lines.append(text.count("\n", 0, pos) + 1)
                pos = text.find(old, pos + len(old))
            raise _Fail(f"No replacement was performed. Multiple occurrences of old_str `{old}` "
                        f"({count} matches) in lines {lines}. Please ensure it is unique: "
                        "include more surrounding lines in old_str.")
        pos = text.find(old)
        new_text = text[:pos] + new + text[pos + len(old):]
        await self._write(path, new_text)
        self._remember(content.path, text)
        first = text.count("\n", 0, pos)
        snippet = self._snippet(new_text, first, new.count("\n") + 1)
        return (f"The file {path} has been edited. Here's the result of running `cat -n` on a "
                f"snippet of {path}:\n{snippet}\nReview the changes and make sure they are as "
                "expected. Edit the file again if necessary.")

    async def _insert(self, path: str, insert_line: Any, new: Any) -> str:
        if insert_line is None:
            raise _Fail("Parameter `insert_line` is required for command: insert.")
        if isinstance(insert_line, str) and insert_line.strip().lstrip("-").isdigit():
            insert_line = int(insert_line)
        if not isinstance(insert_line, int) or isinstance(insert_line, bool):
            raise _Fail(f"Invalid `insert_line` parameter: {insert_line!r}. Expected an integer.")
        if not isinstance(new, str):
            raise _Fail("Parameter `new_str` is required for command: insert.")
        content = await self._read(path)
        text = content.text
        parts = text.split("\n")
        n = len(_lines(text))
        if not 0 <= insert_line <= n:
            raise _Fail(f"Invalid `insert_line` parameter: {insert_line}. It should be within "
                        f"the range of allowed values: [0, {n}]")
        if new.endswith("\n"):
            new = new[:-1]  # the inserted text is a block of whole lines
        new_lines = new.split("\n")
        if text == "":
            parts = []
        new_text = "\n".join(parts[:insert_line] + new_lines + parts[insert_line:])
        if text == "":
            new_text += "\n"
        await self._write(path, new_text)
        self._remember(content.path, text)
        snippet = self._snippet(new_text, insert_line, len(new_lines))
        return (f"The file {path} has been edited. Here's the result of running `cat -n` on a "
                f"snippet of the edited file:\n{snippet}\nReview the changes and make sure they "
                "are as expected (correct indentation, no duplicate lines, etc). Edit the file "
                "again if necessary.")

    async def _undo_edit(self, path: str) -> str:
        stack = self._undo.get(path)
        if not stack:
            raise _Fail(f"No edit history found for {path}.")
        old = stack.pop()
        if old is None:
            await self._fs("remove", path, self.sandbox.remove(path))
            return (f"Last edit to {path} undone successfully. The file was created by that edit "
                    "and has been removed.")
        await self._write(path, old)
        return (f"Last edit to {path} undone successfully. Here's the result of running `cat -n` "
                f"on {path}:\n" + _clip(_number(_lines(old), 1) + "\n", self.max_output_chars))
