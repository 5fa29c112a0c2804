"""Tasks that name an image: INIT opens the rollout's sandbox in it, EVAL's fresh sandbox
too, the node prefetches it at submit, and an image that cannot be read fails INIT with
``ImageError`` (never a reward). Real bwrap sandboxes, real images (tests/_images.py); the
policy is the scripted test double."""

from __future__ import annotations

import pytest

from rolloutd.daemon.trajectory import Status

from .conftest import tool_call

# The program checks it runs in the image, then does the task: in EVAL's sandbox too.
IN_IMAGE = ("import pathlib\n"
            "assert pathlib.Path('/etc/rolloutd-image').read_text() == 'debian\\n'\n"
            "a, b = map(int, input().split())\nprint(a + b)\n")


def sum_task(image: str) -> dict:
    return {"kind": "code", "id": "sum-in-image", "image": image,
            "prompt": "Read two integers and print their sum.",
            "tests": [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "10 20\n", "stdout": "30\n"}]}


async def test_code_task_runs_and_is_judged_in_its_image(image_harness, test_images):
    ref = test_images.oci_ref(test_images.debian_oci)
    await image_harness.script([
        tool_call("bash", command=f"cat /etc/rolloutd-image; cat > solution.py <<'EOF'\n{IN_IMAGE}EOF\n"
                                  "python3 solution.py <<< '2 3'"),
        tool_call("finish", answer="done"),
    ])
    tr = await image_harness.run(sum_task(ref))
    assert tr.status is Status.completed, tr.error
    assert tr.reward == 1.0, tr.reward_info
    assert "debian" in tr.messages[3]["content"] and "5" in tr.messages[3]["content"]
    stats = image_harness.node.images.statistics()
    assert stats["prefetched"] + stats["prefetch_failed"] + stats["prefetching"] >= 1


@pytest.mark.parametrize("bad", ["missing", "corrupt"])
async def test_an_unreadable_image_fails_init_never_reward_zero(image_harness, short_tmp, bad):
    path = short_tmp / "bad.tar"
    if bad == "corrupt":
        path.write_bytes(b"not a docker archive" * 64)
    await image_harness.script([tool_call("finish", answer="x")])
    tr = await image_harness.run(sum_task(f"docker-archive:{path}"))
    assert tr.status is Status.failed and tr.reward is None and tr.usable is False
    assert tr.error is not None and tr.error.stage == "init"
    assert tr.error.type == ("ImageNotFound" if bad == "missing" else "ImageError"), tr.error


async def test_a_stored_name_or_digest_names_the_image(image_harness, test_images):
    from rolloutd.daemon.images import ImageImport

    images = image_harness.node.images
    got = await images.import_(ImageImport(source=f"docker-archive:{test_images.debian_tar}",
                                           name="deb-test"))
    await image_harness.script([tool_call("bash", command="cat /etc/rolloutd-image"),
                                tool_call("finish", answer="x")])
    for ref in ("deb-test", got.digest):
        tr = await image_harness.run({**sum_task(ref), "tests": [{"stdin": "", "stdout": ""}]})
        assert tr.status is Status.completed, tr.error
        assert "debian" in tr.messages[3]["content"]
