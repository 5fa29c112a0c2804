"""Fixtures for the sandbox tests: a short state dir, every backend available here, and
a leak check (processes, fds, dirs, mounts) around every test that opens sandboxes."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

from rolloutd.sandbox import open_backend
from rolloutd.sandbox._layout import boot_tag

ALL_BACKENDS = ("bwrap", "local", "apptainer")


def available_backends() -> list:
    """bwrap and local everywhere (CI); apptainer only where its binary and a test image
    exist. ROLLOUTD_TEST_BACKENDS=a,b narrows the list (used by the non-root run)."""
    wanted = os.environ.get("ROLLOUTD_TEST_BACKENDS")
    names = wanted.split(",") if wanted else list(ALL_BACKENDS)
    params = []
    for name in names:
        marks = []
        if name == "apptainer":
            exe = shutil.which("apptainer") or shutil.which("singularity")
            if exe is None:
                marks.append(pytest.mark.skip(reason="apptainer/singularity binary not installed"))
            elif not os.environ.get("ROLLOUTD_TEST_SIF"):
                marks.append(pytest.mark.skip(reason="set ROLLOUTD_TEST_SIF to a .sif with python3"))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def marked_pids(tag: str) -> list[int]:
    """Host pids whose environment carries a sandbox marker of boot ``tag``."""
    needle = f"ROLLOUTD_SANDBOX={tag}/".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read():
                    found.append(int(name))
        except OSError:
            pass
    return found


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(path))]


@pytest.fixture
def state_dir():
    # short: the helper's socket path must fit in sun_path (108 bytes)
    path = Path(tempfile.mkdtemp(prefix="rld", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def boot_id() -> str:
    return "t" + secrets.token_hex(5)


class LeakCheck:
    def __init__(self, state_dir: Path, boot_id: str) -> None:
        self.state_dir = state_dir
        self.tag = boot_tag(boot_id)
        self.fds = open_fds()

    def assert_clean(self) -> None:
        assert marked_pids(self.tag) == [], "sandbox processes leaked"
        leaked_fds = open_fds() - self.fds
        assert not leaked_fds, f"fds leaked: {[os.readlink(f'/proc/self/fd/{fd}') for fd in leaked_fds if os.path.exists(f'/proc/self/fd/{fd}')]}"
        boxes = self.state_dir / "sandboxes"
        left = [p for p in boxes.rglob("*")] if boxes.exists() else []
        assert left == [], f"sandbox dirs leaked: {left}"
        assert mounts_under(self.state_dir) == [], "mounts leaked"


@pytest.fixture
def leak_check(state_dir, boot_id):
    check = LeakCheck(state_dir, boot_id)
    yield check
    check.assert_clean()


@pytest.fixture(params=available_backends())
def backend_name(request) -> str:
    return request.param


@pytest.fixture
async def backend(backend_name, state_dir, boot_id, leak_check):
    """The backend as the daemon runs it: one spare launcher parked where it can be
    (so tests cover both paths: a parked launcher, and one started on demand)."""
    options: dict = {"spares": 1}
    if backend_name == "apptainer":
        options["image_cache_dir"] = str(state_dir / "images")
    backend = open_backend(backend_name, state_dir=state_dir, boot_id=boot_id, check=True,
                           **options)
    yield backend
    await backend.aclose()


@pytest.fixture
def base_spec(backend_name):
    """The spec every conformance test starts from (apptainer needs an image)."""
    from rolloutd.sandbox import SandboxSpec

    if backend_name == "apptainer":
        return SandboxSpec(image=os.environ["ROLLOUTD_TEST_SIF"])
    return SandboxSpec()


@pytest.fixture
def bwrap(state_dir, boot_id, leak_check):
    return open_backend("bwrap", state_dir=state_dir, boot_id=boot_id, check=True)


@pytest.fixture(scope="session")
def image_store(test_images, tmp_path_factory):
    """One image store for the session: each real test image is unpacked once."""
    from rolloutd.sandbox.images import ImageStore

    return ImageStore(tmp_path_factory.mktemp("image-store"))


@pytest.fixture
def image_bwrap(state_dir, boot_id, leak_check, image_store):
    """The bwrap backend with the session's image store."""
    return open_backend("bwrap", state_dir=state_dir, boot_id=boot_id, check=True,
                        images=image_store)


class WithImage:
    """Test wrapper: a backend whose every open runs in ``image`` (the spec's other
    fields kept), so workload tests written for the host root run in an image too."""

    def __init__(self, backend, image: str) -> None:
        self.backend = backend
        self.image = image

    def open(self, spec=None):
        from rolloutd.sandbox import SandboxSpec

        return self.backend.open((spec or SandboxSpec()).model_copy(update={"image": self.image}))

    def __getattr__(self, name):
        return getattr(self.backend, name)
