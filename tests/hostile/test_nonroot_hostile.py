"""test_containment.py again as an unprivileged user (the rootless HPC case), where limits
fall back from cgroups to rlimits and the sandbox's uid 0 is no longer host root.

Same method as tests/sandbox/test_nonroot.py: as root, create the user ``rolloutd-test``,
copy the sandbox package, the test file and their dependencies into a world-readable temp
dir and run pytest there with /usr/bin/python3 under ``runuser``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.sandbox.test_nonroot import DEPS, USER, copy_module

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="already unprivileged: the suite itself is rootless")
@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="needs /usr/bin/python3")
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_containment_as_unprivileged_user() -> None:
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        USER], check=True, capture_output=True)
    root = Path(tempfile.mkdtemp(prefix="rldnh", dir="/tmp"))
    try:
        site = root / "site"
        site.mkdir()
        for name in DEPS:
            copy_module(name, site)
        shutil.copytree(REPO / "sandbox", site / "sandbox", ignore=shutil.ignore_patterns("__pycache__"))
        tests = root / "tests" / "hostile"
        tests.mkdir(parents=True)
        (root / "tests" / "__init__.py").touch()
        (tests / "__init__.py").touch()
        shutil.copy(REPO / "tests" / "hostile" / "test_containment.py", tests)
        (root / "pytest.ini").write_text("[pytest]\ntrio_mode = true\nmarkers =\n    slow: slow\n")
        for path in [root, *root.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(root), "LANG": "C.UTF-8",
               "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
        result = subprocess.run(
            ["runuser", "-u", USER, "--", "/usr/bin/python3", "-m", "pytest", "-q", "-rs",
             "-p", "pytest_trio.plugin", "-p", "no:cacheprovider", "tests/hostile/test_containment.py"],
            cwd=root, env=env, capture_output=True, text=True, timeout=240)
        output = result.stdout[-4000:] + result.stderr[-2000:]
        assert result.returncode == 0, output
        assert " passed" in result.stdout and " failed" not in result.stdout, output
    finally:
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(["find", "/tmp", "-maxdepth", "1", "-name", "rl*", "-user", USER,
                        "-exec", "rm", "-rf", "{}", "+"], capture_output=True)
