"""What starting the in-sandbox helper loads: its start-up is most of a sandbox's open."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import rolloutd.sandbox

SANDBOX_DIR = Path(rolloutd.sandbox.__file__).parent
#: Python-level modules the helper does without at start: ``json``, ``socket``, ``signal``
#: and ``selectors`` pull in ``re`` and ``enum`` (~11 ms), ``os`` pulls in
#: ``_collections_abc`` and ``posixpath`` (0.5-0.7 ms of every open, measured 2026-11-27).
AVOIDED = {"os", "posixpath", "json", "socket", "signal", "selectors", "re", "enum", "typing",
           "ctypes", "subprocess", "resource", "shutil"}


def test_importing_the_helper_loads_no_python_level_stdlib_module() -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import _helper; "
            "print(' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(SANDBOX_DIR)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert not set(out.split()) & AVOIDED


def test_the_few_path_functions_match_os_path(tmp_path: Path) -> None:
    """``join``, ``is_file`` and ``real_dir`` stand in for ``os.path`` on the start and
    command paths; they must answer as it does."""
    import os.path

    from rolloutd.sandbox import _helper

    for a, b in [("/w", "x"), ("/w/", "x"), ("", "x"), ("/w", "/abs"), ("w", "x/y"), (".", "ls")]:
        assert _helper.join(a, b) == os.path.join(a, b)
    (tmp_path / "f").write_text("")
    (tmp_path / "d").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "d")
    (tmp_path / "flink").symlink_to(tmp_path / "f")
    for name in ("f", "d", "link", "flink", "missing"):
        assert _helper.is_file(str(tmp_path / name)) == os.path.isfile(tmp_path / name)
    for path in (tmp_path / "link", tmp_path / "d", tmp_path / "missing" / "x", tmp_path / "f"):
        assert _helper.real_dir(str(path)) == os.path.realpath(path)
