"""Fixtures for task-handler tests: a real Node pipeline with a real sandbox supervisor
(bwrap when available) and the scripted LLM backend (a labelled TEST DOUBLE), or no LLM."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio

from rolloutd.daemon.config import Settings
from rolloutd.daemon.jobs import Job
from rolloutd.daemon.llm.chat import ChatRenderer, embedded_renderer
from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.llm.scripted import ScriptedBackend
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services
from rolloutd.daemon.service import RolloutRequest
from rolloutd.daemon.trajectory import Trajectory
from rolloutd.sandbox import SandboxSupervisor

BACKEND = "bwrap" if shutil.which("bwrap") else "local"

_RENDERER: ChatRenderer | None = None


def renderer() -> ChatRenderer:
    global _RENDERER
    if _RENDERER is None:
        _RENDERER = embedded_renderer()
    return _RENDERER


def tool_call(name: str, **arguments: Any) -> str:
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


class Harness:
    """A Node whose pipeline runs with real sandboxes and a scripted policy."""

    def __init__(self, node: Node, supervisor: SandboxSupervisor, pool: BackendPool) -> None:
        self.node = node
        self.supervisor = supervisor
        self.pool = pool
        self._backend_id: str | None = None

    async def script(self, replies: Sequence[str] | Callable[[int, list[int]], str]) -> None:
        """Replace the policy with a scripted backend (TEST DOUBLE) replaying ``replies``."""
        if self._backend_id is not None:
            await self.pool.remove(self._backend_id)
        self._backend_id = self.pool.add(ScriptedBackend(renderer(), replies), backend_id="scripted")

    async def run(self, task: dict[str, Any], *, timeout_s: float = 120.0, **limits: Any) -> Trajectory:
        req = RolloutRequest(task=task, timeout_s=timeout_s,
                             limits={"max_turns": 6, "tool_timeout_s": 30.0, **limits})
        sub = self.node.submit(req)
        job: Job = sub.jobs[0]
        with trio.fail_after(timeout_s + 30):
            await job.done.wait()
        return job.trajectory


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory (sandbox socket paths must fit in 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def harness(nursery: trio.Nursery, short_tmp: Path) -> Harness:
    settings = Settings(state_dir=short_tmp / "state", cache_dir=short_tmp / "cache", port=0,
                        n_init=2, n_run=2, n_eval=2, queue_size=16, sandbox_backend=BACKEND)
    supervisor = SandboxSupervisor(default_backend=BACKEND, state_dir=short_tmp / "sb",
                                   boot_id="tasks-test")
    await nursery.start(supervisor.run)
    pool = BackendPool(health_interval_s=60.0, request_timeout_s=60.0)
    await nursery.start(pool.run)
    rend = await trio.to_thread.run_sync(renderer)

    async def get_renderer() -> ChatRenderer:
        return rend

    node = Node(settings, services=Services(supervisor=supervisor, pool=pool, renderer=get_renderer))
    await nursery.start(node.pipeline.run)
    node.ready = True
    return Harness(node, supervisor, pool)


@pytest.fixture(scope="session")
def swe_tasks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from rolloutd.daemon.tasks.swe_examples import make_swe_repos

    return make_swe_repos(tmp_path_factory.mktemp("swe-repos"))


@pytest.fixture(scope="session")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("task-images")


@pytest.fixture
async def image_harness(nursery: trio.Nursery, short_tmp: Path, store_dir: Path) -> Harness:
    settings = Settings(state_dir=short_tmp / "state", cache_dir=short_tmp / "cache", port=0,
                        n_init=2, n_run=2, n_eval=2, queue_size=16, image_cache_dir=store_dir)
    pool = BackendPool(health_interval_s=60.0, request_timeout_s=60.0)
    await nursery.start(pool.run)
    rend = await trio.to_thread.run_sync(renderer)

    async def get_renderer():
        return rend

    services = Services(pool=pool, renderer=get_renderer)
    node = Node(settings, services=services)
    supervisor = SandboxSupervisor(default_backend="bwrap", state_dir=short_tmp / "sb",
                                   boot_id="image-tasks", images=node.images.store)
    await nursery.start(supervisor.run)
    services.supervisor = supervisor
    await nursery.start(node.images.run)
    await nursery.start(node.pipeline.run)
    node.ready = True
    return Harness(node, supervisor, pool)
