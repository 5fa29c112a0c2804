"""``GET /v1/rollouts`` (the listing of held rollouts) and the dashboard's files (``/ui/``),
in-process through ASGI."""

from __future__ import annotations

import httpx
import pytest
import trio

from rolloutd.daemon.api import create_app
from rolloutd.daemon.node import Node
from rolloutd.daemon.pipeline import Services

from .conftest import make_settings, sleep_task


async def _submit(client, node, **body):
    r = await client.post("/v1/rollouts", json=body)
    assert r.status_code == 202, r.text
    ids = r.json()["ids"]
    await node.service.wait([node.service.get(i) for i in ids])
    return r.json()["group_id"], ids


async def test_listing_filters_and_summaries(asgi):
    client, node = await asgi()
    async with client:
        g1, ids1 = await _submit(client, node, task=sleep_task(rewards=[0.0, 0.5, 1.0]), n=3,
                                 group_id="grp-a", labels=["exp:one"])
        g2, ids2 = await _submit(client, node, task=sleep_task(fail_stage="eval"), n=2)
        r = await client.get("/v1/rollouts")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["total"] == 5
        # newest first: the second submit's rollouts lead
        assert [x["id"] for x in body["rollouts"]] == [*reversed(ids2), *reversed(ids1)]
        first = {x["id"]: x for x in body["rollouts"]}[ids1[1]]
        assert first == {
            "id": ids1[1], "group_id": "grp-a", "batch_id": None, "sample_index": 1, "status": "completed",
            "usable": True, "reward": 0.5, "kind": "sleep", "labels": ["exp:one", "test-task:sleep"],
            "turns": 0, "sampled_tokens": 0, "total_s": first["total_s"], "error_type": None,
        }
        assert first["total_s"] > 0
        failed = {x["id"]: x for x in body["rollouts"]}[ids2[0]]
        assert failed["status"] == "failed" and failed["error_type"] and failed["usable"] is False

        async def ids(**params):
            r = await client.get("/v1/rollouts", params=params)
            assert r.status_code == 200, (params, r.text)
            got = r.json()
            assert got["total"] == len(got["rollouts"])  # every test below fits one page
            return {x["id"] for x in got["rollouts"]}

        assert await ids(status="failed") == set(ids2)
        assert await ids(status="completed") == set(ids1)
        assert await ids(status="queued") == set()
        assert await ids(group_id="grp-a") == set(ids1)
        assert await ids(group_id=g2) == set(ids2)
        assert await ids(label="exp:one") == set(ids1)
        assert await ids(label="test-task:sleep") == set(ids1 + ids2)
        assert await ids(kind="sleep") == set(ids1 + ids2)
        assert await ids(kind="math") == set()
        assert await ids(min_reward=0.5) == {ids1[1], ids1[2]}
        assert await ids(max_reward=0.5) == {ids1[0], ids1[1]}
        assert await ids(min_reward=0.25, max_reward=0.75) == {ids1[1]}
        assert await ids(min_reward=-10) == set(ids1)  # no reward (failed) never matches a bound
        assert await ids(id_prefix=ids1[2][:12]) == {ids1[2]}
        assert await ids(id_prefix="r-") == set(ids1 + ids2)
        assert await ids(status="completed", group_id="grp-a", min_reward=1) == {ids1[2]}


async def test_listing_filters_by_batch(nursery, tmp_path):
    """Rollouts a batch (``POST /v1/batches``) sampled carry its id; a rollout submitted alone
    carries null; ``?batch_id=`` selects one batch's rollouts."""
    node = Node(make_settings(tmp_path), services=Services())
    await nursery.start(node.pipeline.run)
    await nursery.start(node.sampler.run)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(node)), base_url="http://t")
    async with client:
        batch_ids = []
        for rewards in ([0.0, 1.0], [1.0, 0.0, 0.5]):
            r = await client.post("/v1/batches", json={
                "prompts": [sleep_task(rewards=rewards)] * 2, "group_size": len(rewards), "keep": 2})
            assert r.status_code == 202, r.text
            batch_ids.append(r.json()["id"])
        _, alone = await _submit(client, node, task=sleep_task(), n=2)
        for bid in batch_ids:
            while (await client.get(f"/v1/batches/{bid}")).json()["state"] == "running":
                await trio.sleep(0.05)

        async def listed(**params):
            r = await client.get("/v1/rollouts", params={"limit": 500, **params})
            assert r.status_code == 200, r.text
            return r.json()["rollouts"]

        everything = await listed()
        assert len(everything) == 2 * 2 + 2 * 3 + 2
        for bid, size in zip(batch_ids, (2, 3), strict=True):
            mine = await listed(batch_id=bid)
            assert len(mine) == 2 * size and all(x["batch_id"] == bid for x in mine)
            assert {x["group_id"] for x in mine} == {f"{bid}.0", f"{bid}.1"}
            traj = (await client.get(f"/v1/rollouts/{mine[0]['id']}")).json()
            assert traj["batch_id"] == bid and f"batch:{bid}" in traj["labels"]
            assert await listed(batch_id=bid, status="completed", min_reward=1) == [
                x for x in mine if x["reward"] == 1.0]
        assert {x["id"] for x in everything if x["batch_id"] is None} == set(alone)
        assert (await client.get(f"/v1/rollouts/{alone[0]}")).json()["batch_id"] is None
        assert await listed(batch_id="b-0000000000000000") == []
        # a client cannot claim a batch: batch_id is no field of a rollout request
        r = await client.post("/v1/rollouts", json={"task": sleep_task(), "batch_id": batch_ids[0]})
        assert r.status_code == 422, r.text


