"""Image sandboxes as an unprivileged user: run by test_images_rootless.py under
``runuser`` (not collected by itself). ``ROLLOUTD_TEST_IMAGE_DIR`` holds world-readable
copies of the test images' OCI layouts (``debian``, ``busybox``, ``layered``, tag ``test``).
Imports only the sandbox package (the copy the runner made) and the test dependencies."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from rolloutd.sandbox import SandboxSpec, open_backend
from rolloutd.sandbox.images import ImageStore

IMAGES = Path(os.environ.get("ROLLOUTD_TEST_IMAGE_DIR", "/nonexistent"))


def ref(name: str) -> str:
    return f"oci:{IMAGES / name}:test"


@pytest.fixture(scope="module")
def store():
    path = Path(tempfile.mkdtemp(prefix="rlis", dir="/tmp"))
    yield ImageStore(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def bwrap(store):
    state = Path(tempfile.mkdtemp(prefix="rli", dir="/tmp"))
    backend = open_backend("bwrap", state_dir=state, boot_id="rootless", check=True,
                           spares=1, images=store)
    yield backend
    await backend.aclose()
    left = list((state / "sandboxes").rglob("*")) if (state / "sandboxes").exists() else []
    shutil.rmtree(state, ignore_errors=True)
    assert left == [], left


async def test_not_root():
    assert os.geteuid() != 0


async def test_image_root_overlay_and_env(bwrap):
    async with bwrap.open(SandboxSpec(image=ref("debian"))) as sb:
        assert sb.limits["overlay"] == "tmpfs-size"
        r = await sb.run(["sh", "-c", "id -u; cat /etc/rolloutd-image; echo $ROLLOUTD_IMAGE; "
                          "echo x > /etc/new && mkdir -p /usr/local/lib/y && touch /tmp/t "
                          "&& echo wrote"], timeout_s=30)
        assert r.stdout.split() == [b"0", b"debian", b"debian", b"wrote"], r
        r = await sb.run(["python3", "-c", "import pytest, sys; print(sys.executable)"],
                         timeout_s=30)
        assert r.stdout == b"/usr/bin/python3\n", r
    async with bwrap.open(SandboxSpec(image=ref("debian"))) as sb:
        assert (await sb.run(["ls", "/etc/new"], timeout_s=10)).exit_code != 0


async def test_no_python_image_and_whiteouts(bwrap):
    async with bwrap.open(SandboxSpec(image=ref("busybox"))) as sb:
        r = await sb.run(["sh", "-c", "pwd; ls /usr/bin/python3 2>&1"], timeout_s=10)
        assert r.stdout.startswith(b"/work\n") and b"No such file" in r.stdout
    async with bwrap.open(SandboxSpec(image=ref("layered"))) as sb:
        r = await sb.run(["cat", "/data/added"], timeout_s=10)
        assert r.stdout == b"added in layer 3\n"
        assert (await sb.run(["ls", "/data/remove-me"], timeout_s=10)).exit_code != 0


async def test_a_prestarted_image_sandbox_has_no_capability_and_a_sized_layer(bwrap):
    async with bwrap.open(SandboxSpec(image=ref("debian"))):
        pass  # from now on the backend parks image sandboxes, helper running
    assert sum(h.prestarted for h in bwrap._spares) == 1
    async with bwrap.open(SandboxSpec(image=ref("debian"), disk_mb=32)) as sb:
        assert sum(h.prestarted for h in bwrap._spares) == 0  # that one became this one
        r = await sb.run(["grep", "-E", "^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs):",
                          "/proc/self/status"], timeout_s=10)
        found = dict(line.split(b":\t") for line in r.stdout.splitlines())
        assert found.pop(b"NoNewPrivs") == b"1" and set(found.values()) == {b"0" * 16}, r
        r = await sb.run(["sh", "-c", "dd if=/dev/zero of=/var/fill bs=1M count=100"],
                         timeout_s=60)
        assert r.exit_code != 0 and b"No space left" in r.stderr, r
