"""The daemon's interpreter stays usable inside bwrap even when it lives under /tmp (CI
clones there), which the sandbox replaces with a fresh tmpfs."""

from __future__ import annotations

import sys

from rolloutd.sandbox._bwrap import python_paths

HIDDEN = ("/tmp", "/dev/shm", "/run")


def test_paths_under_hidden_mounts_are_rebound_outermost_only(monkeypatch, tmp_path):
    venv = tmp_path / "clone" / ".venv"
    site = venv / "lib" / "site-packages"
    site.mkdir(parents=True)
    (venv / "bin").mkdir()
    repo = tmp_path / "clone"
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "exec_prefix", str(venv))
    monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
    monkeypatch.setattr(sys, "path", ["", str(repo), str(site), "/usr/lib/python3.11"])
    found = python_paths.__wrapped__(HIDDEN)
    if str(tmp_path).startswith("/tmp/"):
        assert found == (str(venv),)  # the venv, not the checkout around it
    assert "/usr/lib/python3.11" not in found
