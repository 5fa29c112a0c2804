"""The endpoint's HTTP layer and routes against hostile or sloppy clients, without a sandbox:
raw bytes over an in-memory stream into :func:`serve_connection`, the scripted backend (TEST
DOUBLE) behind the session. Every bad request gets a clear 4xx, never a 500 or a hang."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from rolloutd.daemon.agent import AgentLimits
from rolloutd.daemon.harness import Endpoint, Session
from rolloutd.daemon.harness._http import serve_connection
from rolloutd.daemon.llm.base import SamplingParams
from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.llm.scripted import ScriptedBackend
from rolloutd.daemon.trajectory import Trajectory
from tests.tasks.conftest import renderer

KEY = "sk-test"


@pytest.fixture
async def endpoint(nursery: trio.Nursery) -> Endpoint:
    pool = BackendPool(health_interval_s=60.0, request_timeout_s=60.0)
    await nursery.start(pool.run)
    rend = await trio.to_thread.run_sync(renderer)
    pool.add(ScriptedBackend(rend, ["The answer is 2."]), backend_id="scripted")
    session = Session(trajectory=Trajectory(id="r"), pool=pool, renderer=rend, params=SamplingParams(),
                      limits=AgentLimits(max_turns=3), sticky_key="r", group_key=None,
                      origin=trio.current_time())
    return Endpoint(session, key=KEY, model="policy")


async def exchange(endpoint: Endpoint, raw: bytes, *, max_body: int = 1 << 20) -> tuple[int, Any]:
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: serve_connection(server, endpoint, max_body=max_body))
        await client.send_all(raw)
        data = b""
        with trio.fail_after(10):
            while b"\r\n\r\n" not in data:
                data += await client.receive_some(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                body += await client.receive_some(65536)
        await client.aclose()
    status = int(head.split(b" ")[1])
    return status, json.loads(body) if body else None


def post(path: str, body: bytes, *, key: str = KEY, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "1+1?"}]}).encode()


async def test_a_good_call_and_keep_alive(endpoint: Endpoint) -> None:
    status, body = await exchange(endpoint, post("/v1/chat/completions", CHAT))
    assert status == 200 and body["choices"][0]["message"]["content"] == "The answer is 2."
    assert body["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize(("raw", "status", "needle"), [
    (post("/v1/chat/completions", CHAT, key="sk-other"), 401, "invalid API key"),
    (post("/v1/chat/completions", b"{not json"), 400, "not JSON"),
    (post("/v1/chat/completions", b"[1, 2]"), 400, "JSON object"),
    (post("/v1/chat/completions", b'{"messages": []}'), 400, "non-empty"),
    (post("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}'), 400, "role"),
    (post("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode()), 400, "only text"),
    (post("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                              "n": 2}).encode()), 400, "n must be 1"),
    (post("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                              "stop": ["\n"]}).encode()), 400, "stop strings"),
    (post("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                              "max_tokens": -3}).encode()), 400, "max_tokens"),
    (post("/v1/completions", b'{"prompt": [1, -2]}'), 400, "token ids"),
    (post("/v1/messages", b'{"messages": [{"role": "user", "content": "x"}]}'), 400, "max_tokens"),
    (post("/v1/nothing", CHAT), 404, "no route"),
    (b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\n\r\n", 405, "POST"),
    (b"THIS IS NOT HTTP\r\n\r\n", 400, "malformed"),
])
async def test_bad_requests_get_a_clear_4xx(endpoint: Endpoint, raw: bytes, status: int, needle: str) -> None:
    got, body = await exchange(endpoint, raw)
    assert got == status, body
    error = body["error"]
    assert needle in error["message"], error


async def test_anthropic_errors_have_the_anthropic_shape(endpoint: Endpoint) -> None:
    status, body = await exchange(endpoint, post("/v1/messages", b'{"messages": []}'))
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


async def test_a_body_over_the_limit_is_413(endpoint: Endpoint) -> None:
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    status, body = await exchange(endpoint, post("/v1/chat/completions", big), max_body=1000)
    assert status == 413 and "over 1000 bytes" in body["error"]["message"]


async def test_calls_beyond_max_turns_are_refused(endpoint: Endpoint) -> None:
    for _ in range(3):
        status, _ = await exchange(endpoint, post("/v1/chat/completions", CHAT))
        assert status == 200
    status, body = await exchange(endpoint, post("/v1/chat/completions", CHAT))
    assert status == 400 and body["error"]["code"] == "rollout_budget_exhausted"
    assert endpoint.session.info.refused_calls == 1 and endpoint.session.info.calls == 3


async def test_health_and_models(endpoint: Endpoint) -> None:
    status, body = await exchange(endpoint, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, body) == (200, {"status": "ok"})
    status, body = await exchange(endpoint, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nx-api-key: sk-test\r\n\r\n")
    assert status == 200 and body["data"][0]["id"] == "policy"
