"""Hostile workloads against the bwrap backend. Each asserts that the sandbox contains it
and the daemon stays healthy (this process is fine, a sibling sandbox still works).
Every case is bounded: pids and memory limits, a size-capped workspace, timeouts.

The local backend contains none of: kill -9 -1 (it would kill the daemon), network
egress, reading the daemon's /proc and environment, disk fill; it contains the fork
bomb, memory bomb and escapees only through cgroups (root here). See docs/sandbox.md.
"""

from __future__ import annotations

import os
import socket

import pytest
import trio

from rolloutd.sandbox import PathEscapeError, SandboxSpec

from .conftest import WithImage, marked_pids


@pytest.fixture(params=["host-root", "image", "image-prestarted"])
async def bwrap(request, bwrap):
    """Every hostile workload three times: over the host's root, and in a real Debian image
    (the session's image store; tests/_images.py), started on demand and from a parked
    image sandbox whose helper was already running (one spare; the workload's sandbox is
    the first open, so it is the prestarted one)."""
    if request.param == "host-root":
        yield bwrap
        return
    images = request.getfixturevalue("test_images")
    bwrap.images = request.getfixturevalue("image_store")
    image = WithImage(bwrap, images.oci_ref(images.debian_oci))
    if request.param == "image":
        yield image
        return
    bwrap.spares = 1
    async with image.open():
        pass  # the backend parks image sandboxes from now on
    assert [h.prestarted for h in bwrap._spares] == [False, True]
    try:
        yield image
    finally:
        await bwrap.aclose()


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def assert_healthy(backend) -> None:
    async with backend.open(SandboxSpec()) as sb:
        r = await sb.run(["echo", "alive"], timeout_s=10)
        assert r.stdout == b"alive\n"


async def test_fork_bomb_is_capped_by_pids(bwrap, leak_check):
    async with bwrap.open(SandboxSpec(pids_max=64)) as sb:
        if not sb.limits["pids"].startswith("cgroup"):
            pytest.skip(f"no cgroup pids limit here ({sb.limits['pids']})")
        r = await sb.run(["sh", "-c", "b(){ b | b & }; b"], timeout_s=2)
        assert r.exit_code is not None or r.timed_out
        with trio.fail_after(10):
            while len(marked_pids(leak_check.tag)) > 1:
                await trio.sleep(0.1)
        assert (await sb.run(["echo", "still here"], timeout_s=10)).exit_code == 0
    await assert_healthy(bwrap)


async def test_memory_bomb_is_killed(bwrap):
    before = rss_mb()
    async with bwrap.open(SandboxSpec(memory_mb=128)) as sb:
        script = "x = []\nwhile True: x.append(bytearray(16 << 20))"
        r = await sb.run(["python3", "-c", script], timeout_s=30)
        assert r.exit_code != 0 and not r.timed_out
        assert (await sb.run(["echo", "ok"], timeout_s=10)).exit_code == 0
    assert rss_mb() - before < 50
    await assert_healthy(bwrap)


async def test_output_flood_is_capped_and_drained(bwrap):
    before = rss_mb()
    async with bwrap.open(SandboxSpec()) as sb:
        r = await sb.run(["sh", "-c", "head -c 100000000 /dev/zero; echo done >&2"], timeout_s=60)
        assert r.exit_code == 0 and r.truncated and not r.timed_out
        assert len(r.stdout) <= 1_000_100 and r.stderr == b"done\n"
        r = await sb.run(["yes"], timeout_s=1, max_output_bytes=4096)  # endless: the timeout ends it
        assert r.timed_out and r.truncated and len(r.stdout) < 4200
    assert rss_mb() - before < 50
    await assert_healthy(bwrap)


async def test_kill_minus_one_stays_inside(bwrap):
    async with bwrap.open(SandboxSpec()) as sibling, bwrap.open(SandboxSpec()) as sb:
        survivor = await sibling.spawn(["sleep", "2"])
        victim = await sb.spawn(["sleep", "300"])
        r = await sb.run(["sh", "-c", "kill -9 -1; echo after"], timeout_s=10)
        assert r.stdout == b"after\n"  # kill -1 spares the caller and init (the helper)
        with trio.fail_after(10):
            assert await victim.wait() == -9  # everything else in the sandbox died
            assert await survivor.wait() == 0  # the sibling sandbox was untouched
        assert (await sb.run(["echo", "helper alive"], timeout_s=10)).exit_code == 0
        await survivor.aclose()
        await victim.aclose()
    os.kill(os.getpid(), 0)
    await assert_healthy(bwrap)


