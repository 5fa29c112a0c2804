"""The public surface of tools/ is exactly __all__ (like httpx's test_exported_members)."""

from __future__ import annotations

import types

from rolloutd import tools

EXPECTED = {
    "OPTIONS",
    "TOOL_NAMES",
    "ToolError",
    "ToolResult",
    "ToolStartError",
    "Toolbox",
    "open_toolbox",
    "tool_schemas",
}


def test_all_is_exactly_the_public_api():
    assert set(tools.__all__) == EXPECTED
    for name in tools.__all__:
        assert hasattr(tools, name), name
    public = {
        n
        for n, v in vars(tools).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert public == EXPECTED


def test_tool_names():
    schemas = tools.tool_schemas(tools.TOOL_NAMES)
    assert [s["function"]["name"] for s in schemas] == list(tools.TOOL_NAMES)


def test_error_tree():
    assert issubclass(tools.ToolStartError, tools.ToolError)
