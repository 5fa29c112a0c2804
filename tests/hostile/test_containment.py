"""Hostile workloads against the bwrap backend that tests/sandbox/test_hostile.py does not
cover: thread bomb, CPU burn, inode fill, fd exhaustion, TIOCSTI, writes to the host.

Imports only ``sandbox`` (and trio/pytest), so test_nonroot_hostile.py can run this file
again as an unprivileged user. Every test ends with no sandbox process, fd, dir or mount
left (the ``bwrap`` fixture checks).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from sandbox import SandboxSpec, open_backend
from sandbox._layout import boot_tag

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def _marked(tag: str) -> list[int]:
    needle = f"ROLLOUTD_SANDBOX={tag}/".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if needle in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


def _fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _mounts(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(path))]


@pytest.fixture
def state_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rlc", dir="/tmp"))  # short: socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def bwrap(state_dir: Path) -> Iterator[Any]:
    """A bwrap backend; afterwards: no sandbox process, fd, sandbox dir or mount left."""
    boot = "h" + secrets.token_hex(5)
    fds = _fds()
    yield open_backend("bwrap", state_dir=state_dir, boot_id=boot, check=True)
    assert _marked(boot_tag(boot)) == [], "sandbox processes leaked"
    assert _fds() - fds == set(), "fds leaked"
    boxes = state_dir / "sandboxes"
    assert not boxes.exists() or list(boxes.rglob("*")) == [], "sandbox dirs leaked"
    assert _mounts(state_dir) == [], "mounts leaked"


async def still_works(sb: Any) -> None:
    r = await sb.run(["echo", "alive"], timeout_s=10)
    assert r.stdout == b"alive\n", r


async def test_thread_bomb_is_capped(bwrap: Any) -> None:
    """Threads are tasks: pids.max (or RLIMIT_NPROC) caps them like processes."""
    bomb = ("import threading, time\n"
            "n = 0\n"
            "try:\n"
            "    while n < 100000:\n"
            "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); n += 1\n"
            "except (RuntimeError, MemoryError) as e: print('stopped', n, flush=True)\n"
            "import os; os._exit(0)\n")
    async with bwrap.open(SandboxSpec(pids_max=64, memory_mb=512)) as sb:
        if sb.limits["pids"] not in ("cgroup-v1", "cgroup-v2", "rlimit-nproc"):
            pytest.skip(f"no pids limit here ({sb.limits['pids']})")
        r = await sb.run([sb.python, "-c", bomb], timeout_s=30)
        assert r.stdout.startswith(b"stopped"), r
        assert int(r.stdout.split()[1]) < 64
        await still_works(sb)


async def test_cpu_burn_is_throttled_and_the_daemon_stays_responsive(bwrap: Any) -> None:
    """Two busy loops in a 0.5-core sandbox get about 0.5 core; our event loop keeps ticking."""
    burn = ("import os, time\n"
            "for _ in range(2):\n"
            "    if os.fork() == 0:\n"
            "        end = time.monotonic() + 2\n"
            "        while time.monotonic() < end: pass\n"
            "        os._exit(0)\n"
            "os.wait(); os.wait()\n"
            "t = os.times(); print(t.children_user + t.children_system)\n")
    async with bwrap.open(SandboxSpec(cpu_cores=0.5)) as sb:
        lags: list[float] = []

        async def ticker() -> None:
            while True:
                t0 = trio.current_time()
                await trio.sleep(0.05)
                lags.append(trio.current_time() - t0 - 0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            r = await sb.run([sb.python, "-c", burn], timeout_s=30)
            nursery.cancel_scope.cancel()
        cpu_s = float(r.stdout)
        if sb.limits["cpu"] in ("cgroup-v1", "cgroup-v2"):
            assert cpu_s < 1.6, f"{cpu_s:.2f} CPU-s in 2 s wall at 0.5 core"
        assert max(lags) < 1.0, f"event loop stalled {max(lags):.2f} s"
        await still_works(sb)


async def test_inode_fill_is_bounded(bwrap: Any, state_dir: Path) -> None:
    """Empty files cost no blocks: the workspace tmpfs caps inodes; /tmp is a tmpfs of the
    sandbox's own (never the host's inodes) and a flood there ends with the command's timeout."""
    fill = "i=0; while true 2>/dev/null > f$i; do i=$((i+1)); done; echo made $i"
    host = os.statvfs(state_dir).f_ffree
    async with bwrap.open(SandboxSpec(disk_mb=16)) as sb:
        if sb.limits["disk"] == "tmpfs-workspace":
            r = await sb.run(["sh", "-c", fill], timeout_s=60)
            made = int(r.stdout.split()[1])
            assert not r.timed_out and 1000 < made <= 4096, r
        r = await sb.run(["sh", "-c", f"cd /tmp && {fill}"], timeout_s=3)
        assert r.timed_out or r.exit_code == 0
        await still_works(sb)
        t0 = trio.current_time()
    assert trio.current_time() - t0 < 5  # teardown of many files is quick
    assert abs(os.statvfs(state_dir).f_ffree - host) < 5000  # host inodes untouched


