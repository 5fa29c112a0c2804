"""OpenAI-style JSON schemas of the tools (what goes into the chat template).

``tool_schemas(["bash", "editor", "finish"])`` returns
``[{"type": "function", "function": {"name", "description", "parameters"}}, ...]``.
The function names are the names the model calls and :meth:`Toolbox.call` accepts.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from .calculator import SCHEMA as _CALCULATOR

__all__ = ["ALIASES", "TOOL_NAMES", "tool_schemas"]

_BASH = {
    "name": "bash",
    "description": (
        "Run a bash command in a persistent shell inside the sandbox. The working directory, "
        "environment variables and shell functions persist between calls.\n"
        "* stdin is /dev/null: interactive programs (editors, pagers, REPLs, prompts) get no "
        "input; use heredocs, files or non-interactive flags instead.\n"
        "* Each call has a time limit; a command that runs past it is interrupted (SIGINT, "
        "then SIGKILL) and the output so far is returned. Start long-running processes in "
        "the background with output redirected to a file: `cmd > out.log 2>&1 &`.\n"
        "* Long output is truncated in the middle; use head, tail or grep.\n"
        "* If the shell exits (`exit`, or `set -e` with a failing command) a new shell is "
        "started and earlier state is lost. `set -e` applies to one call only.\n"
        "* Set `restart` to true to get a fresh shell."
    ),
    "parameters": {
        "type": "object",
        "properties": {
            "command": {
                "type": "string",
                "description": "The bash command(s) to run. May span several lines.",
            },
            "restart": {
                "type": "boolean",
                "description": "Restart the shell before running `command` (which may then "
                               "be empty).",
            },
        },
        "required": ["command"],
    },
}

_IPYTHON = {
    "name": "ipython",
    "description": (
        "Run Python code in a persistent IPython kernel inside the sandbox. Variables, "
        "imports and functions persist between calls. Returns printed output, the value of "
        "the last expression, display data as text, or the error traceback. IPython magics "
        "(`%timeit`, `!ls`) work. A cell that runs past the time limit is interrupted "
        "(KeyboardInterrupt); variables are kept. If the kernel crashes it is restarted and "
        "all state is lost."
    ),
    "parameters": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "The Python code to run."},
        },
        "required": ["code"],
    },
}

_EDITOR = {
    "name": "editor",
    "description": (
        "A file editor for viewing, creating and editing files (the str_replace_editor "
        "tool).\n"
        "* State is kept across calls; all paths must be absolute, e.g. /workspace/file.py.\n"
        "* `view` on a file shows `cat -n` output (optionally only `view_range`); on a "
        "directory it lists files up to 2 levels deep, excluding hidden ones.\n"
        "* `create` makes a new file with `file_text`; it cannot overwrite an existing file.\n"
        "* `str_replace` replaces `old_str` with `new_str`. `old_str` must match EXACTLY ONE "
        "place in the file, including whitespace and indentation; include 3-5 lines of "
        "context to make it unique. `new_str` and `old_str` must be different.\n"
        "* `insert` inserts `new_str` AFTER line `insert_line` (0 inserts at the top).\n"
        "* `undo_edit` reverts the last edit made to the file at `path`.\n"
        "* Binary files, non-UTF-8 files and files over 10 MB are refused; use bash for them."
    ),
    "parameters": {
        "type": "object",
        "properties": {
            "command": {
                "type": "string",
                "enum": ["view", "create", "str_replace", "insert", "undo_edit"],
                "description": "The command to run.",
            },
            "path": {
                "type": "string",
                "description": "Absolute path to a file or directory.",
            },
            "file_text": {
                "type": "string",
                "description": "`create`: the content of the new file.",
            },
            "old_str": {
                "type": "string",
                "description": "`str_replace`: the exact text to replace (must be unique).",
            },
            "new_str": {
                "type": "string",
                "description": "`str_replace`: the replacement text (empty deletes "
                               "`old_str`). `insert`: the lines to insert.",
            },
            "insert_line": {
                "type": "integer",
                "description": "`insert`: insert after this line number (0 = at the top).",
            },
            "view_range": {
                "type": "array",
                "items": {"type": "integer"},
                "description": "`view`: [start, end] line numbers, 1-based and inclusive; "
                               "end -1 means the end of the file.",
            },
        },
        "required": ["command", "path"],
    },
}

_FINISH = {
    "name": "finish",
    "description": (
        "Finish the task and submit the final answer. Call this once, when you are done; no "
        "further tool calls are made after it."
    ),
    "parameters": {
        "type": "object",
        "properties": {
            "answer": {
                "type": "string",
                "description": "The final answer (for a coding task, a short summary of what "
                               "was changed).",
            },
        },
        "required": ["answer"],
    },
}

_SCHEMAS: dict[str, dict[str, Any]] = {
    "bash": _BASH,
    "ipython": _IPYTHON,
    "editor": _EDITOR,
    "finish": _FINISH,
    "calculator": _CALCULATOR,
}

TOOL_NAMES: tuple[str, ...] = tuple(_SCHEMAS)
# other names a caller (or a model) may use for the same tool
ALIASES = {"str_replace_editor": "editor", "submit": "finish", "python": "ipython"}


def canonical_name(name: str) -> str:
    return ALIASES.get(name, name)


def tool_schemas(names: Sequence[str]) -> list[dict[str, Any]]:
    """OpenAI-style schemas for ``names`` (in that order). ``submit`` gives the finish tool
    under the name ``submit``; ``str_replace_editor`` gives the editor under that name."""
    out = []
    for name in names:
        base = _SCHEMAS.get(canonical_name(name))
        if base is None:
            raise ValueError(f"unknown tool {name!r}; known: {', '.join(TOOL_NAMES)}")
        fn = copy.deepcopy(base)
        fn["name"] = name
        out.append({"type": "function", "function": fn})
    return out
