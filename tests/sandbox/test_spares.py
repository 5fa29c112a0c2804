"""Spare launchers (sandbox/_launcher.py): parked in fresh cgroups, used by the next open,
replaced, and gone after ``aclose`` or when the daemon's end of their stdin closes."""

from __future__ import annotations

import os
import signal

import pytest
import trio

from rolloutd.sandbox import SandboxSpec, SandboxStartError, open_backend
from rolloutd.sandbox._launcher import NAME

from ..conftest import descendants


def parked() -> list[int]:
    return [pid for pid, cmd in descendants() if f" {NAME} " in cmd]


def cgroup_ids(backend) -> set[str]:
    return {d.name for base in backend.limits.boot_dirs()
            for d in (base / backend.layout.boot_tag).glob("*") if d.is_dir()}


@pytest.mark.parametrize("name", ["bwrap", "local"])
async def test_spares_are_parked_used_replaced_and_closed(name, state_dir, boot_id, leak_check):
    backend = open_backend(name, state_dir=state_dir, boot_id=boot_id, check=True, spares=2)
    backend.warm_up()
    assert len(parked()) == 2 and backend.statistics()["spares"] == 2
    reserved = {h.dirs.id for h in backend._spares}
    if backend.limits.kind != "rlimit":
        assert cgroup_ids(backend) == reserved  # each joined before anything was asked of it
    async with backend.open(SandboxSpec(memory_mb=256)) as sb:
        assert sb.id in reserved
        r = await sb.run(["sh", "-c", "ulimit -n; ulimit -c; echo ok"], timeout_s=10)
        assert r.stdout == b"4096\n0\nok\n"  # set on the launcher, inherited by all
    stats = backend.statistics()
    assert (stats["spare_hits"], stats["spare_misses"], stats["spares"]) == (1, 0, 2)
    await backend.aclose()
    assert parked() == [] and cgroup_ids(backend) == set()
    with pytest.raises(SandboxStartError, match="closed"):
        async with backend.open(SandboxSpec()):
            pass


async def test_a_dead_spare_is_discarded_and_replaced(state_dir, boot_id, leak_check):
    backend = open_backend("bwrap", state_dir=state_dir, boot_id=boot_id, check=True, spares=1)
    backend.warm_up()
    [pid] = parked()
    dead = backend._spares[0].dirs.root
    os.kill(pid, signal.SIGKILL)
    with trio.fail_after(5):
        while backend._spares[0].process.returncode is None:
            await trio.sleep(0.01)
    try:
        async with backend.open(SandboxSpec()) as sb:  # on the replacement
            assert (await sb.run(["echo", "hi"], timeout_s=10)).stdout == b"hi\n"
        assert not dead.exists() and len(parked()) == 1
    finally:
        await backend.aclose()


async def test_a_spare_execs_nothing_without_go(state_dir, boot_id, leak_check):
    """EOF (the daemon died) or any other line ends a parked launcher: it never runs its
    command (bwrap would read no options and start a helper unconfined)."""
    backend = open_backend("bwrap", state_dir=state_dir, boot_id=boot_id, check=True, spares=2)
    backend.warm_up()
    eof, other = backend._spares
    await eof.launcher.process.stdin.aclose()
    await other.launcher.process.stdin.send_all(b"gone\n--help\n")
    with trio.fail_after(5):
        codes = [await eof.launcher.process.wait(), await other.launcher.process.wait()]
    assert codes == [1, 1] and parked() == []
    await backend.aclose()
