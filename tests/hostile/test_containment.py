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
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from rolloutd.sandbox import SandboxSpec, open_backend
from rolloutd.sandbox._layout import boot_tag

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


class WithImage:
    """Test wrapper: a backend whose every open runs in ``image`` (the spec's other fields
    kept), so each workload here runs over the host's root and in a real image."""

    def __init__(self, backend: Any, image: str) -> None:
        self.backend = backend
        self.image = image

    def open(self, spec: SandboxSpec | None = None) -> Any:
        return self.backend.open((spec or SandboxSpec()).model_copy(update={"image": self.image}))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


@pytest.fixture(scope="module")
def image_store_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rlci", dir="/tmp"))  # one unpack per module
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _image_ref(request: pytest.FixtureRequest) -> str:
    """The Debian test image: ROLLOUTD_TEST_IMAGE (the unprivileged run gets a copy), else
    the suite's real test images (tests/_images.py)."""
    ref = os.environ.get("ROLLOUTD_TEST_IMAGE")
    if ref:
        return ref
    images = request.getfixturevalue("test_images")
    return str(images.oci_ref(images.debian_oci))


@pytest.fixture(params=["host-root", "image", "image-prestarted"])
async def bwrap(request: pytest.FixtureRequest, state_dir: Path,
                image_store_dir: Path) -> AsyncIterator[Any]:
    """A bwrap backend (over the host's root, or every sandbox in the Debian test image:
    started on demand, or, with one spare, from a parked image sandbox whose helper already
    runs, which the test's first open takes); afterwards: no sandbox process, fd, sandbox
    dir or mount left."""
    from rolloutd.sandbox.images import ImageStore

    boot = "h" + secrets.token_hex(5)
    image = _image_ref(request) if request.param != "host-root" else None
    fds = _fds()
    store = ImageStore(image_store_dir)
    if image:
        store.resolve(image)  # unpacked before the test (its inodes are not the test's)
    prestarted = request.param == "image-prestarted"
    backend = open_backend("bwrap", state_dir=state_dir, boot_id=boot, check=True,
                           images=store, spares=int(prestarted))
    try:
        if prestarted:
            async with backend.open(SandboxSpec(image=image)):
                pass  # the backend parks image sandboxes from now on
            assert [h.prestarted for h in backend._spares] == [False, True]
        yield WithImage(backend, image) if image else backend
    finally:
        await backend.aclose()
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
from rolloutd.sandbox import SandboxSpec, open_backend

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
        wrote = set(r.stdout.decode().splitlines()) - {"done"}
        if isinstance(bwrap, WithImage):  # the image's root is writable: its overlay takes these
            wrote -= {f"WROTE {t}" for t in ("/etc/passwd", "/etc/evil", "/usr/evil",
                                             "/usr/bin/evil", f"{home}/evil", "/var/evil",
                                             "/opt/evil", sys.executable)}
        assert wrote == set() and r.stdout.endswith(b"done\n"), r.stdout.decode()
        assert (await sb.run(["sh", "-c", "echo ok > /workspace/f && echo ok > /tmp/f && echo both"],
                             timeout_s=10)).stdout == b"both\n"
        assert (other.workspace / "mine.txt").read_text() == "other's\n"
        assert not (other.workspace / "evil").exists()
        await still_works(other)
    assert _digest(watched) == before
    for t in ("/etc/evil", "/usr/evil", f"{home}/evil", "/var/evil", "/opt/evil", f"{state_dir}/evil"):
        assert not os.path.exists(t), t



# Run inside a sandbox: what a process there can do to the helper (PID 1). PTRACE_SEIZE
# traces without stopping it; each /proc/1 entry counts if it opens at all.
AT_THE_HELPER = r'''
import ctypes, os
out = []
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(0x4206, 1, 0, 0) == 0:
    out.append("traced")
for name in ("environ", "mem", "maps", "auxv"):
    try:
        open("/proc/1/" + name, "rb").close()
        out.append("opened " + name)
    except OSError:
        pass
try:
    fds = os.listdir("/proc/1/fd")
except OSError:
    fds = [str(n) for n in range(64)]
for fd in fds:
    for flags in (os.O_WRONLY | os.O_APPEND, os.O_RDONLY):
        try:
            f = os.open("/proc/1/fd/" + fd, flags | os.O_NONBLOCK)
        except OSError:
            continue
        out.append("opened fd " + fd)
        try:
            os.write(f, b"PWNED\n")
        except OSError:
            pass
        os.close(f)
try:
    with open("/proc/1/oom_score_adj", "w") as f:
        f.write("1000")
    out.append("raised oom_score_adj")
except OSError:
    pass
for fd in os.listdir("/proc/self/fd"):  # and nothing of the host in this command's fds
    try:
        link = os.readlink("/proc/self/fd/" + fd)
    except OSError:  # the listing's own fd
        continue
    if link.startswith("/") and link != "/dev/null":
        out.append("own fd %s %s" % (fd, link))
print("\n".join(out))
'''


