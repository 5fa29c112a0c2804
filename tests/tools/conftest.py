"""Fixtures for the tools tests: REAL sandboxes (bwrap, and local for the core cases), real
ptys and a real IPython kernel. Each sandbox fixture also checks that no fd was leaked."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rolloutd.sandbox import Sandbox, SandboxSpec, open_backend
from rolloutd.tools import Toolbox, open_toolbox

ALL_TOOLS = ["bash", "ipython", "editor", "finish"]


def _fds() -> set[int]:
    return {int(f) for f in os.listdir("/proc/self/fd")}


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # short: Unix socket paths (helper, kernel) must stay under 108 bytes
    path = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _open(state_dir: Path, backend: str) -> AsyncIterator[Sandbox]:
    be = open_backend(backend, state_dir=state_dir, boot_id="toolstest")
    before = _fds()
    async with be.open(SandboxSpec(lifetime_s=300)) as sb:
        yield sb
    leaked = _fds() - before
    # a closed fd number may be reused by trio internals only if it was ours to begin with
    assert not leaked, f"leaked fds: {[os.readlink(f'/proc/self/fd/{f}') for f in leaked if os.path.exists(f'/proc/self/fd/{f}')]}"


@pytest.fixture(params=["bwrap", "local"])
async def sandbox(request: pytest.FixtureRequest, state_dir: Path) -> AsyncIterator[Sandbox]:
    """A real sandbox of each backend (core behaviour must not depend on the backend)."""
    async for sb in _open(state_dir, request.param):
        yield sb


@pytest.fixture
async def bwrap_sandbox(state_dir: Path) -> AsyncIterator[Sandbox]:
    async for sb in _open(state_dir, "bwrap"):
        yield sb


@pytest.fixture
async def toolbox(sandbox: Sandbox) -> AsyncIterator[Toolbox]:
    async with open_toolbox(sandbox, ALL_TOOLS) as tb:
        yield tb


@pytest.fixture
async def bwrap_toolbox(bwrap_sandbox: Sandbox) -> AsyncIterator[Toolbox]:
    async with open_toolbox(bwrap_sandbox, ALL_TOOLS, interrupt_grace_s=0.5) as tb:
        yield tb
