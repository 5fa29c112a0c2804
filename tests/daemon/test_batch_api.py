"""/v1/batches: in-process through ASGI, then over a real hypercorn socket with the clients,
the CLI, client disconnects, and the real sandbox supervisor (bwrap)."""

from __future__ import annotations

import json
import shutil
from contextlib import aclosing
from typing import Any

import httpx
import pytest
import trio

from rolloutd.daemon import cli
from rolloutd.daemon.api import BatchStatus, KeptGroup, create_app
from rolloutd.daemon.batch import BatchRequest
from rolloutd.daemon.client import AsyncClient, Client, RolloutdError
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services
from rolloutd.daemon.tasks.registry import TaskRegistry

from .conftest import make_settings
from .test_sampling import SandboxedSleep, equal, mixed


def body(prompts: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {"prompts": prompts, "group_size": 2, "keep": 2, **kw}


@pytest.fixture
async def asgi_batches(nursery, tmp_path):
    """An in-process client for the app of a node whose pipeline and sampler run."""
    node = Node(make_settings(tmp_path, n_init=4, n_run=4, n_eval=4), services=Services())
    await nursery.start(node.pipeline.run)
    await nursery.start(node.sampler.run)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(node)), base_url="http://t")
    async with client:
        yield client, node


async def test_create_stream_status_cancel(asgi_batches, autojump_clock):
    client, node = asgi_batches
    prompts = [equal(0), mixed(), equal(1), mixed(run_s=[1, 3]), mixed(run_s=100)]
    r = await client.post("/v1/batches", json=body(prompts, max_in_flight_groups=5))
    assert r.status_code == 202, r.text
    created = BatchStatus.model_validate(r.json())
    assert created.state == "running" and r.headers["Location"] == f"/v1/batches/{created.id}"
    assert created.max_in_flight_groups == 5 and created.max_gen_groups == 5

    r = await client.get(f"/v1/batches/{created.id}/groups")  # ASGI buffers: returns at the end
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    groups = [KeptGroup.model_validate_json(line) for line in r.text.splitlines()]
    assert [g.prompt_index for g in groups] == [1, 3]
    assert all(len(g.rollouts) == 2 and g.rewards == [0.0, 1.0] for g in groups)
    assert groups[0].rollouts[0].group_id == groups[0].group_id
    assert groups[0].task["kind"] == "sleep"

    st = BatchStatus.model_validate((await client.get(f"/v1/batches/{created.id}")).json())
    assert (st.state, st.stop_reason, st.kept, st.filtered, st.cancelled) == ("completed", "kept", 2, 2, 1)
    assert st.filtered_reasons == {"all_equal": 2}
    assert {g.reason for g in st.filtered_groups} == {"all_equal"}

    r = await client.get(f"/v1/batches/{created.id}/groups", params={"start": 1})
    assert [json.loads(line)["prompt_index"] for line in r.text.splitlines()] == [3]
    r = await client.delete(f"/v1/batches/{created.id}")
    assert r.status_code == 200 and r.json()["state"] == "completed"  # too late to cancel

    other = (await client.post("/v1/batches", json=body([mixed(run_s=100)] * 3))).json()
    await trio.sleep(1)
    r = await client.delete(f"/v1/batches/{other['id']}")
    assert r.status_code in (200, 202) and r.json()["stop_reason"] == "cancelled by request"
    await node.sampler.get(other["id"]).done.wait()
    st = (await client.get(f"/v1/batches/{other['id']}")).json()
    assert (st["state"], st["cancelled"], st["in_flight"]) == ("cancelled", 2, 0)


@pytest.mark.parametrize(
    ("payload", "status", "etype"),
    [
        (body([]), 422, "invalid_request"),
        (body([mixed()], group_size=0), 422, "invalid_request"),
        (body([mixed()], keep=0), 422, "invalid_request"),
        (body([mixed()], bogus=1), 422, "invalid_request"),
        (body([mixed()], filter={"rule": "median"}), 422, "invalid_request"),
        (body([mixed(), {"kind": "chess"}]), 422, "invalid_task"),
        (body([mixed(run_s=-1)]), 422, "invalid_task"),
        (body([mixed()], group_size=5000), 422, "invalid_task"),
        (body([mixed()], timeout_s=1e12), 422, "invalid_task"),
    ],
)
async def test_bad_batches_are_clear_4xx(asgi_batches, payload, status, etype):
    client, node = asgi_batches
    r = await client.post("/v1/batches", json=payload)
    assert r.status_code == status, r.text
    assert r.json()["error"]["type"] == etype
    assert node.sampler.live == 0 and node.service.submitted_total == 0


