"""SandboxSupervisor: ownership, release, bounded shutdown, the orphan sweep, the pool,
and loud failure when a configured backend is missing."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import trio

from rolloutd import sandbox
from rolloutd.sandbox import SandboxClosed, SandboxSpec, SandboxStartError, SandboxSupervisor

from .conftest import marked_pids


def test_public_api_is_exported():
    expected = {"SandboxSpec", "Bind", "Sandbox", "SandboxProcess", "RunResult", "DirEntry",
                "FileStat", "SandboxSupervisor", "open_backend", "SandboxError",
                "SandboxStartError", "SandboxClosed", "PathEscapeError"}
    assert expected <= set(sandbox.__all__)
    for name in sandbox.__all__:
        assert hasattr(sandbox, name)


async def test_supervisor_owns_and_releases(state_dir, boot_id, leak_check):
    sup = SandboxSupervisor(default_backend="bwrap", state_dir=state_dir, boot_id=boot_id)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        a = await sup.open(SandboxSpec())
        b = await sup.open(SandboxSpec(backend="local"))
        assert (a.backend, b.backend) == ("bwrap", "local")
        stats = sup.statistics()
        assert stats["live"] == 2 and stats["opened"] == 2
        assert stats["limits_mechanism"] in ("cgroup-v2", "cgroup-v1", "rlimit")
        assert {d["id"] for d in sup.describe()} == {a.id, b.id}
        assert (await a.run(["echo", "hi"], timeout_s=10)).stdout == b"hi\n"
        await sup.release(a)
        await sup.release(a)  # idempotent
        with pytest.raises(SandboxClosed):
            await a.run(["true"], timeout_s=5)
        assert sup.statistics()["live"] == 1
        await b.spawn(["sh", "-c", "setsid sleep 300 & sleep 300"])
        nursery.cancel_scope.cancel()  # the daemon shuts down: b is torn down too
    assert b.closed
    assert sup.statistics()["live"] == 0


async def test_supervisor_lifetime_releases(state_dir, boot_id, leak_check):
    # real time: sandboxes are real processes (autojump would skip their start-up timeout)
    sup = SandboxSupervisor(default_backend="local", state_dir=state_dir, boot_id=boot_id)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        sb = await sup.open(SandboxSpec(lifetime_s=0.8))
        assert not sb.closed
        with trio.fail_after(5):
            while not sb.closed or sup.statistics()["live"]:
                await trio.sleep(0.05)
        assert "lifetime" in sb.closed_reason or "released" in sb.closed_reason
        nursery.cancel_scope.cancel()


async def test_missing_backend_fails_loudly(state_dir, boot_id):
    sup = SandboxSupervisor(default_backend="bwrap", state_dir=state_dir, boot_id=boot_id,
                            bwrap="/nonexistent/bwrap")
    with pytest.raises(SandboxStartError, match="bwrap"):
        await sup.run()
    sup = SandboxSupervisor(default_backend="apptainer", state_dir=state_dir, boot_id=boot_id,
                            apptainer="/nonexistent/apptainer")
    with pytest.raises(SandboxStartError, match="apptainer"):
        await sup.run()
    sup = SandboxSupervisor(default_backend="docker", state_dir=state_dir, boot_id=boot_id)
    with pytest.raises(SandboxStartError, match="unknown sandbox backend"):
        await sup.run()


async def test_local_backend_warns_on_every_open(state_dir, boot_id, leak_check, caplog):
    from rolloutd.sandbox import open_backend

    backend = open_backend("local", state_dir=state_dir, boot_id=boot_id)
    caplog.set_level(logging.WARNING)
    for _ in range(2):
        async with backend.open(SandboxSpec()):
            pass
    warnings = [r for r in caplog.records if "no isolation" in r.getMessage()]
    assert len(warnings) == 2


CRASHING_DAEMON = textwrap.dedent("""
    import os, sys, trio
    from rolloutd.sandbox import open_backend, SandboxSpec
    async def main():
        backend = open_backend(sys.argv[1], state_dir=sys.argv[2], boot_id="oldboot")
        async with backend.open(SandboxSpec()) as sb:
            await sb.spawn(["sh", "-c", "setsid sleep 300 & sleep 300"])
            print(sb.id, flush=True)
            await trio.sleep_forever()
    trio.run(main)
""")


@pytest.mark.parametrize("name", ["local", "bwrap"])
async def test_sweep_removes_leftovers_of_a_crashed_boot(name, state_dir, boot_id, leak_check):
    old = await trio.lowlevel.open_process(
        [sys.executable, "-c", CRASHING_DAEMON, name, str(state_dir)],
        stdout=subprocess.PIPE, cwd=os.getcwd())
    with trio.fail_after(20):
        line = await old.stdout.receive_some(100)
    assert line.strip()
    old.kill()  # SIGKILL: no cleanup ran
    await old.wait()
    await old.stdout.aclose()
    assert (state_dir / "sandboxes" / "oldboot").is_dir()
    sup = SandboxSupervisor(default_backend=name, state_dir=state_dir, boot_id=boot_id)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        assert sup.statistics()["swept"] == 1
        nursery.cancel_scope.cancel()
    assert not (state_dir / "sandboxes" / "oldboot").exists()
    assert marked_pids("oldboot") == []


async def test_sweep_spares_a_live_sibling(state_dir, boot_id, leak_check):
    from rolloutd.sandbox import open_backend

    sibling = open_backend("local", state_dir=state_dir, boot_id="sibling")
    async with sibling.open(SandboxSpec()) as sb:
        sup = SandboxSupervisor(default_backend="local", state_dir=state_dir, boot_id=boot_id)
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            assert sup.statistics()["swept"] == 0
            nursery.cancel_scope.cancel()
        assert (await sb.run(["true"], timeout_s=10)).exit_code == 0


async def test_warm_pool_serves_matching_specs(state_dir, boot_id, leak_check):
    sup = SandboxSupervisor(default_backend="bwrap", state_dir=state_dir, boot_id=boot_id,
                            pool_size=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        with trio.fail_after(20):
            while sup.statistics()["pool_idle"] < 2:
                await trio.sleep(0.05)
        sb = await sup.open(SandboxSpec())
        assert sup.statistics()["pool_hits"] == 1
        assert (await sb.run(["true"], timeout_s=10)).exit_code == 0
        other = await sup.open(SandboxSpec(memory_mb=128))  # not the template: opened fresh
        assert sup.statistics()["pool_hits"] == 1
        await sup.release(sb)
        await sup.release(other)
        nursery.cancel_scope.cancel()
