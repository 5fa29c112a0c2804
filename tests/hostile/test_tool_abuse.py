"""Hostile input through the tools the model drives (bwrap): one endless line through the bash
tool, and path traversal through the file editor. (Many-line floods, hangs, interactive
programs and symlinks through the editor are in tests/tools/.)"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sandbox import SandboxSpec, open_backend
from tools import open_toolbox

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture
async def box() -> AsyncIterator[Any]:
    state = Path(tempfile.mkdtemp(prefix="rlt", dir="/tmp"))
    fds = set(os.listdir("/proc/self/fd"))
    backend = open_backend("bwrap", state_dir=state, boot_id="t" + secrets.token_hex(4), check=True)
    try:
        async with backend.open(SandboxSpec(lifetime_s=300)) as sb, \
                open_toolbox(sb, ["bash", "editor"]) as tb:
            yield sb, tb
        assert set(os.listdir("/proc/self/fd")) - fds == set(), "fds leaked"
        assert not (state / "sandboxes").exists() or list((state / "sandboxes").rglob("*")) == []
    finally:
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.slow
async def test_one_endless_line_through_bash_is_bounded(box: Any) -> None:
    """50 MB without a newline (a minified file, a binary cat): the tool keeps draining the
    pty, the observation is a bounded head+tail, the daemon does not grow, the shell lives."""
    _, tb = box
    before = _rss_mb()
    t0 = time.monotonic()
    r = await tb.call("bash", {"command": "head -c 50000000 /dev/zero | tr '\\0' a; echo; echo END"},
                      timeout_s=120)
    took = time.monotonic() - t0
    assert r.exit_code == 0 and not r.timed_out, r.output[-300:]
    assert len(r.output) < 20_000 and r.output.endswith("END\n")
    assert "omitted" in r.output
    assert _rss_mb() - before < 50
    assert took < 100
    r = await tb.call("bash", {"command": "echo still here"}, timeout_s=10)
    assert r.output == "still here\n"


TRAVERSALS = [
    "/workspace/../etc/passwd",
    "/workspace/../../../../../etc/passwd",
    "/etc/passwd",
    "/workspace/%2e%2e/%2e%2e/etc/passwd",
    "/workspace/..%2f..%2fetc/passwd",
    "/proc/1/environ",
    "/proc/self/root/etc/passwd",
    "/workspace/a\0/../../etc/passwd",
    "/workspace/" + "x" * 5000,
    "/workspace/../root/.ssh/authorized_keys",
    "/workspace/new\nline/../../etc/passwd",
]


def _digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "-"


@pytest.mark.parametrize("command", ["view", "create", "str_replace", "insert"])
async def test_path_traversal_through_the_editor(box: Any, command: str) -> None:
    sb, tb = box
    watched = ["/etc/passwd", "/root/.ssh/authorized_keys"]
    before = [_digest(p) for p in watched]
    args = {"view": {}, "create": {"file_text": "pwned\n"},
            "str_replace": {"old_str": "root", "new_str": "pwned"},
            "insert": {"insert_line": 0, "new_str": "pwned\n"}}[command]
    for path in TRAVERSALS:
        r = await tb.call("editor", {"command": command, "path": path, **args}, timeout_s=10)
        assert "root:x:" not in r.output and "ROLLOUTD" not in r.output, (path, r.output[:300])
        if "%2e" not in path and "%2f" not in path:  # only those are literal names inside
            assert not r.ok, (path, r.output)
    assert [_digest(p) for p in watched] == before
    for name in ("/etc/pwned", "/root/pwned"):
        assert not os.path.exists(name)
    # what was created is in the workspace (the literal "%2e%2e" names), nowhere else
    r = await tb.call("bash", {"command": "grep -rl pwned /workspace /tmp 2>/dev/null"}, timeout_s=30)
    assert all(line.startswith("/workspace/") for line in r.output.split()), r.output
    assert sb.workspace.is_dir()
