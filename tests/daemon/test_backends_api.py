"""The /v1/backends routes and weight-sync hooks against a real BackendPool."""

from __future__ import annotations

import httpx
import pytest
import trio

from rolloutd.daemon.api import create_app
from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services

from .conftest import make_settings


@pytest.fixture
async def client_and_pool(nursery, tmp_path):
    pool = BackendPool(health_interval_s=0.2, probe_timeout_s=0.5)
    await nursery.start(pool.run)
    node = Node(make_settings(tmp_path), services=Services(pool=pool))
    await nursery.start(node.pipeline.run)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(node)), base_url="http://t")
    async with client:
        yield client, pool


async def test_register_list_pause_version_remove(client_and_pool):
    client, pool = client_and_pool
    r = await client.post("/v1/backends", json={"kind": "scripted", "replies": ["hi"], "id": "s1"})
    assert r.status_code == 201 and r.json() == {"id": "s1"}
    # A vLLM server that is not there (a closed loopback port) is registered but unhealthy.
    r = await client.post("/v1/backends", json={"kind": "vllm", "url": "http://127.0.0.1:9", "id": "gone"})
    assert r.status_code == 201
    await trio.sleep(1.0)
    listed = {b["id"]: b for b in (await client.get("/v1/backends")).json()["backends"]}
    assert listed["s1"]["healthy"] is True
    assert listed["gone"]["healthy"] is False

    assert (await client.post("/v1/backends/pause")).json() == {"paused": True}
    assert all(b["paused"] for b in (await client.get("/v1/backends")).json()["backends"])
    assert (await client.post("/v1/backends/resume")).json() == {"paused": False}
    r = await client.put("/v1/policy_version", json={"version": 7})
    assert r.status_code == 200 and pool.policy_version == 7
    assert (await client.get("/v1/backends")).json()["policy_version"] == 7

    assert (await client.delete("/v1/backends/gone")).status_code == 200
    assert [b["id"] for b in (await client.get("/v1/backends")).json()["backends"]] == ["s1"]


@pytest.mark.parametrize(
    "body",
    [
        {"kind": "nope"},
        {"kind": "vllm"},
        {"kind": "scripted", "replies": []},
        {"url": "http://127.0.0.1:1"},
    ],
)
async def test_bad_backend_specs_are_422(client_and_pool, body):
    client, _ = client_and_pool
    r = await client.post("/v1/backends", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] in {"invalid_backend", "invalid_request"}


async def test_unknown_backend_and_bad_version(client_and_pool):
    client, _ = client_and_pool
    assert (await client.delete("/v1/backends/nope")).status_code == 404
    assert (await client.put("/v1/policy_version", json={"version": -1})).status_code == 422
    assert (await client.put("/v1/policy_version", content=b"x")).status_code == 400


async def test_no_pool_is_503(asgi):
    client, _ = await asgi()
    async with client:
        r = await client.get("/v1/backends")
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable"
