"""rolloutd.daemon.llm.weights: the Reloadable protocol, BackendPool.reload over test doubles (no model),
the one ReloadRequest, and no import cycle inside rolloutd.daemon.llm."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

import rolloutd.daemon.llm  # noqa: F401
from rolloutd import daemon
from rolloutd.daemon.llm.base import BackendRejected, BackendUnavailable, LLMError
from rolloutd.daemon.llm.pool import BackendPool, make_backend
from rolloutd.daemon.llm.scripted import ScriptedBackend
from rolloutd.daemon.llm.vllm import ModelServerBackend, VLLMBackend
from rolloutd.daemon.llm.weights import (
    Reloadable,
    ReloadRequest,
    ReloadUnsupported,
    WeightsError,
    reload_backend,
)


class ReloadableDouble(ScriptedBackend):
    """TEST DOUBLE: a scripted backend that records reloads (or fails them)."""

    def __init__(self, renderer: Any, *, fail: Exception | None = None) -> None:
        super().__init__(renderer, ["ok"])
        self.calls: list[tuple[str, bool, int | None, bool]] = []
        self.fail = fail
        self.pool: BackendPool | None = None

    async def reload_weights(self, path: str, *, partial: bool = False, version: int | None = None) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        self.calls.append((path, partial, version, bool(self.pool and self.pool.paused)))
        if self.fail is not None:
            raise self.fail
        return {"tensors": 1}


def test_which_backends_are_reloadable(renderer):
    ms = make_backend({"kind": "model-server", "url": "http://h:2/", "name": "n"})
    assert isinstance(ms, ModelServerBackend) and isinstance(ms, Reloadable)
    assert (ms.kind, ms.name, ms.url) == ("model-server", "n", "http://h:2")
    assert ModelServerBackend("http://h:2").name == "model-server:http://h:2"
    vllm = make_backend({"kind": "vllm", "url": "http://h:1"})
    assert type(vllm) is VLLMBackend and isinstance(vllm, Reloadable)
    assert isinstance(make_backend({"kind": "transformers"}), Reloadable)  # built, not loaded
    assert not isinstance(ScriptedBackend(renderer, ["x"]), Reloadable)
    assert issubclass(ReloadUnsupported, WeightsError) and issubclass(WeightsError, BackendRejected)
    assert issubclass(WeightsError, LLMError)


async def test_reload_in_the_pool(renderer):
    pool = BackendPool()
    double = ReloadableDouble(renderer)
    double.pool = pool
    pool.add(double, backend_id="d")
    out = await pool.reload("d", ReloadRequest(path="/w", partial=True))
    assert double.calls == [("/w", True, 1, True)]  # loaded while paused, told the new version
    assert out["id"] == "d" and out["version"] == 1 and out["path"] == "/w" and out["partial"] is True
    assert out["backend"] == {"tensors": 1} and set(out) == {"id", "version", "path", "partial", "drain_s",
                                                             "total_s", "backend"}
    assert pool.policy_version == 1 and not pool.paused
    assert (await pool.reload("d", ReloadRequest(path="/w", version=7)))["version"] == 7
    with pytest.raises(KeyError):
        await pool.reload("nope", ReloadRequest(path="/w"))

    double.fail = WeightsError("bad")
    with pytest.raises(WeightsError, match="bad"):
        await pool.reload("d", ReloadRequest(path="/w"))
    assert pool.policy_version == 7 and not pool.paused  # resumed on the old version

    await pool.pause()  # a pool paused by the caller stays paused
    double.fail = None
    await pool.reload("d", ReloadRequest(path="/w"))
    assert pool.paused and pool.policy_version == 8
    pool.resume()


async def test_vllm_without_its_development_routes_is_refused_and_the_pool_resumes():
    """A vLLM started without VLLM_SERVER_DEV_MODE answers 404 on /collective_rpc (TEST DOUBLE:
    an httpx.MockTransport in place of that server; the real reload is in test_vllm_engine.py)."""
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(404, json={"detail": "Not Found"})

    pool = BackendPool()
    pool.add(VLLMBackend("http://127.0.0.1:1", "m", transport=httpx.MockTransport(answer)), backend_id="v")
    with pytest.raises(ReloadUnsupported) as info:
        await pool.reload("v", ReloadRequest(path="/w"))
    assert seen == ["/collective_rpc"]
    assert str(info.value) == (
        "backend vllm:http://127.0.0.1:1 (vllm) cannot load weights from a directory through rolloutd "
        "(start vLLM with VLLM_SERVER_DEV_MODE=1 for /collective_rpc): "
        "sync its weights with the trainer's own transport between POST /v1/backends/pause and "
        "/resume, then PUT /v1/policy_version"
    )
    assert pool.policy_version == 0 and not pool.paused
    await pool.aclose()


async def test_vllm_reload_unreachable_is_unavailable():
    pool = BackendPool()
    pool.add(VLLMBackend("http://127.0.0.1:1", "m"), backend_id="v")
    with pytest.raises(BackendUnavailable):
        await pool.reload("v", ReloadRequest(path="/w"))
    assert pool.policy_version == 0 and not pool.paused
    await pool.aclose()


async def test_model_server_reload_unreachable():
    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = ModelServerBackend(f"http://127.0.0.1:{port}")
    with pytest.raises(BackendUnavailable, match="reload: ConnectError"):
        await reload_backend(b, "/w", version=3)
    await b.aclose()


def test_one_reload_request():
    from rolloutd.daemon import api
    from rolloutd.daemon.llm import model_server

    assert api.ReloadRequest is model_server.ReloadRequest is daemon.llm.ReloadRequest is ReloadRequest
    with pytest.raises(ValueError):
        ReloadRequest.model_validate({"path": ""})
    with pytest.raises(ValueError):
        ReloadRequest.model_validate({"path": "/w", "version": -1})
    with pytest.raises(ValueError):
        ReloadRequest.model_validate({"path": "/w", "extra": 1})
    assert list(ReloadRequest.model_json_schema()["properties"]) == ["path", "version", "partial"]
