"""Suite-wide fixtures: every test must leave no child processes behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rolloutd.sandbox._launcher import NAME as LAUNCHER
from tests._images import ImageToolMissing, TestImages, build_test_images


def descendants(pid: int | None = None) -> list[tuple[int, str]]:
    """(pid, cmdline) of every live descendant of ``pid`` (default: this process)."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    cmd: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            state = stat.rsplit(")", 1)[1].split()[0]
            if state == "Z":
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append((child, cmd.get(child, "")))
            todo.append(child)
    return out


#: A parked spare launcher (sandbox/_launcher.py) of a daemon that outlives the test (a
#: module-scoped fixture) is that daemon's, not a leak; the daemon's shutdown removes it.
SPARE_LAUNCHER = f" {LAUNCHER} "


@pytest.fixture(autouse=True)
def no_leaked_processes() -> object:
    """Fail a test that leaves a child process running (after a short grace period)."""
    before = {pid for pid, _ in descendants()}
    yield
    deadline = time.monotonic() + 5.0
    while True:
        left = [(p, c) for p, c in descendants() if p not in before and SPARE_LAUNCHER not in c]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"test leaked processes: {left}"


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that use the real test images (``test_images``) are slow (built once, minutes)."""
    for item in items:
        if "test_images" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def test_images() -> TestImages:
    """Real images built on this machine once (tests/_images.py; cached under
    ~/.cache/rolloutd-test-images or $ROLLOUTD_TEST_IMAGES). Never skipped in CI: a missing
    tool fails there (.ci/run installs them); elsewhere the test is skipped with the reason."""
    try:
        return build_test_images()
    except ImageToolMissing as e:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must build the test images: {e}")
        pytest.skip(str(e))
