"""The backend base class: the open/teardown protocol every backend shares.

Opening a sandbox: take a parked launcher (its dirs, lock held, and its cgroup reserved)
or make them and start one (_launcher.py), write the spec's limits to the cgroup and the
helper's config to the control dir, tell the launcher to go (it execs the backend's
wrapper, which starts the helper; a prestarted spare's helper is already running and reads
the ``go`` itself), wait for the helper's ``READY`` line, yield a Sandbox.
Teardown (shielded, bounded, idempotent): ask the helper to kill everything, SIGKILL the
wrapper's process group, reap it, kill and remove the cgroup, unmount, remove the dirs;
then park a launcher for the next open. The backend-specific part is ``_command`` and
``_command_input`` (and the optional ``_prepare``/``_finish`` hooks that Apptainer uses
for its instance).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import sys
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import trio

from ._child import ChildProcess
from ._exceptions import SandboxClosed, SandboxStartError
from ._helper import LIFELINE_FD, kill_marked
from ._launcher import Launcher
from ._layout import Layout, SandboxDirs, kill_recorded, mounts_under
from ._libc import mount_tmpfs, umount
from ._limits import Cgroup, LimitPlan, Limits
from ._models import SandboxSpec
from ._protocol import HelperClient
from ._sandbox import Sandbox

log = logging.getLogger(__name__)

MARKER_NAME = "ROLLOUTD_SANDBOX"
CONFIG_NAME = "helper.json"  # in the control dir; the helper reads and removes it
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV_ALLOW = ("LANG", "LC_ALL", "LC_CTYPE", "TZ")
#: How long a request that found the helper gone waits for its exit status (it removes its
#: socket just before it exits).
HELPER_EXIT_WAIT_S = 5.0


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
    cgroup: Cgroup | None = None
    plan: LimitPlan | None = None
    launcher: Launcher | None = None
    mounted: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    torn_down: bool = False
    #: A parked spare whose helper already runs (bwrap's image spares): it waits for
    #: ``go`` on its stdin, then reads its config; its rlimits are its own to set.
    prestarted: bool = False

    @property
    def process(self) -> ChildProcess | None:
        return self.launcher.process if self.launcher is not None else None


class Backend:
    """Base of the three backends. Options (all keyword, all optional):

    limits: "auto" | "cgroup-v2" | "cgroup-v1" | "rlimit"; cgroup_v2_root: a delegated
    v2 subtree; cpu_weight: the CPU weight of all sandboxes together, relative to one
    process's default (cgroup ``cpu.shares`` 1024 / ``cpu.weight`` 100; None leaves it);
    helper_python: interpreter for the helper (bwrap, local);
    start_timeout_s, teardown_timeout_s; env_allow: host variables passed through;
    spares: launchers kept parked in fresh cgroups (bwrap, local; see _launcher.py), so an
    open does not wait for the kernel to move a process into a cgroup (default 0; the
    daemon's ``sandbox_spares``). A backend with spares must be ``aclose``d.
    """

    name: ClassVar[str] = "?"
    isolated: ClassVar[bool] = True
    #: Whether a launcher can be parked before the spec is known (its command must not
    #: depend on the spec): bwrap and local yes, Apptainer no (its instance comes first).
    parkable: ClassVar[bool] = True

    def __init__(self, *, state_dir: Path | str, boot_id: str, limits: str = "auto",
                 cgroup_v2_root: str | None = None, cpu_weight: float | None = None,
                 helper_python: str | None = None,
                 start_timeout_s: float = 15.0, teardown_timeout_s: float = 5.0,
                 env_allow: tuple[str, ...] = ENV_ALLOW, spares: int = 0,
                 **options: Any) -> None:
        self.helper_python = helper_python or default_helper_python()
        self.layout = Layout(state_dir, boot_id, python=self.helper_python)
        self.limits = Limits(limits, cgroup_v2_root, cpu_weight)
        self.start_timeout_s = start_timeout_s
        self.teardown_timeout_s = teardown_timeout_s
        self.env_allow = tuple(env_allow)
        self.spares = spares if self.parkable else 0
        self.options = options
        self.live: dict[str, Sandbox] = {}
        self._spares: deque[Handle] = deque()  # parked launchers, oldest first
        self._closed = False
        self.opened = 0
        self.closed = 0
        self.start_failures = 0
        self.spare_hits = 0
        self.spare_misses = 0

    # ----- hooks -----------------------------------------------------------------------
    def check(self) -> None:
        """Raise SandboxStartError if this backend cannot run here."""

    def _command(self, spec: SandboxSpec | None, handle: Handle, helper: list[str]) -> list[str]:
        """What the launcher execs to start ``helper``; ``spec`` is None when parking."""
        raise NotImplementedError

    def _command_input(self, spec: SandboxSpec, handle: Handle) -> bytes:
        """What the command reads on its stdin after ``go`` (bwrap: its options)."""
        return b""

    def _workdir(self, spec: SandboxSpec, handle: Handle) -> str:
        """Where the helper and its processes start (relative paths resolve there)."""
        return spec.cwd or spec.workdir

    def _env(self, spec: SandboxSpec, handle: Handle) -> dict[str, str]:
        """The environment the helper gives every process of the sandbox."""
        tmp = str(handle.dirs.tmp) if not self.isolated else "/tmp"
        return self.sandbox_env(spec, tmp, tmp)

    def _roots(self, spec: SandboxSpec, handle: Handle) -> list[str]:
        start = self._workdir(spec, handle)
        return list(dict.fromkeys([start, spec.workdir, "/tmp", *(b.dest for b in spec.binds)]))

    def _parent_death(self) -> bool:
        return False

    def _stage(self, spec: SandboxSpec, handle: Handle) -> dict[str, Any] | None:
        """The root the helper builds itself before it starts (bwrap's image sandboxes,
        sandbox/_stage.py); None: its wrapper built it."""
        return None

    async def _prepare(self, spec: SandboxSpec, handle: Handle) -> None:
        """Backend work before the helper's config is written and the helper starts
        (bwrap: the image; Apptainer: image, overlay, instance)."""

    async def _finish(self, handle: Handle) -> None:
        """Backend work after the helper is gone (Apptainer: instance stop)."""

    def _helper_pid(self, handle: Handle) -> int | None:
        """The helper's pid on the host (the launcher becomes the helper unless overridden)."""
        return handle.process.pid if handle.process is not None else None

    def _mechanisms(self, spec: SandboxSpec) -> dict[str, str]:
        """Backend-specific entries of ``Sandbox.limits`` (bwrap: ``tmpfs``)."""
        return {}

    def _disk_mechanism(self, spec: SandboxSpec, handle: Handle) -> str:
        if spec.disk_mb is None:
            return "off"
        if os.geteuid() == 0 and mount_tmpfs(handle.dirs.workspace, spec.disk_mb):
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
        if self._closed:
            raise SandboxStartError(f"the {self.name} backend is closed")
        handle = await self._take_spare(spec) or Handle(self.layout.new())
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
            await self._release(handle)

    async def _release(self, handle: Handle) -> None:
        with trio.move_on_after(self.teardown_timeout_s, shield=True) as scope:
            await self._teardown(handle)
        if scope.cancelled_caught:
            log.warning("sandbox %s: teardown exceeded %.1f s", handle.dirs.id,
                        self.teardown_timeout_s)
        _release_sync(handle)
        self._top_up()  # off the open path: the next open finds a parked launcher

    async def _start(self, spec: SandboxSpec, handle: Handle) -> Sandbox:
        dirs = handle.dirs
        try:
            if handle.launcher is None:
                handle.cgroup = self.limits.reserve(dirs.boot_tag, dirs.id)
            handle.plan = self.limits.create(handle.cgroup, spec)
            disk = self._disk_mechanism(spec, handle)
            await self._prepare(spec, handle)
            workdir = self._workdir(spec, handle)
            cfg = {"socket": dirs.socket_path, "workdir": workdir,
                   "env": self._env(spec, handle), "marker_name": MARKER_NAME,
                   "marker_value": dirs.marker, "roots": self._roots(spec, handle),
                   "rlimits": self._helper_rlimits(handle),
                   "sys_path": [str(self.layout.lib_dir())],
                   "lifetime_s": spec.lifetime_s,
                   "parent_death": os.getpid() if self._parent_death() else 0,
                   "lifeline": LIFELINE_FD, "stage": self._stage(spec, handle)}
            _write_private(dirs.control / CONFIG_NAME, json.dumps(cfg).encode())
            if handle.launcher is None:
                if self.spares:
                    self.spare_misses += 1
                handle.launcher = self._launcher(handle, spec)
            if self.parkable and not handle.prestarted:  # the helper's ancestor: set there
                handle.launcher.set_rlimits(handle.plan.inherited)
            await handle.launcher.go(self._command_input(spec, handle))
            await self._wait_ready(handle)
        except SandboxStartError:
            self.start_failures += 1
            raise
        except OSError as exc:
            self.start_failures += 1
            raise SandboxStartError(f"{self.name} sandbox failed to start: {exc}") from exc
        mechanisms = dict(handle.plan.mechanisms, disk=disk, **self._mechanisms(spec))
        mechanisms["lifetime"] = "timer" if spec.lifetime_s else "off"
        return Sandbox(id=dirs.id, backend=self.name, workspace=dirs.workspace, workdir=workdir,
                       control_dir=dirs.control, python=self._sandbox_python(spec),
                       socket_path=dirs.socket_path, limits=mechanisms, spec=spec,
                       helper_exit=functools.partial(self._helper_exit, handle))

    async def _helper_exit(self, handle: Handle) -> int | None:
        """The helper's exit status, as its wrapper passes it on (bwrap and ``apptainer
        exec`` exit with their command's status; the local launcher is the helper), or
        None if it is still running after HELPER_EXIT_WAIT_S."""
        proc = handle.process
        if proc is None:
            return None
        with trio.move_on_after(HELPER_EXIT_WAIT_S):
            return await proc.wait()
        return None

    def _helper_rlimits(self, handle: Handle) -> dict[str, int]:
        # Set by the daemon on the launcher where it is the helper's ancestor (the helper
        # then need not import ``resource``: ~0.5 ms of every start), else by the helper
        # (a prestarted one imported it while parked).
        plan = handle.plan
        assert plan is not None
        if self.parkable and not handle.prestarted:
            return dict(plan.rlimits)
        return {**plan.inherited, **plan.rlimits}

    def _helper_argv(self, spec: SandboxSpec | None, handle: Handle) -> list[str]:
        python = self._helper_python(spec) if spec is not None else self.helper_python
        # imported, not run as a script: a script is compiled at every start, a module
        # comes from the lib dir's byte code
        start = f"import sys; sys.path.insert(0, {str(self.layout.lib_dir())!r}); " \
                "import _helper; _helper.main()"
        argv = [python, "-I", "-S", "-c", start, str(handle.dirs.control / CONFIG_NAME)]
        return [*argv, "wait"] if handle.prestarted else argv

    def _helper_python(self, spec: SandboxSpec) -> str:
        return self.helper_python

    def _sandbox_python(self, spec: SandboxSpec) -> str:
        return spec.python or sys.executable

    def _wrapper_env(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", DEFAULT_PATH), "LANG": "C.UTF-8"}

    def _launcher(self, handle: Handle, spec: SandboxSpec | None) -> Launcher:
        """Start a launcher for ``handle`` (parked: spec None) in its cgroup."""
        command = self._command(spec, handle, self._helper_argv(spec, handle))
        return Launcher.start(handle.dirs, handle.cgroup.dirs if handle.cgroup else None,
                              command, self._wrapper_env(), wait=not handle.prestarted)

    # ----- spare launchers -------------------------------------------------------------
    def _spare_kinds(self) -> tuple[bool, ...]:
        """Which kinds of spare to keep ``spares`` of, by ``Handle.prestarted``: parked
        launchers (any backend that parks), and bwrap's prestarted image sandboxes once
        an image sandbox has opened."""
        return (False,)

    def _top_up(self) -> None:
        """Park launchers until ``spares`` of each kind are waiting (a fork each, ~1 ms)."""
        for kind in self._spare_kinds():
            while sum(h.prestarted == kind for h in self._spares) < self.spares \
                    and not self._closed:
                if not self._park(kind):
                    break

    def _park(self, prestarted: bool) -> bool:
        """Park one spare of the kind; False (logged) when that failed."""
        handle: Handle | None = None
        try:
            handle = Handle(self.layout.new(), prestarted=prestarted)
            handle.cgroup = self.limits.reserve(handle.dirs.boot_tag, handle.dirs.id)
            handle.launcher = self._launcher(handle, None)
        except (SandboxStartError, OSError) as exc:
            log.warning("cannot park a spare %s launcher: %s", self.name, exc)
            if handle is not None:
                if handle.cgroup is not None:
                    handle.cgroup.remove()
                handle.dirs.release()
            return False
        self._spares.append(handle)
        return True

    def _spare_fits(self, handle: Handle, spec: SandboxSpec) -> bool:
        """Whether the parked ``handle`` can become a sandbox of ``spec`` (any can, here)."""
        return True

    async def _take_spare(self, spec: SandboxSpec) -> Handle | None:
        # a prestarted spare first: where one fits, it saves the most
        while handle := next((h for h in sorted(self._spares, key=lambda h: not h.prestarted)
                              if self._spare_fits(h, spec)), None):
            self._spares.remove(handle)
            assert handle.process is not None
            if handle.process.returncode is None:
                self.spare_hits += 1
                return handle
            log.warning("spare %s launcher %d had exited; discarded", self.name,
                        handle.process.pid)
            await self._release(handle)
        return None

    def warm_up(self) -> None:
        """Park the spare launchers now rather than at the first open."""
        self._top_up()

    async def aclose(self) -> None:
        """Discard the spare launchers (shielded, bounded); open sandboxes are the
        callers'. Later opens fail."""
        self._closed = True
        with trio.CancelScope(shield=True):
            while self._spares:
                handle = self._spares.popleft()
                assert handle.launcher is not None
                await handle.launcher.discard()
                await self._release(handle)

    async def _wait_ready(self, handle: Handle) -> None:
        assert handle.process is not None
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
        if not line.startswith(b"READY "):
            why = f"no answer within {self.start_timeout_s:.0f} s" if scope.cancelled_caught \
                else "it exited"
            raise SandboxStartError(f"{self.name} sandbox helper did not start ({why}): "
                                    f"{_log_tail(handle)}")

    # ----- teardown --------------------------------------------------------------------
    async def _teardown(self, handle: Handle) -> None:
        if handle.torn_down:
            return
        handle.torn_down = True
        proc = handle.process
        inner = None
        if proc is not None and proc.returncode is None:
            inner = self._helper_pid(handle)  # now, while the wrapper still has it
            with trio.move_on_after(1.0):
                with contextlib.suppress(SandboxClosed, OSError):
                    await HelperClient(handle.dirs.socket_path).call("shutdown")
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
        if proc is not None:
            with trio.move_on_after(2.0):
                await proc.wait()
        if inner is not None and proc is not None and inner != proc.pid:
            # The helper dies with bwrap (PDEATHSIG); once it is gone or a zombie, the
            # kernel has killed its PID namespace: nothing of the sandbox is left.
            for _ in range(1000):  # at most ~2 s
                if not _alive(inner):
                    break
                await trio.sleep(0.002)
        with trio.move_on_after(2.0):
            await self._finish(handle)
        if not self.isolated:  # a scan of /proc: off the event loop
            await trio.to_thread.run_sync(kill_marked,
                                          f"{MARKER_NAME}={handle.dirs.marker}".encode())
        await Limits.release(handle.cgroup)
        for point in handle.mounted:
            umount(point)
        handle.mounted.clear()

    # ----- sweep -----------------------------------------------------------------------
    async def sweep(self) -> int:
        """Kill and remove the sandboxes that earlier (dead) boots left behind."""
        count = 0
        for tag, sandbox_id, root in self.layout.orphans():
            kill_recorded(root)
            await trio.to_thread.run_sync(kill_marked, f"{MARKER_NAME}={tag}/{sandbox_id}".encode())
            await self._sweep_one(tag, sandbox_id, root)
            await Limits.release(self.limits.cgroup_for(tag, sandbox_id), timeout_s=2.0)
            for point in mounts_under(root):
                umount(point)
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
                "spares": len(self._spares), "spare_hits": self.spare_hits,
                "spare_misses": self.spare_misses,
                "limits_mechanism": self.limits.kind, "cpu_weight": self.limits.cpu_weight_setting,
                "isolated": self.isolated}


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _release_sync(handle: Handle) -> None:
    if handle.mounted:
        for point in handle.mounted:
            umount(point)
        handle.mounted.clear()
    if handle.launcher is not None:
        said = handle.launcher.log()
        if said:
            log.info("sandbox %s stderr: %s", handle.dirs.id, said[-2000:])
        handle.launcher.close_log()
    handle.dirs.release()


def first_child(pid: int) -> int | None:
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


def _log_tail(handle: Handle, limit: int = 2000) -> str:
    said = handle.launcher.log() if handle.launcher is not None else ""
    return said[-limit:] or "(nothing on its stderr)"
