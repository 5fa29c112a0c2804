"""``/v1/images`` in-process through ASGI against a real store and real images
(tests/_images.py): import (plain and streamed with progress), list, remove, gc; bad
sources are a 404 or 422 with a JSON body, never a 500 or a hang."""

from __future__ import annotations

import json

import pytest
import trio

from .conftest import sleep_task


@pytest.fixture
async def images_client(asgi, test_images, tmp_path):
    client, node = await asgi(image_cache_dir=tmp_path / "store")
    async with client:
        yield client, node


async def test_import_list_remove(images_client, test_images):
    client, node = images_client
    ref = test_images.oci_ref(test_images.busybox_oci)
    r = await client.post("/v1/images", json={"source": ref, "name": "localhost/bb:t"})
    assert r.status_code == 201, r.text
    image = r.json()
    assert image["digest"].startswith("sha256:") and image["names"] == ["localhost/bb:t"]
    assert image["env"]["ROLLOUTD_IMAGE"] == "busybox" and image["workdir"] == "/work"
    assert image["size"] > 0 and len(image["layers"]) == 1
    again = await client.post("/v1/images", json={"source": ref})
    assert again.status_code == 201 and again.json()["digest"] == image["digest"]
    listed = (await client.get("/v1/images")).json()["images"]
    assert [i["digest"] for i in listed] == [image["digest"]]
    assert node.status()["images"]["images"] == 1
    # in use: a 409, never a rootfs pulled from under a live sandbox
    held = await trio.to_thread.run_sync(node.images.store.acquire, "localhost/bb:t")
    r = await client.delete(f"/v1/images/{image['digest'][:19]}")  # a unique prefix
    assert r.status_code == 409 and r.json()["error"]["type"] == "image_in_use", r.text
    node.images.store.release(held)
    r = await client.delete(f"/v1/images/{image['digest']}")
    assert r.status_code == 200 and r.json()["digest"] == image["digest"]
    r = await client.delete(f"/v1/images/{image['digest']}")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
    assert (await client.get("/v1/images")).json()["images"] == []


async def test_streamed_import_reports_progress(images_client, test_images):
    client, _ = images_client
    body = {"source": f"docker-archive:{test_images.debian_tar}"}
    async with client.stream("POST", "/v1/images", json=body,
                             headers={"Accept": "application/x-ndjson"}) as r:
        assert r.status_code == 200
        lines = [json.loads(line) async for line in r.aiter_lines() if line.strip()]
    progress = [line["progress"] for line in lines if "progress" in line]
    assert progress and progress[-1]["done"] == progress[-1]["total"] > 100 << 20
    assert [d["done"] for d in progress] == sorted(d["done"] for d in progress)
    assert lines[-1]["image"]["names"] == ["localhost/rolloutd-debian:test"]


async def test_bad_sources_are_404_or_422_with_a_reason(images_client, tmp_path):
    client, _ = images_client
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"\x00not a tar" * 500)
    for body, status, etype, words in [
            ({"source": "oci:/nonexistent/layout:x"}, 404, "not_found", "does not exist"),
            ({"source": "just-a-name"}, 404, "not_found", "no stored image"),
            ({"source": f"docker-archive:{junk}"}, 422, "invalid_image", "junk.tar")]:
        r = await client.post("/v1/images", json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["type"] == etype and words in r.text, r.text
    r = await client.post("/v1/images", json={"source": "x", "bogus": 1})
    assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request"
    r = await client.post("/v1/images/gc", json={"max_gb": 1e308})
    assert r.status_code == 422, r.text
    r = await client.delete("/v1/images/gc")
    assert r.status_code == 405 and "DELETE" not in r.headers["Allow"], r.headers
    async with client.stream("POST", "/v1/images", json={"source": f"docker-archive:{junk}"},
                             headers={"Accept": "application/x-ndjson"}) as r:
        lines = [json.loads(line) async for line in r.aiter_lines() if line.strip()]
    assert lines[-1]["error"]["type"] == "invalid_image"


async def test_gc_removes_least_recently_used(images_client, test_images):
    client, _ = images_client
    for layout in (test_images.debian_oci, test_images.busybox_oci):  # ~200 MB, ~2 MB
        r = await client.post("/v1/images", json={"source": test_images.oci_ref(layout)})
        assert r.status_code == 201
    newest = r.json()["digest"]
    r = await client.post("/v1/images/gc", json={"max_gb": 0.1})  # the older goes
    assert r.status_code == 200, r.text
    report = r.json()
    assert len(report["removed"]) == 1 and newest not in report["removed"]
    assert report["freed_bytes"] > 0
    assert [i["digest"] for i in (await client.get("/v1/images")).json()["images"]] == [newest]


async def test_a_task_image_is_not_checked_at_submit(images_client):
    """A schema-valid request is accepted: a missing image fails the rollouts in INIT
    (tests/tasks/test_image_tasks.py), it is never a 4xx that the schema does not predict."""
    client, _ = images_client
    r = await client.post("/v1/rollouts", json={"task": sleep_task(image="oci:/nope/x:y")})
    assert r.status_code == 202, r.text


async def test_the_node_lists_the_image_refs_it_holds(images_client, test_images, nursery):
    """What a thief tells a victim it holds when it asks for work (daemon/steal.py): the refs
    its prefetches resolved, as tasks name them, and the names and sources of its stored
    images, the most recently resolved first; a removed image's refs are gone."""
    client, node = images_client
    await nursery.start(node.images.run)  # prefetch (this harness runs only the pipeline)
    assert node.images.held() == []
    ref = test_images.oci_ref(test_images.busybox_oci)
    r = await client.post("/v1/rollouts", json={"task": sleep_task(image=ref)})
    assert r.status_code == 202, r.text
    with trio.fail_after(60):
        while ref not in node.images.held():
            await trio.sleep(0.05)
    r = await client.post("/v1/images", json={"source": f"docker-archive:{test_images.debian_tar}",
                                              "name": "localhost/deb:held"})
    assert r.status_code == 201, r.text
    held = node.images.held()
    assert held[0] == ref and "localhost/deb:held" in held
    busybox = next(i["digest"] for i in (await client.get("/v1/images")).json()["images"]
                   if i["digest"] != r.json()["digest"])
    assert (await client.delete(f"/v1/images/{busybox}")).status_code == 200
    assert ref not in node.images.held() and "localhost/deb:held" in node.images.held()