async def test_unknown_batch_and_bad_start(asgi_batches, autojump_clock):
    client, _ = asgi_batches
    for method, path in [("GET", "/v1/batches/b-x"), ("GET", "/v1/batches/b-x/groups"),
                         ("DELETE", "/v1/batches/b-x")]:
        r = await client.request(method, path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
    bid = (await client.post("/v1/batches", json=body([mixed()], keep=1))).json()["id"]
    r = await client.get(f"/v1/batches/{bid}/groups", params={"start": "-1"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "bad_request"


async def test_openapi_documents_batches(asgi_batches):
    client, _ = asgi_batches
    spec = (await client.get("/openapi.json")).json()
    for path in ("/v1/batches", "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/groups"):
        assert path in spec["paths"]
    text = json.dumps(spec)
    assert "BatchRequest" in text and "BatchStatus" in text


# ---- over a real socket (real time: keep the sleeps short) --------------------------------


@pytest.fixture
async def served(nursery, tmp_path):
    node = Node(make_settings(tmp_path, token="tok", n_init=8, n_run=8, n_eval=8), services=Services())
    await nursery.start(node.run)
    yield node
    node.request_stop()


async def wait_state(node: Node, batch_id: str, timeout_s: float = 5.0) -> dict[str, Any]:
    batch = node.sampler.get(batch_id)
    with trio.fail_after(timeout_s):
        await batch.done.wait()
    return batch.status()


async def test_async_client_sample_batch(served):
    prompts = [equal(run_s=0.02), mixed(run_s=0.02)] * 4
    async with AsyncClient(served.urls[0], token="tok") as c:
        groups = [g async for g in c.sample_batch(prompts, group_size=3, keep=3, max_in_flight_groups=4)]
        assert len(groups) == 3
        assert all(len(g.rollouts) == 3 and len(set(g.rewards)) > 1 for g in groups)
        assert all(g.prompt_index % 2 == 1 for g in groups)
        assert all(g.task == prompts[g.prompt_index] for g in groups)
        batch_id = groups[0].group_id.rsplit(".", 1)[0]
        st = await c.batch_status(batch_id)
        assert st["state"] == "completed" and st["kept"] == 3
        # Ended with no stream open: the daemon released the tasks; the client's prompts fill them in.
        assert [g.task async for g in c.batch_groups(batch_id)] == [None] * 3
        replay = [g async for g in c.batch_groups(batch_id, prompts=prompts)]
        assert [g.task for g in replay] == [g.task for g in groups]
        with pytest.raises(RolloutdError) as err:
            await c.create_batch([{"kind": "nope"}], group_size=2, keep=1)
        assert err.value.status == 422


async def test_async_client_stream_carries_over(served):
    """Two batches of one stream: the first's slow group is kept by the second, which says so
    (``carried_from``) and keeps its task; a second batch of a running stream is a 409."""
    first = [mixed(run_s=0.02), mixed(run_s=[0.02, 1.5], tag="slow"), mixed(run_s=0.02)]
    async with AsyncClient(served.urls[0], token="tok") as c:
        a = await c.create_batch(first, group_size=2, keep=2, max_in_flight_groups=3, stream="r1")
        with pytest.raises(RolloutdError) as err:
            await c.create_batch(first, group_size=2, keep=1, stream="r1")
        assert (err.value.status, err.value.type) == (409, "stream_busy")
        kept_a = [g async for g in c.batch_groups(a["id"], prompts=first)]
        assert sorted(g.prompt_index for g in kept_a) == [0, 2]
        st = await c.batch_status(a["id"])
        assert (st["carried_out"], st["cancelled"]) == (1, 0)
        second = [mixed(run_s=0.02, tag="b")]
        groups = [g async for g in c.sample_batch(second, group_size=2, keep=2, stream="r1",
                                                  carry_over=False)]
        carried = [g for g in groups if g.carried_from is not None]
        assert [(g.carried_from, g.prompt_index, g.task["tag"]) for g in carried] == [(a["id"], 1, "slow")]
        b_id = groups[0].group_id.rsplit(".", 1)[0] if groups[0].carried_from is None else None
        st_a = await c.batch_status(a["id"])
        assert st_a["carried_to"] is not None and st_a["carried_to"] != a["id"]
        st_b = await c.batch_status(st_a["carried_to"])
        assert (st_b["carried_in"], st_b["kept"], st_b["stream"]) == (1, 2, "r1")
        assert b_id in (None, st_b["id"])
        assert st_b["lengths"]["kept"]["groups"] == 2


@pytest.mark.parametrize("cancel_on_disconnect", [True, False])
async def test_client_disconnect(served, cancel_on_disconnect):
    """Default: a batch is cancelled when the last client streaming it disconnects early.
    With cancel_on_disconnect=false it runs on, and a client can resume with ?start=N."""
    prompts = [mixed(run_s=0.05), mixed(run_s=[0.05, 1.0]), mixed(run_s=1.0), mixed(run_s=1.0)]
    options: dict[str, Any] = {"max_in_flight_groups": 4}
    if not cancel_on_disconnect:
        options["cancel_on_disconnect"] = False
    async with AsyncClient(served.urls[0], token="tok") as c:
        created = await c.create_batch(prompts, group_size=2, keep=3, **options)
        assert created["cancel_on_disconnect"] is cancel_on_disconnect
        async with aclosing(c.batch_groups(created["id"])) as groups:
            async for first in groups:
                break  # leave after the first kept group: the stream is closed
        assert first.prompt_index == 0
        st = await wait_state(served, created["id"])
        if cancel_on_disconnect:
            assert (st["state"], st["kept"], st["cancelled"]) == ("cancelled", 1, 3)
            assert "disconnected" in st["stop_reason"]
            batch = served.sampler.get(created["id"])
            assert all(j.done.is_set() for g in batch.groups for j in g.jobs)
            assert served.pipeline.live == 0
        else:
            assert (st["state"], st["kept"]) == ("completed", 3)
            rest = [g.prompt_index async for g in c.batch_groups(created["id"], start=1)]
            assert len(rest) == 2 and 0 not in rest


async def test_two_readers_one_leaves(served):
    prompts = [mixed(run_s=0.05)] + [mixed(run_s=0.5)] * 2
    async with AsyncClient(served.urls[0], token="tok") as c:
        created = await c.create_batch(prompts, group_size=2, keep=3, max_in_flight_groups=3)
        async with trio.open_nursery() as nursery:
            full: list[int] = []

            async def read_all() -> None:
                full.extend([g.prompt_index async for g in c.batch_groups(created["id"])])

            nursery.start_soon(read_all)
            async with aclosing(c.batch_groups(created["id"])) as groups:
                async for _ in groups:
                    break
        st = await wait_state(served, created["id"])
        assert st["state"] == "completed" and len(full) == 3  # the other reader kept it alive


async def test_sync_client_and_cli(served, tmp_path):
    url = served.urls[0]
    prompts = [equal(run_s=0.02), mixed(run_s=0.02), mixed(run_s=0.02)] * 2

    def use_client() -> list[int]:
        with Client(url, token="tok") as c:
            return [g.prompt_index for g in c.sample_batch(prompts, group_size=2, keep=2)]

    assert sorted(await trio.to_thread.run_sync(use_client)) == [1, 2]

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    token = tmp_path / "token"
    token.write_text("tok")
    out = tmp_path / "kept.jsonl"
    argv = ["submit", str(tasks), "--url", url, "--token-file", str(token), "--batch",
            "--group-size", "3", "--keep", "4", "--out", str(out)]
    assert await trio.to_thread.run_sync(cli.main, argv) == 0
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(kept) == 4 and all(len(k["rollouts"]) == 3 for k in kept)
    assert all(k["task"] == prompts[k["prompt_index"]] for k in kept)
    argv[argv.index("4")] = "10"  # cannot keep 10 of 6 prompts: exit status 1
    assert await trio.to_thread.run_sync(cli.main, argv) == 1
    assert await trio.to_thread.run_sync(cli.main, argv[:-4]) == 2  # --batch without --keep


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
async def test_leftovers_release_real_sandboxes(nursery, tmp_path):
    from rolloutd.sandbox import SandboxSupervisor

    node_settings = make_settings(tmp_path, n_init=4, n_run=4, n_eval=4)
    sup = SandboxSupervisor(default_backend="bwrap", state_dir=tmp_path / "sb", boot_id="test-boot")
    await nursery.start(sup.run)
    registry = TaskRegistry.default()
    registry.register(SandboxedSleep())
    node = Node(node_settings, services=Services(supervisor=sup), registry=registry)
    await nursery.start(node.pipeline.run)
    await nursery.start(node.sampler.run)
    prompts = [dict(mixed(run_s=[0.1, 0.2]), kind="sleep-sandboxed")] + [
        dict(mixed(run_s=30), kind="sleep-sandboxed")] * 3
    batch = node.sampler.create(BatchRequest(prompts=prompts, group_size=2, keep=1, max_in_flight_groups=4))
    with trio.fail_after(60):
        await batch.done.wait()
        while sup.statistics()["live"]:
            await trio.sleep(0.05)
    st = batch.status()
    assert (st["state"], st["kept"], st["cancelled"]) == ("completed", 1, 3)
    stats = sup.statistics()
    assert stats["opened"] >= 2 and stats["opened"] == stats["closed"]