async def test_no_network_egress(bwrap):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    probe = ("import socket,sys\n"
             "try:\n"
             f"    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')\n"
             "except OSError as e: print('refused', e)\n"
             "try:\n"
             "    socket.create_connection(('1.1.1.1', 80), timeout=2); print('egress')\n"
             "except OSError as e: print('no route', e)\n")
    try:
        async with bwrap.open(SandboxSpec()) as sb:
            r = await sb.run(["python3", "-c", probe], timeout_s=20)
            assert b"connected" not in r.stdout and b"egress" not in r.stdout
            assert r.duration_s < 10
            r = await sb.run(["sh", "-c", "cat /proc/net/dev | grep -c :"], timeout_s=10)
            assert r.stdout.strip() == b"1"  # loopback only
        async with bwrap.open(SandboxSpec(network=True)) as sb:  # asked for: host network
            r = await sb.run(["python3", "-c", probe.split("try:\n    socket.create_connection(('1.1")[0]],
                             timeout_s=20)
            assert b"connected" in r.stdout
    finally:
        listener.close()


async def test_cannot_read_daemon_proc_or_environment(bwrap, monkeypatch):
    monkeypatch.setenv("ROLLOUTD_TEST_SECRET", "s3cr3t-token")
    in_image = isinstance(bwrap, WithImage)
    async with bwrap.open(SandboxSpec(env={"VISIBLE": "yes"})) as sb:
        r = await sb.run(["sh", "-c", "cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline; env"],
                         timeout_s=10)
        assert b"s3cr3t-token" not in r.stdout and b"pytest" not in r.stdout
        env = dict(line.split("=", 1) for line in
                   (await sb.run(["env"], timeout_s=10)).stdout.decode().splitlines())
        assert env["VISIBLE"] == "yes" and "ROLLOUTD_TEST_SECRET" not in env
        assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM",
                            "PAGER", "GIT_PAGER", "VISIBLE", "ROLLOUTD_SANDBOX", "ROLLOUTD_RUN",
                            "PWD", "SHLVL", "_", "OLDPWD", *(["ROLLOUTD_IMAGE"] if in_image else [])}
        r = await sb.run(["sh", "-c", "ls /proc | grep -c '^[0-9]'"], timeout_s=10)
        assert int(r.stdout) <= 4  # helper, sh, ls, grep: no host process is visible
        r = await sb.run(["cat", "/etc/shadow"], timeout_s=10)
        if in_image:  # the image's own file, never the host's
            assert r.stdout and b"rolloutd-test" not in r.stdout
        else:
            assert r.stdout == b""
        async with bwrap.open(SandboxSpec()) as other:
            r = await sb.run(["ls", "-R", str(bwrap.layout.state_dir)], timeout_s=10)
            assert other.id.encode() not in r.stdout  # other sandboxes' dirs are hidden
            assert sb.id.encode() in r.stdout
        r = await sb.run(["sh", "-c", "touch /usr/evil || echo ro"], timeout_s=10)
        # the host's root is read-only; an image's takes the write on its overlay
        assert r.stdout == (b"" if in_image else b"ro\n") and not os.path.exists("/usr/evil")


async def test_symlinks_through_the_file_helper(bwrap):
    async with bwrap.open(SandboxSpec()) as sb:
        await sb.run(["sh", "-c", "ln -s / root; ln -s /etc etc"], timeout_s=10)
        for path in ("root/etc/passwd", "root/proc/1/environ", "etc/hostname"):
            with pytest.raises(PathEscapeError):
                await sb.read_file(path)
        with pytest.raises(PathEscapeError):
            await sb.write_file("root/usr/x", b"x")
        # a racer swapping a dir and a symlink to / never gets the helper outside
        # d/f is written before the racer starts (a read must never see it half-written)
        await sb.run(["sh", "-c", "mkdir -p d; echo inside > d/f"], timeout_s=10)
        racer = await sb.spawn(["sh", "-c", "while :; do "
                                "mv d d.real; ln -s / d; rm d; mv d.real d; done"])
        for _ in range(200):
            try:
                data = await sb.read_file("d/f")
                assert data == b"inside\n"
            except (PathEscapeError, FileNotFoundError):
                pass
        await racer.signal(9)
        await racer.wait()
        await racer.aclose()