async def test_fd_exhaustion_hits_emfile_inside(bwrap: Any) -> None:
    """An fd flood stops at RLIMIT_NOFILE inside; the daemon's fds are unaffected."""
    flood = ("import os\n"
             "fds = []\n"
             "try:\n"
             "    while True: fds.append(os.open('/dev/null', os.O_RDONLY))\n"
             "except OSError as e: print(e.errno, len(fds))\n")
    ours = len(_fds())
    async with bwrap.open(SandboxSpec()) as sb:
        r = await sb.run([sb.python, "-c", flood], timeout_s=30)
        errno_, count = (int(x) for x in r.stdout.split())
        assert errno_ == 24 and count < 5000, r  # EMFILE at the sandbox's own limit
        assert len(_fds()) <= ours + 4
        await still_works(sb)


TIOCSTI_CHILD = r'''
import fcntl, json, os, sys, termios, trio
from sandbox import SandboxSpec, open_backend

ATTACK = ("import fcntl, termios, os\n"
          "for fd in (0, 1, 2):\n"
          "    try: fcntl.ioctl(fd, termios.TIOCSTI, b'X'); print('injected', fd)\n"
          "    except OSError as e: print('fd', fd, e.errno)\n"
          "try: os.open('/dev/tty', os.O_RDWR); print('tty opened')\n"
          "except OSError as e: print('no tty', e.errno)\n")

async def main():
    be = open_backend("bwrap", state_dir=sys.argv[1], boot_id=sys.argv[2], check=True)
    async with be.open(SandboxSpec()) as sb:
        r = await sb.run([sb.python, "-c", ATTACK], timeout_s=20)
        p = await sb.spawn([sb.python, "-c", ATTACK], pty=True)
        await p.wait()
        os.close(p.pty_fd)
        await p.aclose()
    os.set_blocking(0, False)
    try:
        got = os.read(0, 100)
    except BlockingIOError:
        got = b""
    print(json.dumps({"run": r.stdout.decode(), "tty_input": got.decode(errors="replace")}))

trio.run(main)
'''


async def test_tiocsti_cannot_reach_the_daemon_terminal(bwrap: Any, state_dir: Path) -> None:
    """CVE-2017-5226: a sandboxed process must not push input into the terminal of the process
    that started it. The stand-in daemon runs on a pty as its controlling terminal."""
    master, slave = os.openpty()

    def as_session_leader() -> None:
        os.setsid()
        import fcntl
        import termios

        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    boot = "h" + secrets.token_hex(5)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        proc = await trio.run_process(
            [sys.executable, "-c", TIOCSTI_CHILD, str(state_dir), boot],
            stdin=slave, capture_stdout=True, capture_stderr=True, check=False, env=env,
            preexec_fn=as_session_leader,
        )
    finally:
        os.close(slave)
        os.close(master)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    out = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert "injected" not in out["run"] and "tty opened" not in out["run"], out
    assert out["tty_input"] == "", f"injected into the daemon's terminal: {out}"
    assert _marked(boot_tag(boot)) == []


def _digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        try:
            h.update(p.read_bytes())
        except OSError:
            h.update(b"-")
    return h.hexdigest()


async def test_writes_to_the_host_fail(bwrap: Any, state_dir: Path) -> None:
    """The host root is read-only, the state dir hidden, other workspaces invisible."""
    watched = [Path("/etc/passwd"), Path("/etc/hostname"), Path(sys.executable).resolve()]
    before = _digest(watched)
    home = Path.home()
    async with bwrap.open(SandboxSpec()) as other, bwrap.open(SandboxSpec()) as sb:
        (other.workspace / "mine.txt").write_text("other's\n")
        targets = ["/etc/passwd", "/etc/evil", "/usr/evil", "/usr/bin/evil", f"{home}/evil",
                   f"{home}/.ssh/authorized_keys", "/var/evil", "/opt/evil",
                   f"{other.workspace}/mine.txt", f"{other.workspace}/evil", "/sys/kernel/evil",
                   sys.executable]
        script = "; ".join(f"(echo pwned >> {t}) 2>/dev/null && echo WROTE {t}" for t in targets)
        # A host-wide sysctl, written with its own value (so a regression changes nothing);
        # as root this succeeded before /proc/sys was bound read-only (sandbox/_bwrap.py).
        script += ('; v=$(cat /proc/sys/kernel/core_pattern); '
                   '(echo "$v" > /proc/sys/kernel/core_pattern) 2>/dev/null && echo WROTE sysctl')
        # /proc/irq is bwrap's own to cover (we no longer bind it): still read-only
        script += ('; v=$(cat /proc/irq/default_smp_affinity 2>/dev/null) && '
                   '(echo "$v" > /proc/irq/default_smp_affinity) 2>/dev/null && echo WROTE irq')
        # The state dir is hidden under a tmpfs of the sandbox's own: a write lands there.
        script += f"; echo x > {state_dir}/evil"
        r = await sb.run(["sh", "-c", script + "; echo done"], timeout_s=20)
        assert r.stdout == b"done\n", r.stdout.decode()
        assert (await sb.run(["sh", "-c", "echo ok > /workspace/f && echo ok > /tmp/f && echo both"],
                             timeout_s=10)).stdout == b"both\n"
        assert (other.workspace / "mine.txt").read_text() == "other's\n"
        assert not (other.workspace / "evil").exists()
        await still_works(other)
    assert _digest(watched) == before
    for t in ("/etc/evil", "/usr/evil", f"{home}/evil", "/var/evil", "/opt/evil", f"{state_dir}/evil"):
        assert not os.path.exists(t), t

