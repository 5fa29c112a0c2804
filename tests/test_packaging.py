"""The wheel installs one import namespace, ``rolloutd.*``, and nothing else at the top level.

The repository's top-level dirs (daemon/, sandbox/, tools/, federation/, contrib/trainers/)
are mapped by pyproject.toml's package-dir to rolloutd.daemon, ... rolloutd.trainers, so
the wheel can be installed beside python-daemon, whose import name is ``daemon``.

Offline: python-daemon's wheel is downloaded into .venv/wheelhouse by the Makefile's .dev
step; the fresh venv gets the dev venv's site-packages (the dependencies) through a .pth
line, which adds that dir to sys.path without processing the .pth files in it (so the dev
venv's editable finder for the checkout is not active there: checked below).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"
#: import name under rolloutd -> the checkout's dir (pyproject.toml's package-dir)
PACKAGES = {"daemon": "daemon", "sandbox": "sandbox", "tools": "tools",
            "federation": "federation", "trainers": "contrib/trainers"}
SOURCES = ("pyproject.toml", "README.md", *PACKAGES.values())

# The `import daemon` below is python-daemon's.
PROBE = """
import importlib.metadata as md, json, sys
import daemon
import rolloutd.daemon, rolloutd.daemon.cli, rolloutd.sandbox, rolloutd.tools
import rolloutd.federation, rolloutd.trainers
assert daemon.DaemonContext, "python-daemon's daemon"
print(json.dumps({
    "python_daemon": daemon.__file__,
    "rolloutd": list(rolloutd.__path__),
    "modules": {m: sys.modules[m].__file__ for m in sys.modules if m.startswith("rolloutd.")},
    "meta_path": [type(f).__name__ + " " + repr(f) for f in sys.meta_path],
    "helper": str(rolloutd.sandbox._layout.HELPER_SOURCES[0]) if hasattr(rolloutd.sandbox, "_layout")
              else None,
}))
"""


def run(argv: list[str | Path], **kw: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                            timeout=240, **kw)  # type: ignore[call-overload]
    assert result.returncode == 0, f"{argv}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def record(site: Path, dist: str) -> dict[str, str]:
    """path -> sha256 (urlsafe b64, as in RECORD) of an installed distribution's files."""
    [info] = site.glob(f"{dist}-*.dist-info")
    with open(info / "RECORD", newline="") as f:
        return {row[0]: row[1] for row in csv.reader(f) if row and row[1]}


def digest(path: Path) -> str:
    raw = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@pytest.mark.slow
def test_wheel_installs_beside_python_daemon(tmp_path):
    daemon_wheels = sorted(WHEELHOUSE.glob("python_daemon-*.whl"))
    assert daemon_wheels, (f"no python-daemon wheel in {WHEELHOUSE}: the Makefile's .dev step "
                           "downloads it (make test)")

    # Build from a copy: an in-tree build/ dir keeps stale files that would end up in the wheel.
    src = tmp_path / "src"
    for rel in SOURCES:
        if (REPO / rel).is_dir():
            shutil.copytree(REPO / rel, src / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / rel, src / rel)
    for lic in REPO.glob("LICEN[CS]E*"):
        shutil.copy(lic, src / lic.name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
         "--no-build-isolation", "--no-index", "-w", tmp_path / "dist", src])
    [wheel] = (tmp_path / "dist").glob("rolloutd-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"rolloutd"}, tops
    assert "rolloutd/__init__.py" not in names  # an implicit namespace package
    # every module and package of the checkout is in the wheel (a package missing from
    # pyproject.toml's list is not), with the helper copied into sandboxes
    for name, rel in PACKAGES.items():
        for py in (REPO / rel).rglob("*.py"):
            if "__pycache__" not in py.parts:
                path = f"rolloutd/{name}/{py.relative_to(REPO / rel).as_posix()}"
                assert path in names, f"{path} is not in the wheel: list its package in pyproject.toml"
    assert "rolloutd/sandbox/_helper.py" in names
    assert "rolloutd/daemon/tasks/_runner.py" in names
    assert {f"rolloutd/{p}/py.typed" for p in PACKAGES} <= names
    # the dashboard's files (package data: GET /ui/ serves them from the installed package)
    assert {f"rolloutd/daemon/ui/{f}" for f in ("index.html", "app.js", "app.css")} <= names
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "rolloutd = rolloutd.daemon.cli:main" in entry_points

    # A fresh venv without pip (the dev venv's pip installs into it), the dev venv's
    # site-packages appended for the dependencies.
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                .stdout.strip())
    dev_sites = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "_dev_venv.pth").write_text("".join(f"{p}\n" for p in dev_sites))
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q",
         "--disable-pip-version-check", "--no-deps", "--no-index", wheel, daemon_wheels[-1]])

    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    probe = json.loads(run([python, "-I", "-c", PROBE], cwd=tmp_path, env=env).stdout)

    # python-daemon's daemon and our rolloutd.* both from the fresh venv, not the checkout
    assert Path(probe["python_daemon"]).resolve() == (site / "daemon" / "__init__.py").resolve()
    assert [Path(p).resolve() for p in probe["rolloutd"]] == [(site / "rolloutd").resolve()]
    for module, file in probe["modules"].items():
        assert file and Path(file).resolve().is_relative_to(site.resolve()), (module, file)
        assert not Path(file).resolve().is_relative_to(REPO), (module, file)
    assert not [f for f in probe["meta_path"] if "editable" in f.lower()], probe["meta_path"]
    assert Path(probe["helper"]).is_file()

    # no file of one distribution overwrote the other's: disjoint files, each as recorded
    ours, theirs = record(site, "rolloutd"), record(site, "python_daemon")
    assert not set(ours) & set(theirs)
    for rel, sha in {**ours, **theirs}.items():
        assert digest(site / rel) == sha, rel

    result = run([venv / "bin" / "rolloutd", "--help"], cwd=tmp_path, env=env)
    assert "usage" in result.stdout.lower()
