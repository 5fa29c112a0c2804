"""The backend base class: the open/teardown protocol every backend shares.

Opening a sandbox: make its dirs (lock held), create its cgroup (or plan rlimits), start
the backend's wrapper with the helper as its command, wait for the helper's ``READY``
line, yield a Sandbox. Teardown (shielded, bounded, idempotent): ask the helper to kill
everything, SIGKILL the wrapper's process group, reap it, kill and remove the cgroup,
unmount, remove the dirs. The backend-specific part is ``_command`` (and the optional
``_prepare``/``_finish`` hooks that Apptainer uses for its instance).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import trio

from ._child import ChildProcess
from ._exceptions import SandboxClosed, SandboxStartError
from ._layout import Layout, SandboxDirs, kill_marked, kill_recorded, mounts_under
from ._limits import LimitPlan, Limits
from ._models import SandboxSpec
from ._protocol import HelperClient
from ._sandbox import Sandbox

log = logging.getLogger(__name__)

MARKER_NAME = "ROLLOUTD_SANDBOX"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV_ALLOW = ("LANG", "LC_ALL", "LC_CTYPE", "TZ")


def default_helper_python() -> str:
    """A real interpreter (not a pyenv shim) every user can run: Debian's python3 if
    present, else this process's interpreter with symlinks resolved."""
    if os.access("/usr/bin/python3", os.X_OK):
        return "/usr/bin/python3"
    return os.path.realpath(sys.executable)


@dataclass
class Handle:
    """Everything one sandbox holds on the host; teardown releases what exists."""

    dirs: SandboxDirs
    plan: LimitPlan | None = None
    process: ChildProcess | None = None
    mounted: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    torn_down: bool = False


