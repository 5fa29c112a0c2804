"""test_containment.py again as an unprivileged user (the rootless HPC case), where limits
fall back from cgroups to rlimits and the sandbox's uid 0 is no longer host root.

Same method as tests/sandbox/test_nonroot.py: as root, create the user ``rolloutd-test``,
copy the sandbox package, the test file and their dependencies into a world-readable temp
dir and run pytest there with /usr/bin/python3 under ``runuser``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests._nonroot import run_as_unprivileged


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="already unprivileged: the suite itself is rootless")
@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="needs /usr/bin/python3")
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_containment_as_unprivileged_user(test_images) -> None:
    copy = Path(tempfile.mkdtemp(prefix="rlimg", dir="/tmp"))
    try:
        shutil.copytree(test_images.debian_oci, copy / "debian")  # /root is not readable
        for path in [copy, *copy.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        result = run_as_unprivileged(
            ["tests/hostile/__init__.py", "tests/hostile/test_containment.py"],
            "tests/hostile/test_containment.py", pytest_args=["-rs"],
            env={"ROLLOUTD_TEST_IMAGE": f"oci:{copy / 'debian'}:{test_images.tag}"})
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    output = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, output
    assert " passed" in result.stdout and " failed" not in result.stdout, output
