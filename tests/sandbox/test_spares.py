"""Spare launchers (sandbox/_launcher.py): parked in fresh cgroups, used by the next open,
replaced, and gone after ``aclose`` or when the daemon's end of their stdin closes."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket

import pytest
import trio

from rolloutd.sandbox import SandboxSpec, SandboxStartError, open_backend
from rolloutd.sandbox._backend import first_child
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


LOOPBACK_ECHO = ("import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1); "
                 "c = socket.create_connection(s.getsockname()); a, _ = s.accept(); "
                 "c.sendall(b'lo-ok'); print(a.recv(5).decode())")
HOST_PROBE = ("import socket, sys\n"
              "try:\n"
              "    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=2)\n"
              "    print('connected')\n"
              "except OSError as e: print('refused', e)\n")


def netns(pid: int | str) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


@pytest.mark.skipif(os.geteuid() != 0, reason="a rootless daemon cannot make a network "
                    "namespace outside bwrap (test_parking_falls_back_to_bwraps_own_network_namespace covers that path)")
async def test_a_spare_waits_in_a_network_namespace_of_its_own(state_dir, boot_id, leak_check):
    """As root, a parked launcher starts in a fresh network namespace (loopback up), and its
    sandbox keeps it; the daemon's thread is back in its own; a spec that asks for the
    host's network does not take such a spare."""
    home = os.readlink("/proc/thread-self/ns/net")
    backend = open_backend("bwrap", state_dir=state_dir, boot_id=boot_id, check=True, spares=2)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = str(listener.getsockname()[1])
    try:
        backend.warm_up()
        assert os.readlink("/proc/thread-self/ns/net") == home == netns("self")
        spaces = [netns(h.process.pid) for h in backend._spares]
        assert len(set(spaces)) == 2 and home not in spaces
        assert all(h.extra["netns"] for h in backend._spares)
        first = backend._spares[0]
        async with backend.open(SandboxSpec()) as sb:
            assert sb.id == first.dirs.id
            r = await sb.run(["python3", "-c", LOOPBACK_ECHO], timeout_s=20)
            assert r.stdout == b"lo-ok\n", r.stderr
            r = await sb.run(["python3", "-c", HOST_PROBE, port], timeout_s=20)
            assert r.stdout.startswith(b"refused"), r.stdout
            helper = first_child(first.process.pid)
            assert helper is not None and netns(helper) == spaces[0]
        async with backend.open(SandboxSpec(network=True)) as sb:  # started on demand
            assert sb.id not in {h.dirs.id for h in backend._spares}
            r = await sb.run(["python3", "-c", HOST_PROBE, port], timeout_s=20)
            assert r.stdout == b"connected\n", r.stdout
        stats = backend.statistics()
        assert (stats["spare_hits"], stats["spare_misses"], stats["spares"]) == (1, 1, 2)
        assert os.readlink("/proc/thread-self/ns/net") == home
    finally:
        listener.close()
        await backend.aclose()


async def test_parking_falls_back_to_bwraps_own_network_namespace(state_dir, boot_id,
                                                                   leak_check, monkeypatch,
                                                                   caplog):
    """Where the daemon cannot make a network namespace (rootless; a container without
    CAP_SYS_ADMIN), spares park in its own and bwrap makes each sandbox's as it opens."""
    from rolloutd.sandbox import _bwrap

    @contextlib.contextmanager
    def refused():
        raise PermissionError(1, "unshare(CLONE_NEWNET): Operation not permitted")
        yield

    monkeypatch.setattr(_bwrap, "own_netns", refused)
    backend = open_backend("bwrap", state_dir=state_dir, boot_id=boot_id, check=True, spares=1)
    try:
        with caplog.at_level(logging.INFO, logger="rolloutd.sandbox._bwrap"):
            backend.warm_up()
        assert not backend.parks_in_netns()
        assert "Operation not permitted" in caplog.text or os.geteuid() != 0
        [spare] = backend._spares
        assert "netns" not in spare.extra and netns(spare.process.pid) == netns("self")
        async with backend.open(SandboxSpec()) as sb:
            assert sb.id == spare.dirs.id
            r = await sb.run(["sh", "-c", "cat /proc/net/dev | grep -c :"], timeout_s=10)
            assert r.stdout.strip() == b"1"  # bwrap's own namespace: loopback only
            r = await sb.run(["python3", "-c", LOOPBACK_ECHO], timeout_s=20)
            assert r.stdout == b"lo-ok\n", r.stderr
    finally:
        await backend.aclose()