async def test_zombie_factory_is_reaped(bwrap):
    script = ("import os, time\n"
              "for _ in range(200):\n"
              "    if os.fork() == 0: os._exit(0)\n"
              "time.sleep(0.5)\n"
              "z = sum(open(f'/proc/{p}/stat').read().split(')')[1].split()[0] == 'Z'\n"
              "        for p in os.listdir('/proc') if p.isdigit())\n"
              "print(z)\n")
    async with bwrap.open(SandboxSpec()) as sb:
        r = await sb.run(["python3", "-c", script], timeout_s=30)
        assert int(r.stdout) >= 100  # the factory really made zombies (it never waits)
        await trio.sleep(0.2)
        r = await sb.run(["sh", "-c", "grep -l '^[0-9]* ([^)]*) Z' /proc/[0-9]*/stat | wc -l"],
                         timeout_s=10)
        assert r.stdout.strip() == b"0"  # once the parent is gone the helper reaped them all


async def test_disk_fill_hits_enospc(bwrap, state_dir):
    def free(path: str) -> int:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    host_free = free(str(state_dir))
    async with bwrap.open(SandboxSpec(disk_mb=16)) as sb:
        r = await sb.run(["sh", "-c", "dd if=/dev/zero of=/tmp/fill bs=1M count=64 2>&1; echo rc=$?"],
                         timeout_s=30)
        assert b"No space left" in r.stdout
        if sb.limits["disk"] == "tmpfs-workspace":
            r = await sb.run(["sh", "-c", "dd if=/dev/zero of=fill bs=1M count=64 2>&1"],
                             timeout_s=30)
            assert b"No space left" in r.stdout
        assert (await sb.run(["echo", "ok"], timeout_s=10)).exit_code == 0
    assert abs(free(str(state_dir)) - host_free) < 32 << 20  # the host disk was untouched
    await assert_healthy(bwrap)


async def test_helper_is_immune_to_signals_from_inside(bwrap, leak_check):
    """The helper is the PID namespace's init: signals from inside cannot end it."""
    async with bwrap.open(SandboxSpec()) as sb:
        proc = await sb.spawn(["sleep", "300"])
        await proc.aclose()
        for sig in ("KILL", "TERM", "INT", "HUP"):
            r = await sb.run(["sh", "-c", f"kill -{sig} 1; echo sent"], timeout_s=10)
            assert r.stdout == b"sent\n"
        assert (await sb.run(["echo", "alive"], timeout_s=10)).stdout == b"alive\n"
    assert marked_pids(leak_check.tag) == []


async def test_sandbox_stderr_is_a_capped_pipe_never_a_host_file(state_dir, boot_id, leak_check):
    """What a sandbox's first process (the launcher, then bwrap and the helper) writes on
    stderr goes to a non-blocking pipe the daemon reads: a flood neither grows a host file
    (before: <sandbox dir>/helper.log, uncapped) nor holds the writer up, and the daemon
    keeps at most LOG_MAX_BYTES of it."""
    from rolloutd.sandbox._launcher import LOG_MAX_BYTES, Launcher
    from rolloutd.sandbox._layout import Layout

    dirs = Layout(state_dir, boot_id).new()
    flood = "head -c 10000000 /dev/zero | tr '\\0' x >&2; echo done"
    launcher = Launcher.start(dirs, None, ["/bin/sh", "-c", flood], {"PATH": "/usr/bin:/bin"})
    try:
        await launcher.go()
        assert launcher.process.stdout is not None
        with trio.fail_after(20):
            assert await launcher.process.stdout.receive_some(64) == b"done\n"
            await launcher.process.wait()
        await launcher.process.stdout.aclose()
        on_disk = sum(p.stat().st_size for p in dirs.root.rglob("*") if p.is_file())
        assert on_disk < 4096, list(dirs.root.rglob("*"))
        said = launcher.log()
        assert said.startswith("x" * 1000) and len(said) <= LOG_MAX_BYTES
    finally:
        launcher.close_log()
        dirs.release()
