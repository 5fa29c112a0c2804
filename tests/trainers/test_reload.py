"""Weight sync from a directory: the loader's checks, and a reload through the daemon's
``POST /v1/backends/{id}/reload`` into a real ``rolloutd model-server`` (the real SmolLM2)."""

from __future__ import annotations

import httpx
import pytest
import torch
import trio
from safetensors import safe_open
from safetensors.torch import save_file

from rolloutd.daemon.api import create_app
from rolloutd.daemon.llm import _embedded
from rolloutd.daemon.llm.base import SamplingParams
from rolloutd.daemon.llm.chat import embedded_renderer
from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.llm.weights import WeightsError, load_weights
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services

from ..daemon.conftest import make_settings
from ..llm.conftest import open_model_server


class Tiny(torch.nn.Module):
    """Embeddings tied to the output head, as in SmolLM2."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def test_load_weights_checks_everything_before_copying(tmp_path):
    model = Tiny()
    full = {"emb.weight": torch.ones(5, 3), "norm.weight": torch.full((3,), 2.0), "norm.bias": torch.zeros(3)}
    save_file(full, tmp_path / "model.safetensors")
    info = load_weights(model, tmp_path)
    assert info["tensors"] == 3 and info["kept"] == 0  # head.weight is tied: counts as given
    assert torch.equal(model.head.weight, torch.ones(5, 3))

    part = tmp_path / "part"
    part.mkdir()
    save_file({"norm.weight": torch.full((3,), 7.0)}, part / "a.safetensors")
    with pytest.raises(WeightsError, match="missing"):
        load_weights(model, part)
    assert torch.equal(model.norm.weight, torch.full((3,), 2.0))  # unchanged
    assert load_weights(model, part, partial=True)["kept"] == 3
    assert torch.equal(model.norm.weight, torch.full((3,), 7.0))

    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({"norm.weight": torch.zeros(3), "nope": torch.zeros(1)}, bad / "a.safetensors")
    with pytest.raises(WeightsError, match="name no parameter"):
        load_weights(model, bad, partial=True)
    save_file({"norm.weight": torch.zeros(4)}, bad / "a.safetensors")
    with pytest.raises(WeightsError, match="shape"):
        load_weights(model, bad, partial=True)
    assert torch.equal(model.norm.weight, torch.full((3,), 7.0))
    with pytest.raises(WeightsError, match="no weights directory"):
        load_weights(model, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        load_weights(model, tmp_path / "empty")


def _final_norm(dest, scale: float) -> None:
    """A partial checkpoint: SmolLM2's final norm weight, times ``scale``."""
    src = _embedded.cache_dir() / "model" / "model.safetensors"
    with safe_open(str(src), framework="pt") as f:
        weight = f.get_tensor("model.norm.weight")
    dest.mkdir()
    save_file({"model.norm.weight": (weight * scale).contiguous()}, dest / "model.safetensors")


@pytest.mark.model
@pytest.mark.slow
async def test_reload_changes_outputs_and_version_stamps(nursery, tmp_path):
    pool = BackendPool(health_interval_s=3600)
    await nursery.start(pool.run)
    node = Node(make_settings(tmp_path), services=Services(pool=pool))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(node)), base_url="http://t")
    renderer = await trio.to_thread.run_sync(embedded_renderer)
    prompt = renderer.render_prompt([{"role": "user", "content": "Name three colours."}])
    greedy = SamplingParams(temperature=0.0)

    async def sample() -> tuple[list[int], tuple[object, object]]:
        c = await pool.complete(prompt, greedy, max_tokens=8, sticky_key="k")
        pool.forget("k")
        return c.token_ids, (c.extra["policy_version_start"], c.extra["policy_version_end"])

    async with open_model_server() as server, http:
        r = await http.post("/v1/backends", json={"kind": "model-server", "url": server.url, "id": "ms"})
        assert r.status_code == 201, r.text
        before, stamps = await sample()
        assert stamps == (0, 0)

        _final_norm(tmp_path / "flipped", -1.0)  # negated logits: the greedy tokens must change
        _final_norm(tmp_path / "original", 1.0)
        r = await http.post("/v1/backends/ms/reload",
                            json={"path": str(tmp_path / "flipped"), "version": 5, "partial": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["version"] == 5 and body["backend"]["tensors"] == 1 and body["backend"]["kept"] > 100
        assert pool.policy_version == 5 and not pool.paused
        after, stamps = await sample()
        assert after != before and stamps == (5, 5)
        async with httpx.AsyncClient(base_url=server.url) as direct:
            assert (await direct.get("/v1/models")).json()["data"][0]["weights_version"] == 5

        # A partial checkpoint sent as a full one is refused: nothing changes, the pool resumes.
        r = await http.post("/v1/backends/ms/reload", json={"path": str(tmp_path / "original")})
        assert r.status_code == 422 and r.json()["error"]["type"] == "reload_failed", r.text
        assert "missing" in r.json()["error"]["message"]
        assert pool.policy_version == 5 and not pool.paused
        assert (await sample())[0] == after
        r = await http.post("/v1/backends/ms/reload", json={"path": str(tmp_path / "nowhere")})
        assert r.status_code == 422 and "no weights directory" in r.json()["error"]["message"]
        assert (await http.post("/v1/backends/nope/reload", json={"path": "/x"})).status_code == 404

        # Back to the original weights (version defaults to current + 1): the original output.
        r = await http.post("/v1/backends/ms/reload",
                            json={"path": str(tmp_path / "original"), "partial": True})
        assert r.status_code == 200 and r.json()["version"] == 6
        restored, stamps = await sample()
        assert restored == before and stamps == (6, 6)
