"""The bwrap conformance suite again, as an unprivileged user (the rootless HPC case).

Runs as root (CI does): creates the user ``rolloutd-test`` if needed, copies the sandbox
package, the conformance tests and their dependencies into a world-readable temp dir
(the venv and /root are not reachable by that user), and runs pytest there with Debian's
/usr/bin/python3 under ``runuser``. As a non-root user the whole suite is already
unprivileged, so this test is skipped there.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

USER = "rolloutd-test"
REPO = Path(__file__).resolve().parents[2]
DEPS = ("trio", "outcome", "sniffio", "sortedcontainers", "idna", "attr", "attrs", "pydantic",
        "pydantic_core", "annotated_types", "typing_extensions", "typing_inspection",
        "ptyprocess", "pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pytest_trio",
        "py")


def copy_module(name: str, dest: Path) -> None:
    spec = importlib.util.find_spec(name)
    if spec is None:
        return
    if spec.submodule_search_locations:
        src = Path(next(iter(spec.submodule_search_locations)))
        shutil.copytree(src, dest / src.name, ignore=shutil.ignore_patterns("__pycache__"))
    elif spec.origin and spec.origin.endswith(".py"):
        shutil.copy(spec.origin, dest)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="already unprivileged: the suite itself is rootless")
@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="needs /usr/bin/python3")
def test_bwrap_conformance_as_unprivileged_user():
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        USER], check=True, capture_output=True)
    root = Path(tempfile.mkdtemp(prefix="rldnr", dir="/tmp"))
    try:
        site = root / "site"
        site.mkdir()
        for name in DEPS:
            copy_module(name, site)
        shutil.copytree(REPO / "sandbox", site / "sandbox",
                        ignore=shutil.ignore_patterns("__pycache__"))
        tests = root / "tests"
        (tests / "sandbox").mkdir(parents=True)
        (tests / "__init__.py").touch()
        for name in ("__init__.py", "conftest.py", "test_conformance.py"):
            shutil.copy(REPO / "tests" / "sandbox" / name, tests / "sandbox" / name)
        (root / "pytest.ini").write_text("[pytest]\ntrio_mode = true\nmarkers =\n    slow: slow\n")
        for path in [root, *root.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(root), "LANG": "C.UTF-8",
               "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1",
               "ROLLOUTD_TEST_BACKENDS": "bwrap"}
        result = subprocess.run(
            ["runuser", "-u", USER, "--", "/usr/bin/python3", "-m", "pytest", "-q", "-p", "pytest_trio.plugin",
             "-p", "no:cacheprovider", "tests/sandbox/test_conformance.py"],
            cwd=root, env=env, capture_output=True, text=True, timeout=240)
        output = result.stdout[-4000:] + result.stderr[-2000:]
        assert result.returncode == 0, output
        assert " passed" in result.stdout and " failed" not in result.stdout, output
    finally:
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(["find", "/tmp", "-maxdepth", "1", "-name", "rld*", "-user", USER,
                        "-exec", "rm", "-rf", "{}", "+"], capture_output=True)
