"""The Toolbox API: schemas, dispatch, argument errors, finish, lifecycle."""

from __future__ import annotations

import pytest

from rolloutd import tools
from rolloutd.sandbox import Sandbox
from rolloutd.tools import Toolbox, ToolError, open_toolbox, tool_schemas


def test_exports() -> None:
    assert set(tools.__all__) >= {"open_toolbox", "tool_schemas", "Toolbox", "ToolResult",
                                  "ToolError"}
    for name in tools.__all__:
        assert hasattr(tools, name)


def test_schemas_are_openai_style() -> None:
    schemas = tool_schemas(["bash", "ipython", "editor", "finish", "submit"])
    assert [s["function"]["name"] for s in schemas] == ["bash", "ipython", "editor", "finish",
                                                        "submit"]
    for s in schemas:
        assert s["type"] == "function"
        fn = s["function"]
        assert set(fn) == {"name", "description", "parameters"}
        assert fn["parameters"]["type"] == "object"
        assert set(fn["parameters"]["required"]) <= set(fn["parameters"]["properties"])
    editor = schemas[2]["function"]["parameters"]["properties"]["command"]["enum"]
    assert editor == ["view", "create", "str_replace", "insert", "undo_edit"]
    with pytest.raises(ValueError):
        tool_schemas(["nope"])


async def test_finish_without_a_sandbox() -> None:
    async with open_toolbox(None, ["finish"]) as tb:
        assert tb.names == ["finish"]
        assert [s["function"]["name"] for s in tb.schemas()] == ["finish"]
        r = await tb.call("finish", {"answer": "42"}, timeout_s=1)
        assert r.finished and r.answer == "42" and r.ok
        r = await tb.call("finish", '{"answer": "x"}', timeout_s=1)  # JSON text is accepted
        assert r.answer == "x"
        r = await tb.call("bash", {"command": "ls"}, timeout_s=1)
        assert not r.ok and "Unknown tool `bash`" in r.output
    with pytest.raises(ValueError):
        async with open_toolbox(None, ["bash"]):
            pass
    with pytest.raises(TypeError):
        async with open_toolbox(None, ["finish"], bogus=1):
            pass


async def test_bad_arguments_are_results_not_exceptions(bwrap_sandbox: Sandbox) -> None:
    async with open_toolbox(bwrap_sandbox, ["bash", "str_replace_editor", "ipython"]) as tb:
        r = await tb.call("bash", {"cmd": "ls"}, timeout_s=5)
        assert not r.ok and "Missing required parameter `command`" in r.output
        r = await tb.call("bash", {"command": 5}, timeout_s=5)
        assert not r.ok and "must be a string" in r.output
        r = await tb.call("bash", "{not json", timeout_s=5)
        assert not r.ok and "not valid JSON" in r.output
        r = await tb.call("bash", ["ls"], timeout_s=5)  # type: ignore[arg-type]
        assert not r.ok
        r = await tb.call("str_replace_editor", {"command": "view", "path": "/workspace"},
                          timeout_s=5)
        assert r.ok and r.latency_s > 0
        r = await tb.call("ipython", {}, timeout_s=5)
        assert not r.ok


async def test_tools_start_lazily_and_close(bwrap_sandbox: Sandbox) -> None:
    async with open_toolbox(bwrap_sandbox, ["bash", "ipython"]) as tb:
        assert tb.statistics()["bash_commands"] == 0
        assert not list(bwrap_sandbox.control_dir.glob("k*.json"))  # no kernel yet
        await tb.call("bash", {"command": "true"}, timeout_s=5)
        await tb.call("ipython", {"code": "1"}, timeout_s=30)
    # everything the tools left in the control dir is gone
    assert not [p for p in bwrap_sandbox.control_dir.iterdir()
                if p.name.startswith(("k", "bash-"))]
    with pytest.raises(ToolError):
        await tb.call("bash", {"command": "true"}, timeout_s=5)


async def test_sandbox_gone_is_a_tool_error(tmp_path) -> None:
    import shutil
    import tempfile
    from pathlib import Path

    from tests.tools.conftest import _open

    state = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    try:
        agen = _open(state, "bwrap")
        sb = await agen.__anext__()
        async with open_toolbox(sb, ["bash", "editor"]) as tb:
            await tb.call("bash", {"command": "true"}, timeout_s=5)
            await agen.aclose()  # tear the sandbox down under the toolbox
            with pytest.raises(ToolError):
                await tb.call("editor", {"command": "view", "path": "/workspace"}, timeout_s=5)
            with pytest.raises(ToolError):
                await tb.call("bash", {"command": "true"}, timeout_s=5)
    finally:
        shutil.rmtree(state, ignore_errors=True)


def _unused(tb: Toolbox) -> None:  # keeps the import used for type checkers
    del tb