def _helper_fds(sb: Any) -> list[str]:
    """Where the helper's fds lead, seen from the host (its pid is the launcher's child)."""
    from rolloutd.sandbox._backend import first_child

    launcher = int((sb.control_dir.parent / "pid").read_text().split()[0])
    helper = first_child(launcher)
    assert helper is not None
    fd_dir = f"/proc/{helper}/fd"
    return [os.readlink(f"{fd_dir}/{fd}") for fd in os.listdir(fd_dir)]


async def test_the_helper_cannot_be_traced_or_reached_through_its_fds(bwrap: Any,
                                                                    state_dir: Path) -> None:
    """No process of a sandbox can trace the helper, read its memory or environment, or open
    its fds through /proc/1/fd (it is not dumpable); its fds hold nothing of the host (its
    stderr is a pipe to the daemon), nor do those of the commands it starts. Before: the
    helper's stderr was the host's helper.log, and `echo x >> /proc/1/fd/2` wrote there."""
    async with bwrap.open(SandboxSpec()) as sb:
        busy = await sb.spawn(["sleep", "30"])  # the helper holds that one's pipes too
        r = await sb.run([sb.python, "-c", AT_THE_HELPER], timeout_s=20)
        assert r.exit_code == 0, r
        found = set(r.stdout.decode().splitlines()) - {""}
        if os.geteuid() == 0 or isinstance(bwrap, WithImage):
            # As root the sandbox's uid 0 is host uid 0, and in an image it is its user
            # namespace's root: either way it owns /proc/1's files even though the helper is
            # not dumpable, so raising its oom_score_adj is a documented residual.
            found.discard("raised oom_score_adj")
        if os.geteuid() == 0:
            # pipes, sockets, /dev/null, its own /proc/1/oom_score_adj: no path of the host
            assert not [link for link in _helper_fds(sb) if link.startswith("/")
                        and link != "/dev/null" and not link.startswith("/proc/1/")]
        assert found == set(), r
        r = await sb.run(["sh", "-c", "for f in /proc/1/fd/*; do echo x >> $f; done 2>/dev/null; "
                          "echo done"], timeout_s=10)
        assert r.stdout == b"done\n"
        await busy.signal(9)
        await busy.wait()
        await busy.aclose()
        await still_works(sb)
        for path in state_dir.rglob("*"):  # nothing on the host got the attack's bytes
            if path.is_file() and not path.is_symlink():
                assert b"PWNED" not in path.read_bytes() and b"x\n" != path.read_bytes(), path


async def test_filling_tmp_and_shm_is_enospc_and_the_helper_lives_on(bwrap: Any) -> None:
    """/tmp, /dev/shm and /run are tmpfs mounts whose pages count against the memory limit:
    each is size-capped well below it, so filling them all is ENOSPC (and /dev is read-only),
    and a memory hog on top of that is OOM-killed, not the helper, whose commands start with
    a higher oom_score_adj than its own. Before: the tmpfs mounts were as big as half the
    host's memory, the helper was killed and the sandbox was lost."""
    async with bwrap.open(SandboxSpec(memory_mb=256)) as sb:
        if sb.limits.get("tmpfs") != "tmpfs-size":
            pytest.skip(f"this bwrap cannot size a tmpfs ({sb.limits.get('tmpfs')})")
        for path in ("/tmp", "/dev/shm", "/run", "/dev"):
            r = await sb.run(["sh", "-c", f"dd if=/dev/zero of={path}/fill bs=1M count=1024 2>&1"],
                             timeout_s=60)
            assert r.exit_code == 1, (path, r)
            why = b"Read-only file system" if path == "/dev" else b"No space left on device"
            assert why in r.stdout, (path, r)
            await still_works(sb)
        hog = "x = []\nwhile True: x.append(bytearray(8 << 20))"
        r = await sb.run([sb.python, "-c", hog], timeout_s=60)
        assert r.exit_code != 0 and not r.timed_out, r  # SIGKILL (cgroup) or MemoryError (rlimit)
        await still_works(sb)
        r = await sb.run(["cat", "/proc/1/oom_score_adj", "/proc/self/oom_score_adj"], timeout_s=10)
        helper, command = (int(v) for v in r.stdout.split())
        assert command == min(1000, helper + 1000), r
        r = await sb.run(["sh", "-c", "df -k /tmp /dev/shm /run | tail -n 3"], timeout_s=10)
        total_kb = sum(int(line.split()[1]) for line in r.stdout.decode().splitlines())
        assert total_kb < (256 << 10) * 3 // 4, r.stdout  # all three full leave a quarter or more
