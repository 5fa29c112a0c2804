from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from rolloutd.daemon.api import create_app
from rolloutd.daemon.config import Settings
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "state_dir": tmp_path / "state",
        "cache_dir": tmp_path / "cache",
        "port": 0,
        "n_init": 2,
        "n_run": 2,
        "n_eval": 2,
        "queue_size": 64,
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
def settings_factory(tmp_path: Path):
    return lambda **kw: make_settings(tmp_path, **kw)


@pytest.fixture
async def start_node(nursery: trio.Nursery, tmp_path: Path):
    """Start a Node's pipeline (no HTTP server, no sandboxes, no LLM: sleep tasks only)."""

    async def start(**overrides: Any) -> Node:
        node = Node(make_settings(tmp_path, **overrides), services=Services())
        await nursery.start(node.pipeline.run)
        node.ready = True
        return node

    return start


@pytest.fixture
async def asgi(start_node):
    """An httpx client talking to the app in-process (ASGI), plus its node."""

    async def make(**overrides: Any) -> tuple[httpx.AsyncClient, Node]:
        node = await start_node(**overrides)
        app = create_app(node)
        headers = {"Authorization": f"Bearer {node.token}"} if node.token else {}
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test", headers=headers
        )
        return client, node

    return make


def sleep_task(**kw: Any) -> dict[str, Any]:
    return {"kind": "sleep", **kw}
