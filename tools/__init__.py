"""Tools an agent uses inside a sandbox: bash (a persistent shell on a pty), ipython (a
persistent kernel), editor (str_replace_editor) and finish.

Public API (the agent loop relies on exactly this)::

    from rolloutd.tools import open_toolbox, tool_schemas, Toolbox, ToolResult, ToolError

    async with open_toolbox(sandbox, ["bash", "editor", "finish"]) as tb:
        tb.schemas()                                   # OpenAI-style tool schemas
        r = await tb.call("bash", {"command": "ls"}, timeout_s=30)

See docs/tools.md for what each tool does and the messages the model sees.
"""

from ._errors import ToolError, ToolStartError
from ._toolbox import OPTIONS, Toolbox, ToolResult, open_toolbox
from .schemas import TOOL_NAMES, tool_schemas

__all__ = [
    "OPTIONS",
    "TOOL_NAMES",
    "ToolError",
    "ToolResult",
    "ToolStartError",
    "Toolbox",
    "open_toolbox",
    "tool_schemas",
]
