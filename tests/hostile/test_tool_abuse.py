"""Hostile input through the tools the model drives (bwrap): one endless line through the bash
tool, a shell the model broke, symlinks planted in the control dir for the bash tool's
files, and path traversal through the file editor. (Many-line floods, hangs, interactive
programs and symlinks through the editor are in tests/tools/.)"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from rolloutd.sandbox import SandboxSpec, open_backend
from rolloutd.tools import open_toolbox

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(scope="module")
def image_store() -> Iterator[Any]:
    from rolloutd.sandbox.images import ImageStore

    path = Path(tempfile.mkdtemp(prefix="rlts", dir="/tmp"))
    yield ImageStore(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["host-root", "image"])
async def box(request: pytest.FixtureRequest, image_store: Any) -> AsyncIterator[Any]:
    """A bwrap sandbox with the bash and editor tools: over the host's root, and in the
    Debian test image (tests/_images.py)."""
    image = None
    if request.param == "image":
        images = request.getfixturevalue("test_images")
        image = images.oci_ref(images.debian_oci)
        await trio.to_thread.run_sync(image_store.resolve, image)
    state = Path(tempfile.mkdtemp(prefix="rlt", dir="/tmp"))
    fds = set(os.listdir("/proc/self/fd"))
    backend = open_backend("bwrap", state_dir=state, boot_id="t" + secrets.token_hex(4), check=True,
                           images=image_store)
    try:
        async with backend.open(SandboxSpec(lifetime_s=300, image=image)) as sb, \
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


@pytest.mark.parametrize("breaker", [
    "ulimit -n 3", "ulimit -n 1", "exec 1>&-", "exec 2>&-", "exec >/dev/null",
    "exec 2>/dev/null", "exec >out.log 2>&1", "exec 1>&- 2>&- 255>&-",
    "readonly PS0=x", "declare -r PROMPT_COMMAND='echo PC'",
])
async def test_a_broken_shell_is_restarted_at_once(box: Any, breaker: str) -> None:
    """A shell that can no longer run commands or show their output (an fd limit below what
    it needs, stdout/stderr closed or sent away from the terminal, a prompt variable the
    tool cannot reset) used to fail every later call or hang each one until its timeout:
    it is restarted by the call that broke it."""
    _, tb = box
    await tb.call("bash", {"command": "cd /tmp && X=1"}, timeout_s=10)
    t0 = time.monotonic()
    r = await tb.call("bash", {"command": f"echo before; {breaker}; echo after"}, timeout_s=60)
    assert time.monotonic() - t0 < 5, r.output
    assert not r.timed_out and "left the shell unusable" in r.output, r.output
    assert "A new shell has been started" in r.output
    r = await tb.call("bash", {"command": "echo ok; pwd; echo ${X-unset}"}, timeout_s=10)
    assert r.output == "ok\n/workspace\nunset\n", r.output


async def test_symlinks_in_the_control_dir_are_not_followed(box: Any) -> None:
    """The control dir is writable from inside. The bash tool used to write a long command
    to a fixed file there, through whatever the sandbox had put at that name (a symlink to
    any host file: the daemon, maybe root, overwrote it). It now creates a new, random
    name with O_EXCL|O_NOFOLLOW; its python shims go through dir fds without following."""
    sb, tb = box
    outside = Path(tempfile.mkdtemp(prefix="rlt-victim", dir="/tmp"))
    try:
        victim = outside / "victim"
        victim.write_text("intact\n")
        long_cmd = "echo " + "y" * 5000 + " | wc -c"
        assert (await tb.call("bash", {"command": long_cmd}, timeout_s=10)).output == "5001\n"
        ctl = str(sb.control_dir)
        plant = (f"for f in {ctl}/bash-*.sh; do rm -f $f; ln -s {victim} $f; done; "
                 f"rm -rf {ctl}/bin; ln -s {outside} {ctl}/bin")
        r = await tb.call("bash", {"command": plant}, timeout_s=10)
        assert r.ok, r.output
        assert (await tb.call("bash", {"command": long_cmd}, timeout_s=10)).output == "5001\n"
        await tb.call("bash", {"command": "", "restart": True}, timeout_s=10)  # shims again
        assert (await tb.call("bash", {"command": "echo alive"}, timeout_s=10)).output == \
            "alive\n"
        assert victim.read_text() == "intact\n"
        assert sorted(p.name for p in outside.iterdir()) == ["victim"]
        # a symlink planted at a shim's name is replaced, not followed
        await tb.call("bash", {"command": f"rm {ctl}/bin; mkdir {ctl}/bin; "
                               f"ln -s {victim} {ctl}/bin/python"}, timeout_s=10)
        await tb.call("bash", {"command": "", "restart": True}, timeout_s=10)
        assert victim.read_text() == "intact\n"
        r = await tb.call("bash", {"command": "python -c 'print(7)'"}, timeout_s=10)
        assert r.output == "7\n"
    finally:
        shutil.rmtree(outside, ignore_errors=True)


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
    # what was created is in the workspace (the literal "%2e%2e" names), nowhere else (the
    # daemon's venv, shown read-only where a checkout under /tmp has it, may hold the word:
    # litellm checks passwords against "pwned" lists)
    r = await tb.call("bash", {"command": "grep -rl --exclude-dir=site-packages pwned /workspace /tmp "
                               "2>/dev/null"}, timeout_s=30)
    assert all(line.startswith("/workspace/") for line in r.output.split()), r.output
    assert sb.workspace.is_dir()
