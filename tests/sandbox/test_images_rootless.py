"""Image sandboxes again as the unprivileged user ``rolloutd-test`` (the rootless HPC case:
the store unpacks as that user, bwrap's overlay upper layer is its own tmpfs, the sandbox's
uid 0 maps to that user). Runs as root (CI does), like test_nonroot.py; the cases are in
_rootless_images.py."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests._nonroot import run_as_unprivileged


@pytest.mark.skipif(os.geteuid() != 0, reason="already unprivileged: the suite itself is rootless")
@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="needs /usr/bin/python3")
def test_images_as_unprivileged_user(test_images):
    copies = Path(tempfile.mkdtemp(prefix="rlimg", dir="/tmp"))
    try:
        for name, layout in (("debian", test_images.debian_oci),
                             ("busybox", test_images.busybox_oci),
                             ("layered", test_images.layered_oci)):
            shutil.copytree(layout, copies / name)
        for path in [copies, *copies.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        result = run_as_unprivileged(
            ["tests/sandbox/__init__.py", "tests/sandbox/_rootless_images.py"],
            "tests/sandbox/_rootless_images.py", env={"ROLLOUTD_TEST_IMAGE_DIR": str(copies)})
    finally:
        shutil.rmtree(copies, ignore_errors=True)
    output = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, output
    assert "4 passed" in result.stdout and "failed" not in result.stdout, output
