"""What tools/'s public names mean (that they are exactly ``__all__``: tests/test_exports.py)."""

from __future__ import annotations

from rolloutd import tools


def test_tool_names():
    schemas = tools.tool_schemas(tools.TOOL_NAMES)
    assert [s["function"]["name"] for s in schemas] == list(tools.TOOL_NAMES)


def test_error_tree():
    assert issubclass(tools.ToolStartError, tools.ToolError)
