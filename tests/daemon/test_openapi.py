"""The OpenAPI document matches the API's behaviour, and the request models are the ones
the daemon uses (one definition each)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from rolloutd.daemon.agent import NUDGE
from rolloutd.daemon.api import create_app
from rolloutd.daemon.llm.chat import ChatRenderer, embedded_renderer
from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services

from .conftest import make_settings


@pytest.fixture
async def agent_client(nursery: trio.Nursery, tmp_path: Path):
    """The app in-process with a real BackendPool and the embedded renderer: agent tasks run."""
    pool = BackendPool(health_interval_s=60.0, request_timeout_s=60.0)
    await nursery.start(pool.run)
    rend = await trio.to_thread.run_sync(embedded_renderer)

    async def get_renderer() -> ChatRenderer:
        return rend

    node = Node(make_settings(tmp_path), services=Services(pool=pool, renderer=get_renderer))
    await nursery.start(node.pipeline.run)
    node.ready = True
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(node)), base_url="http://t")
    async with client:
        yield client


async def test_require_tool_call_is_set_over_http(agent_client):
    client = agent_client
    # TEST DOUBLE policy: it never calls a tool.
    r = await client.post("/v1/backends", json={"kind": "scripted", "replies": ["42"], "id": "s"})
    assert r.status_code == 201, r.text
    task = {"kind": "calc", "expression": "6 * 7", "examples": 0}

    plain = await client.post("/v1/rollouts?wait=true", json={"task": task, "limits": {"max_turns": 3}})
    assert plain.status_code == 200, plain.text
    tr = plain.json()["rollouts"][0]
    assert tr["finish_reason"] == "stop" and len(tr["turns"]) == 1

    nudged = await client.post(
        "/v1/rollouts?wait=true",
        json={"task": task, "limits": {"max_turns": 3, "require_tool_call": True}},
    )
    assert nudged.status_code == 200, nudged.text
    tr = nudged.json()["rollouts"][0]
    assert tr["finish_reason"] == "max_turns" and len(tr["turns"]) == 3
    assert [m["content"] for m in tr["messages"] if m["role"] == "user"][-2:] == [NUDGE, NUDGE]


async def test_every_agent_limit_is_in_the_api_schema(agent_client):
    from rolloutd.daemon.agent import AgentLimits

    doc = (await agent_client.get("/openapi.json")).json()
    limits = doc["components"]["schemas"]["AgentLimits"]
    assert set(limits["properties"]) == set(AgentLimits.model_fields)
    assert limits["additionalProperties"] is False


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
async def test_non_finite_numbers_are_422_at_submit(asgi, number):
    """Python's json reads NaN/Infinity literals (and 1e400 as inf): refused at the door, not
    a reward of NaN or a failure when the trajectory is written (issue 15, point 12)."""
    client, node = await asgi()
    async with client:
        for body in (f'{{"task": {{"kind": "sleep", "reward": {number}}}}}',
                     f'{{"task": {{"kind": "sleep"}}, "timeout_s": {number}}}'):
            r = await client.post("/v1/rollouts", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 422, r.text
            assert r.json()["error"]["type"] == "invalid_request" and "finite" in r.json()["error"]["message"]
    assert node.service.submitted_total == 0


async def test_json_types_are_exact(asgi):
    """A string is never read as a number or a boolean (pydantic's lax mode would); an
    integral number is an integer, as in JSON Schema."""
    client, node = await asgi()
    async with client:
        for body in ({"task": {"kind": "sleep"}, "n": "2"}, {"task": {"kind": "sleep"}, "wait": "true"},
                     {"task": {"kind": "sleep"}, "priority": True}, {"task": {"kind": "sleep"}, "n": 1.5}):
            r = await client.post("/v1/rollouts", json=body)
            assert r.status_code == 422, (body, r.text)
        r = await client.post("/v1/rollouts?wait=maybe", json={"task": {"kind": "sleep"}, "wait": True})
        assert r.status_code == 400 and "wait" in r.json()["error"]["message"], r.text
        r = await client.put("/v1/policy_version", json={"version": False})
        assert r.status_code in (422, 503), r.text
        r = await client.post("/v1/rollouts", json={"task": {"kind": "sleep"}, "n": 2.0})
        assert r.status_code == 202 and len(r.json()["ids"]) == 2


async def test_document_lists_every_answer(asgi):
    client, _ = await asgi(token="secret")
    async with client:
        r = await client.get("/openapi.json", headers={"Authorization": "Bearer secret"})
    doc = r.json()
    error = doc["paths"]["/v1/status"]["get"]["responses"]["401"]["content"]["application/json"]["schema"]
    assert error["title"] == "ErrorResponse" and error["required"] == ["error"]
    assert error["properties"]["error"] == {"$ref": "#/components/schemas/ErrorBody"}
    assert doc["components"]["schemas"]["ErrorBody"]["required"] == ["type", "message"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            responses = op["responses"]
            assert any(code.startswith("2") for code in responses), (method, path)
            for code, answer in responses.items():
                if not code.startswith("2"):
                    assert answer["content"]["application/json"]["schema"] == error, (method, path, code)
            if path == "/healthz":
                assert op["security"] == [] and "401" not in responses
            else:
                assert "security" not in op and "401" in responses, (method, path)
            if "requestBody" in op:
                assert op["requestBody"]["required"] is True
                assert {"400", "413", "422"} <= set(responses), (method, path)
    submit = doc["paths"]["/v1/rollouts"]["post"]["responses"]
    assert {"200", "202", "409", "429", "503"} <= set(submit)
    assert doc["security"] == [{"bearer": []}]


async def test_task_schema_is_one_of_the_kinds(asgi):
    client, node = await asgi()
    async with client:
        doc = (await client.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    body = "requestBody", "content", "application/json", "schema"
    request, batch = doc["paths"]["/v1/rollouts"]["post"], doc["paths"]["/v1/batches"]["post"]
    for key in body:
        request, batch = request[key], batch[key]
    assert request["properties"]["task"]["$ref"] == "#/components/schemas/Task"
    assert request["additionalProperties"] is False
    assert request["properties"]["n"]["maximum"] == min(node.settings.max_samples_per_request, node.settings.queue_size)
    assert batch["properties"]["prompts"]["items"] == {"$ref": "#/components/schemas/Task"}
    kinds = {schemas[b["$ref"].rsplit("/", 1)[1]]["properties"]["kind"]["const"] for b in schemas["Task"]["oneOf"]}
    assert kinds == set(node.service.registry.kinds)
    limits = schemas["AgentLimits"]
    assert limits["additionalProperties"] is False and "require_tool_call" in limits["properties"]


@pytest.mark.parametrize(("task", "field"), [
    ({"kind": "math", "question": "q", "answer": "1", "problem": 5}, "problem"),
    ({"kind": "math", "question": None, "problem": "q", "answer": "1"}, "question"),
    ({"kind": "sleep", "run_s": "1"}, "run_s"),
    ({"kind": "code", "prompt": "p", "pytest": "def test(): pass", "files": {"../x": ""}}, "files"),
    ({"kind": "calc", "expression": "1 + 2", "examples": True}, "examples"),
])
async def test_what_the_schema_refuses_is_422(asgi, task, field):
    """The task models are checked at submit, so the schema never admits less than the
    daemon does (schemathesis's negative-data check holds the other direction)."""
    client, node = await asgi()
    async with client:
        r = await client.post("/v1/rollouts", json={"task": task})
    assert r.status_code == 422 and field in r.json()["error"]["message"], r.text
    assert node.service.submitted_total == 0


async def test_reserved_path_segments_are_no_ids(asgi):
    client, _ = await asgi()
    async with client:
        r = await client.delete("/v1/rollouts/stream")
        assert r.status_code == 405 and r.headers["Allow"] and r.json()["error"]["type"] == "method_not_allowed"
        r = await client.options("/v1/rollouts/stream")
        assert "DELETE" not in r.headers["Allow"]


async def test_backend_spec_is_the_factory_model(agent_client):
    """POST /v1/backends is documented and parsed with rolloutd.daemon.llm's spec models (one per
    kind, unknown keys refused), and an id that is a fixed path segment is refused."""
    client = agent_client
    doc = (await client.get("/openapi.json")).json()
    body = doc["paths"]["/v1/backends"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    kinds = [doc["components"]["schemas"][b["$ref"].rsplit("/", 1)[1]] for b in body["oneOf"]]
    assert {k["properties"]["kind"]["const"] for k in kinds} == {"vllm", "model-server", "transformers", "scripted"}
    assert all(k["additionalProperties"] is False and "id" in k["properties"] for k in kinds)
    for spec in ({"kind": "scripted", "replies": ["x"], "id": "pause"},
                 {"kind": "scripted", "replies": ["x"], "bogus": 1}):
        r = await client.post("/v1/backends", json=spec)
        assert r.status_code == 422, r.text
    assert (await client.get("/v1/backends")).json()["backends"] == []