class Backend:
    """Base of the three backends. Options (all keyword, all optional):

    limits: "auto" | "cgroup-v2" | "cgroup-v1" | "rlimit"; cgroup_v2_root: a delegated
    v2 subtree; helper_python: interpreter for the helper (bwrap, local);
    start_timeout_s, teardown_timeout_s; env_allow: host variables passed through.
    """

    name: ClassVar[str] = "?"
    isolated: ClassVar[bool] = True

    def __init__(self, *, state_dir: Path | str, boot_id: str, limits: str = "auto",
                 cgroup_v2_root: str | None = None, helper_python: str | None = None,
                 start_timeout_s: float = 15.0, teardown_timeout_s: float = 5.0,
                 env_allow: tuple[str, ...] = ENV_ALLOW, **options: Any) -> None:
        self.layout = Layout(state_dir, boot_id)
        self.limits = Limits(limits, cgroup_v2_root)
        self.helper_python = helper_python or default_helper_python()
        self.start_timeout_s = start_timeout_s
        self.teardown_timeout_s = teardown_timeout_s
        self.env_allow = tuple(env_allow)
        self.options = options
        self.live: dict[str, Sandbox] = {}
        self.opened = 0
        self.closed = 0
        self.start_failures = 0

    # ----- hooks -----------------------------------------------------------------------
    def check(self) -> None:
        """Raise SandboxStartError if this backend cannot run here."""

    def _command(self, spec: SandboxSpec, handle: Handle, helper: list[str]) -> list[str]:
        raise NotImplementedError

    def _workdir(self, spec: SandboxSpec, handle: Handle) -> str:
        return spec.workdir

    def _roots(self, spec: SandboxSpec, handle: Handle) -> list[str]:
        return [self._workdir(spec, handle), "/tmp", *(b.dest for b in spec.binds)]

    def _parent_death(self) -> bool:
        return False

    async def _prepare(self, spec: SandboxSpec, handle: Handle) -> None:
        """Backend work before the helper starts (Apptainer: image, overlay, instance)."""

    async def _finish(self, handle: Handle) -> None:
        """Backend work after the helper is gone (Apptainer: instance stop)."""

    def _disk_mechanism(self, spec: SandboxSpec, handle: Handle) -> str:
        if spec.disk_mb is None:
            return "off"
        if os.geteuid() == 0 and _mount_tmpfs(handle.dirs.workspace, spec.disk_mb):
            handle.mounted.append(str(handle.dirs.workspace))
            return "tmpfs-workspace"
        return "unenforced"

    # ----- open ------------------------------------------------------------------------
    def sandbox_env(self, spec: SandboxSpec, home: str, tmp: str) -> dict[str, str]:
        env = {"PATH": DEFAULT_PATH, "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8",
               "TERM": "xterm-256color", "PAGER": "cat", "GIT_PAGER": "cat"}
        env.update({k: os.environ[k] for k in self.env_allow if k in os.environ})
        env.update(spec.env)
        return env

    @asynccontextmanager
    async def open(self, spec: SandboxSpec | None = None) -> AsyncIterator[Sandbox]:
        """Open a sandbox; it is torn down (shielded, bounded) when the block exits."""
        spec = spec or SandboxSpec()
        if spec.backend not in (None, self.name):
            raise SandboxStartError(f"spec asks for backend {spec.backend!r}, not {self.name!r}")
        handle = Handle(self.layout.new())
        sandbox: Sandbox | None = None
        try:
            sandbox = await self._start(spec, handle)
            self.live[sandbox.id] = sandbox
            self.opened += 1
            yield sandbox
        finally:
            if sandbox is not None:
                sandbox._mark_closed("released")
                self.live.pop(sandbox.id, None)
                self.closed += 1
            with trio.move_on_after(self.teardown_timeout_s, shield=True) as scope:
                await self._teardown(handle)
            if scope.cancelled_caught:
                log.warning("sandbox %s: teardown exceeded %.1f s", handle.dirs.id,
                            self.teardown_timeout_s)
            _release_sync(handle)

    async def _start(self, spec: SandboxSpec, handle: Handle) -> Sandbox:
        dirs = handle.dirs
        try:
            handle.plan = self.limits.create(dirs.boot_tag, dirs.id, spec)
            disk = self._disk_mechanism(spec, handle)
            lib = self.layout.lib_dir()
            workdir = self._workdir(spec, handle)
            tmp = str(dirs.tmp) if not self.isolated else "/tmp"
            cfg = {"socket": dirs.socket_path, "workdir": workdir,
                   "env": self.sandbox_env(spec, tmp, tmp), "marker_name": MARKER_NAME,
                   "marker_value": dirs.marker, "roots": self._roots(spec, handle),
                   "rlimits": handle.plan.rlimits, "sys_path": [str(lib)],
                   "lifetime_s": spec.lifetime_s,
                   "parent_death": os.getpid() if self._parent_death() else 0}
            python = self._helper_python(spec)
            helper = [python, "-I", "-S", str(lib / "_helper.py"), json.dumps(cfg)]
            await self._prepare(spec, handle)
            argv = handle.plan.exec_prefix() + self._command(spec, handle, helper)
            await self._spawn(argv, handle)
        except SandboxStartError:
            self.start_failures += 1
            raise
        except OSError as exc:
            self.start_failures += 1
            raise SandboxStartError(f"{self.name} sandbox failed to start: {exc}") from exc
        mechanisms = dict(handle.plan.mechanisms, disk=disk)
        mechanisms["lifetime"] = "timer" if spec.lifetime_s else "off"
        return Sandbox(id=dirs.id, backend=self.name, workspace=dirs.workspace, workdir=workdir,
                       control_dir=dirs.control, python=self._sandbox_python(spec),
                       socket_path=dirs.socket_path, limits=mechanisms, spec=spec)

    def _helper_python(self, spec: SandboxSpec) -> str:
        return self.helper_python

    def _sandbox_python(self, spec: SandboxSpec) -> str:
        return spec.python or sys.executable

    def _wrapper_env(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", DEFAULT_PATH), "LANG": "C.UTF-8"}

    async def _spawn(self, argv: list[str], handle: Handle) -> None:
        dirs = handle.dirs
        log_fd = os.open(dirs.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            # Not trio.lowlevel.open_process: see _child.py (parent-death signals are per thread).
            handle.process = ChildProcess.spawn(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_fd,
                start_new_session=True, env=self._wrapper_env(), cwd=str(dirs.root))
            await trio.lowlevel.checkpoint()
        finally:
            os.close(log_fd)
        dirs.write_pid(handle.process.pid)
        stdout = handle.process.stdout
        assert stdout is not None
        line = b""
        with trio.move_on_after(self.start_timeout_s) as scope:
            while b"\n" not in line:
                chunk = await stdout.receive_some(256)
                if not chunk:
                    break
                line += chunk
        await stdout.aclose()
        if self.name == "bwrap":  # bwrap's child is the helper (--as-pid-1)
            handle.extra["helper_host_pid"] = _first_child(handle.process.pid)
        if not line.startswith(b"READY "):
            why = f"no answer within {self.start_timeout_s:.0f} s" if scope.cancelled_caught \
                else "it exited"
            raise SandboxStartError(f"{self.name} sandbox helper did not start ({why}): "
                                    f"{_log_tail(dirs.log_path)}")

    # ----- teardown --------------------------------------------------------------------
    async def _teardown(self, handle: Handle) -> None:
        if handle.torn_down:
            return
        handle.torn_down = True
        proc = handle.process
        if proc is not None and proc.returncode is None:
            with trio.move_on_after(1.0):
                with contextlib.suppress(SandboxClosed, OSError):
                    await HelperClient(handle.dirs.socket_path).call("shutdown")
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
        if proc is not None:
            with trio.move_on_after(2.0):
                await proc.wait()
        inner = handle.extra.get("helper_host_pid")  # set by bwrap only
        if inner is not None:
            # The helper dies with bwrap (PDEATHSIG); once it is gone or a zombie, the
            # kernel has killed its PID namespace: nothing of the sandbox is left.
            for _ in range(1000):  # at most ~2 s
                if not _alive(inner):
                    break
                await trio.sleep(0.002)
        with trio.move_on_after(2.0):
            await self._finish(handle)
        if not self.isolated:
            kill_marked(f"{MARKER_NAME}={handle.dirs.marker}".encode())
        if handle.plan is not None:
            await Limits.release(handle.plan.cgroup)
        for point in handle.mounted:
            _umount(point)
        handle.mounted.clear()

    # ----- sweep -----------------------------------------------------------------------
    async def sweep(self) -> int:
        """Kill and remove the sandboxes that earlier (dead) boots left behind."""
        count = 0
        for tag, sandbox_id, root in self.layout.orphans():
            kill_recorded(root)
            kill_marked(f"{MARKER_NAME}={tag}/{sandbox_id}".encode())
            await self._sweep_one(tag, sandbox_id, root)
            await Limits.release(self.limits.cgroup_for(tag, sandbox_id), timeout_s=2.0)
            for point in mounts_under(root):
                _umount(point)
            _rmtree(root)
            with contextlib.suppress(OSError):
                root.parent.rmdir()
                for base in self.limits.boot_dirs():
                    (base / tag).rmdir()
            count += 1
        if count:
            log.warning("swept %d sandbox(es) left by earlier daemon boots", count)
        return count

    async def _sweep_one(self, tag: str, sandbox_id: str, root: Path) -> None:
        """Backend-specific leftovers (Apptainer: the instance)."""

    def statistics(self) -> dict[str, Any]:
        return {"backend": self.name, "live": len(self.live), "opened": self.opened,
                "closed": self.closed, "start_failures": self.start_failures,
                "limits_mechanism": self.limits.kind, "isolated": self.isolated}


def _release_sync(handle: Handle) -> None:
    if handle.mounted:
        for point in handle.mounted:
            _umount(point)
        handle.mounted.clear()
    handle.dirs.release()


def _first_child(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _rmtree(root: Path) -> None:
    import shutil

    shutil.rmtree(root, ignore_errors=True)


def _log_tail(path: Path, limit: int = 2000) -> str:
    try:
        data = path.read_bytes()[-limit:]
    except OSError:
        return "(no log)"
    return data.decode(errors="replace").strip() or "(empty log)"


_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return _libc


def _mount_tmpfs(path: Path, size_mb: int) -> bool:
    """Mount a size-capped tmpfs on ``path`` (root only); inodes are capped too (one per
    16 KiB, as ext4 does), or an empty-file flood would only stop at the memory limit."""
    inodes = max(4096, size_mb * 64)
    opts = f"size={size_mb}m,nr_inodes={inodes},mode=0755,uid={os.getuid()},gid={os.getgid()}".encode()
    if _c().mount(b"tmpfs", str(path).encode(), b"tmpfs", 0, opts) != 0:
        log.warning("cannot mount tmpfs on %s: %s", path, os.strerror(ctypes.get_errno()))
        return False
    return True


def _umount(point: str) -> None:
    if _c().umount2(point.encode(), 2) != 0:  # MNT_DETACH
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL (not mounted), ENOENT
            log.warning("cannot unmount %s: %s", point, os.strerror(err))