async def test_listing_pages(asgi):
    client, node = await asgi()
    async with client:
        _, ids = await _submit(client, node, task=sleep_task(), n=7)
        newest_first = list(reversed(ids))
        seen = []
        for offset in range(0, 9, 3):
            r = await client.get("/v1/rollouts", params={"limit": 3, "offset": offset})
            assert r.status_code == 200 and r.json()["total"] == 7
            seen += [x["id"] for x in r.json()["rollouts"]]
        assert seen == newest_first
        r = await client.get("/v1/rollouts", params={"offset": 100})
        assert r.json() == {"rollouts": [], "total": 7}
        assert len((await client.get("/v1/rollouts", params={"limit": 500})).json()["rollouts"]) == 7


async def test_listing_by_ids_names_only_those_held(asgi):
    """The front's relays ask a peer for the statuses of the rollouts its stream has not
    delivered yet: a listing of just those ids, found without scanning the store."""
    client, node = await asgi()
    async with client:
        _, done = await _submit(client, node, task=sleep_task(), n=3)
        r = await client.post("/v1/rollouts", json={"task": sleep_task(run_s=60)})
        live = r.json()["ids"][0]
        asked = [done[2], "r-not-here", live, done[0], done[2]]
        r = await client.get("/v1/rollouts", params={"ids": ",".join(asked), "limit": len(asked)})
        assert r.status_code == 200, r.text
        got = {x["id"]: x["status"] for x in r.json()["rollouts"]}
        assert got.keys() == {done[2], live, done[0]} and r.json()["total"] == 3
        assert got[done[0]] == got[done[2]] == "completed" and got[live] in ("queued", "init", "run")
        assert [x["id"] for x in r.json()["rollouts"]][0] == live  # newest first, as ever
        r = await client.get("/v1/rollouts", params={"ids": ",".join(done), "status": "completed",
                                                     "limit": 2})
        assert r.json()["total"] == 3 and len(r.json()["rollouts"]) == 2  # combines, pages
        many = ",".join([*(f"r-{i}" for i in range(499)), live])
        r = await client.get("/v1/rollouts", params={"ids": many, "limit": 500})
        assert [x["id"] for x in r.json()["rollouts"]] == [live]
        await client.delete(f"/v1/rollouts/{live}")
        await node.service.get(live).done.wait()


async def test_listing_shows_live_rollouts(asgi):
    client, node = await asgi()
    async with client:
        r = await client.post("/v1/rollouts", json={"task": sleep_task(run_s=60)})
        rid = r.json()["ids"][0]
        got = (await client.get("/v1/rollouts")).json()
        assert got["total"] == 1 and got["rollouts"][0]["id"] == rid
        assert got["rollouts"][0]["status"] in ("queued", "init", "run")
        assert got["rollouts"][0]["reward"] is None
        await client.delete(f"/v1/rollouts/{rid}")
        await node.service.get(rid).done.wait()


@pytest.mark.parametrize("params", [
    {"limit": 0}, {"limit": 501}, {"limit": "ten"}, {"offset": -1}, {"offset": 10_000_001},
    {"status": "done"}, {"min_reward": "nan"}, {"max_reward": "inf"}, {"min_reward": "x"},
    {"group_id": ""}, {"id_prefix": ""}, {"label": "x" * 201}, {"bogus": 1},
    {"batch_id": ""}, {"batch_id": "b" * 201},
    {"ids": ""}, {"ids": "a,,b"}, {"ids": ",a"}, {"ids": ",".join(f"r-{i}" for i in range(501))},
])
async def test_listing_bad_query_is_400(asgi, params):
    client, _ = await asgi()
    async with client:
        r = await client.get("/v1/rollouts", params=params)
        assert r.status_code == 400, (params, r.text)
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert err["type"] == "bad_request" and "query" in err["message"]


async def test_listing_needs_the_token_and_is_documented(asgi):
    client, _ = await asgi(token="s3cret")
    async with client:
        r = await client.get("/v1/rollouts", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        assert (await client.get("/v1/rollouts")).status_code == 200
        doc = (await client.get("/openapi.json")).json()
    op = doc["paths"]["/v1/rollouts"]["get"]
    assert {"200", "400", "401"} <= set(op["responses"])
    params = {p["name"]: p for p in op["parameters"]}
    assert set(params) == {"status", "group_id", "batch_id", "label", "kind", "min_reward", "max_reward",
                           "id_prefix", "ids", "limit", "offset"}
    assert not any(p["required"] for p in params.values())
    assert params["limit"]["schema"]["maximum"] == 500 and params["limit"]["schema"]["minimum"] == 1
    assert not any(path.startswith("/ui") for path in doc["paths"])


async def test_dashboard_files_need_no_token(asgi):
    client, _ = await asgi(token="s3cret")
    async with client:
        client.headers.pop("Authorization")
        r = await client.get("/ui")
        assert r.status_code == 308 and r.headers["location"].endswith("ui/")
        r = await client.get("/ui/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "static/app.js" in r.text and "login-form" in r.text
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp
        for name, mime in (("app.js", "javascript"), ("app.css", "text/css")):
            r = await client.get(f"/ui/static/{name}")
            assert r.status_code == 200 and mime in r.headers["content-type"], name
        js = (await client.get("/ui/static/app.js")).text
        assert "sessionStorage" in js
        # nothing is loaded from elsewhere (the SVG namespace is a name, not a request)
        assert js.replace("http://www.w3.org/2000/svg", "").count("http") == 0
        for path in ("/ui/static/../__init__.py", "/ui/static/__init__.py", "/ui/static/nope.js",
                     "/ui/nope"):
            r = await client.get(path)
            assert r.status_code == 404, path
        # the data the page reads is still guarded
        assert (await client.get("/v1/rollouts")).status_code == 401
        assert (await client.get("/v1/status")).status_code == 401
