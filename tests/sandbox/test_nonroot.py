"""The bwrap conformance suite again, as an unprivileged user (the rootless HPC case).

Runs as root (CI does): creates the user ``rolloutd-test`` if needed, copies the sandbox
package, the conformance tests and their dependencies into a world-readable temp dir
(the venv and /root are not reachable by that user), and runs pytest there with Debian's
/usr/bin/python3 under ``runuser``. As a non-root user the whole suite is already
unprivileged, so this test is skipped there.
"""

from __future__ import annotations

import os

import pytest

from tests._nonroot import run_as_unprivileged


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="already unprivileged: the suite itself is rootless")
@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="needs /usr/bin/python3")
def test_bwrap_conformance_as_unprivileged_user():
    result = run_as_unprivileged(
        ["tests/sandbox/__init__.py", "tests/sandbox/conftest.py", "tests/sandbox/test_conformance.py"],
        "tests/sandbox/test_conformance.py", env={"ROLLOUTD_TEST_BACKENDS": "bwrap"})
    output = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, output
    assert " passed" in result.stdout and " failed" not in result.stdout, output
