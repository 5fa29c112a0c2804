"""Where sandboxes live on the host, and how they are labelled for the orphan sweep.

    <state_dir>/lib/<digest>/            the helper and a copy of ptyprocess (read-only
                                         inside every sandbox; reachable by any user)
    <state_dir>/sandboxes/<boot tag>/<id>/
        lock        flock held by the owning daemon while the sandbox lives
        pid         "<pid> <start time>" of the sandbox's first host process
        ws/         the workspace
        c/          the control dir (same absolute path inside; holds h.sock)
        tmp/        local backend only: the sandbox's TMPDIR

The boot tag ties a sandbox to the daemon boot that made it. The sweep removes the
sandboxes of other boots whose lock is free (their daemon is dead); a sibling daemon
sharing the state dir holds its locks and is left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ._exceptions import SandboxStartError

#: The helper and what it imports from its own dir (_stage.py: image sandboxes only).
HELPER_SOURCES = tuple(Path(__file__).with_name(n) for n in ("_helper.py", "_stage.py"))
SOCKET_NAME = "h.sock"
_SUN_PATH_MAX = 107


def boot_tag(boot_id: str) -> str:
    """A short, path-safe form of the boot id (used in dir and cgroup names)."""
    if re.fullmatch(r"[A-Za-z0-9_-]{1,16}", boot_id):
        return boot_id
    return hashlib.sha256(boot_id.encode()).hexdigest()[:16]


@dataclass
class SandboxDirs:
    id: str
    boot_tag: str
    root: Path
    lock_fd: int

    @property
    def workspace(self) -> Path:
        return self.root / "ws"

    @property
    def control(self) -> Path:
        return self.root / "c"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def socket_path(self) -> str:
        return str(self.control / SOCKET_NAME)

    @property
    def marker(self) -> str:
        return f"{self.boot_tag}/{self.id}"

    def write_pid(self, pid: int) -> None:
        (self.root / "pid").write_text(f"{pid} {process_start_time(pid)}\n")

    def release(self) -> None:
        """Remove the dirs and drop the lock (sync; after every process is gone)."""
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.root.parent.rmdir()  # the boot dir, once empty
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)
        self.lock_fd = -1


class Layout:
    """``python``: the helper's interpreter, which byte-compiles the lib dir once (inside
    a sandbox it is read-only, so nothing there would ever be cached: compiling the
    helper cost ~4 ms of every start, ptyprocess more at every first pty spawn)."""

    def __init__(self, state_dir: Path | str, boot_id: str, python: str | None = None) -> None:
        self.state_dir = Path(state_dir).absolute()
        self.boot_tag = boot_tag(boot_id)
        self.sandboxes = self.state_dir / "sandboxes"
        self.python = python
        self._lib: Path | None = None

    def lib_dir(self) -> Path:
        """Install (once) the helper and ptyprocess where every sandbox can read them,
        byte-compiled by ``python``."""
        if self._lib is not None:
            return self._lib
        import ptyprocess

        pty_src = Path(ptyprocess.__file__).parent
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in HELPER_SOURCES))
        digest.update(ptyprocess.__version__.encode())
        lib = self.state_dir / "lib" / digest.hexdigest()[:12]
        if not (lib / "_helper.py").exists():
            tmp = lib.with_name(lib.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for source in HELPER_SOURCES:
                shutil.copy(source, tmp / source.name)
            shutil.copytree(pty_src, tmp / "ptyprocess",
                            ignore=shutil.ignore_patterns("__pycache__"))
            for path in [tmp, *tmp.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            try:
                tmp.rename(lib)
            except OSError:  # another daemon won the race
                shutil.rmtree(tmp, ignore_errors=True)
        if self.python and not list(lib.glob("__pycache__/_helper.*.pyc")):
            # compiled in place (tracebacks name these paths); a failure only costs speed
            subprocess.run([self.python, "-I", "-S", "-m", "compileall", "-q", str(lib)],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=60, check=False)
            for path in lib.rglob("__pycache__"):
                path.chmod(0o755)
                for pyc in path.iterdir():
                    pyc.chmod(0o644)
        self.state_dir.chmod(self.state_dir.stat().st_mode | 0o711)
        (self.state_dir / "lib").chmod(0o755)
        self._lib = lib
        return lib

    def new(self) -> SandboxDirs:
        boot_dir = self.sandboxes / self.boot_tag
        sandbox_id = secrets.token_hex(6)
        root = boot_dir / sandbox_id
        for attempt in range(5):  # a closing sandbox may remove the empty boot dir meanwhile
            boot_dir.mkdir(parents=True, exist_ok=True)
            try:
                root.mkdir(mode=0o700)
                break
            except FileNotFoundError:
                if attempt == 4:
                    raise
        fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        dirs = SandboxDirs(sandbox_id, self.boot_tag, root, fd)
        dirs.workspace.mkdir()
        dirs.control.mkdir(mode=0o700)
        if len(dirs.socket_path) > _SUN_PATH_MAX:
            dirs.release()
            raise SandboxStartError(f"state_dir {self.state_dir} is too long: the helper socket "
                                    f"path would exceed {_SUN_PATH_MAX} bytes")
        return dirs

    def orphans(self) -> list[tuple[str, str, Path]]:
        """(boot tag, sandbox id, dir) of every sandbox of another boot whose owner is gone."""
        found: list[tuple[str, str, Path]] = []
        if not self.sandboxes.is_dir():
            return found
        for boot_dir in self.sandboxes.iterdir():
            if boot_dir.name == self.boot_tag or not boot_dir.is_dir():
                continue
            for root in boot_dir.iterdir():
                if root.is_dir() and not _locked(root / "lock"):
                    found.append((boot_dir.name, root.name, root))
        return found


def _locked(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def process_start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def kill_recorded(root: Path) -> None:
    """SIGKILL the process group recorded in a sandbox's pid file, if it is still that one."""
    try:
        pid_s, start = (root / "pid").read_text().split()
    except (OSError, ValueError):
        return
    pid = int(pid_s)
    if process_start_time(pid) == start:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` (deepest first)."""
    prefix = str(path)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return sorted(found, key=len, reverse=True)
