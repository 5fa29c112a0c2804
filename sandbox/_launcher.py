"""Launchers: the first host process of a sandbox, parked in its cgroup until told to go.

A launcher is ``/bin/sh`` that moves itself into the sandbox's cgroup(s), reads one line
from its stdin, and, if the line is ``go``, execs the backend's wrapper; bwrap then reads
its options from the rest of that stdin (``--args 0``), so a launcher can be started before
the spec of the sandbox it will become is known. A *prestarted* one (bwrap's parked image
sandboxes, ``wait=False``) execs at once, with options that need no spec, and the helper
it starts reads the ``go`` line itself (sandbox/_stage.py). The pid never changes: the launcher *is*
bwrap (or the local helper) afterwards, spawned from the event loop's thread with a clean
signal state (see _child.py), recorded in the sandbox's pid file for the orphan sweep. It
and what it execs ignore SIGTERM and SIGINT, so a sandbox outlives a signal sent to every
process of a Slurm job step, and the daemon's drain can finish the rollouts in it.

Why not move bwrap into the cgroup when the sandbox opens: the first write to a
``cgroup.procs`` after an idle spell waits for an RCU grace period in the kernel
(``cgroup_threadgroup_rwsem``, which v1 and v2 share; about 10 ms measured here on v1,
unless cgroupfs is mounted with ``favordynmods``). A backend keeps ``spares`` launchers parked,
each with its sandbox dirs and cgroup reserved, so that wait is paid before the request
arrives; with none parked, one is started on demand and the wait is in the open, as before.

Every launcher holds the daemon's lifeline (_lifeline.py) as fd 3, for the helper it
becomes. If the daemon dies, a parked launcher reads EOF and exits, and the next daemon's sweep
removes its reserved dirs and cgroup like a sandbox's (by their free lock). A spare that
died meanwhile is discarded at the next open.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shlex
import signal
from collections.abc import Sequence
from pathlib import Path

import trio

from . import _lifeline as lifeline
from ._child import ChildProcess
from ._helper import LIFELINE_FD
from ._layout import SandboxDirs

GO = b"go\n"
#: The launcher shell's $0: how a parked launcher shows in ``ps`` (and how tests tell a
#: daemon's parked spares from leaked processes).
NAME = "rolloutd-launcher"
#: The most of a sandbox's stderr (launcher, wrapper, helper) the daemon keeps.
LOG_MAX_BYTES = 65536
#: What a sandbox's host-side processes ignore (see ``launcher_argv``): the daemon's drain.
#: Blocked from the launcher's spawn until its ``trap`` ignores them (which discards one
#: pending), so that none arriving in between ends it.
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def launcher_argv(procs_files: Sequence[Path], command: Sequence[str], cwd: Path,
                  wait: bool = True) -> list[str]:
    """``sh -c`` that ignores the drain signals, moves to ``cwd``, joins each cgroup, waits
    for ``go`` on stdin (unless not ``wait``: a prestarted spare's command runs at once
    and reads the ``go`` itself), then execs ``command``.

    SIGTERM and SIGINT stay ignored in what it execs: a job step's ``scancel`` (or an
    ``srun`` interrupt) signals every process of the step, and bwrap dies of SIGTERM (it
    has no handler; its child, the helper, then dies of ``--die-with-parent``), which
    would end every sandbox while the daemon drains. The helper ignores them as well and
    gives commands every signal back at its default; the daemon's teardown (SIGKILL) and
    its death (the parent-death signal) still end the sandbox."""
    names = " ".join(signal.Signals(sig).name.removeprefix("SIG") for sig in DRAIN_SIGNALS)
    steps = [f"trap '' {names}", f"cd {shlex.quote(str(cwd))}"]
    steps += [f"echo $$ > {shlex.quote(str(p))}" for p in procs_files]
    if wait:
        steps += ["IFS= read -r line", '[ "$line" = go ]']
    steps += ['exec "$@"']
    return ["/bin/sh", "-c", " && ".join(steps), NAME, *command]


class Launcher:
    """One launcher process (its dirs and cgroup are the caller's ``Handle``'s).

    Its stderr, which bwrap and the helper inherit, is a pipe that the daemon reads
    (``log``), never a file: a process of the sandbox that reached the helper's fds would
    otherwise hold a host file, and nothing capped what the helper wrote there. The pipe is
    non-blocking at both ends: a writer never waits for the daemon, and what does not fit
    in the pipe (64 KiB) while the daemon is not reading is dropped."""

    def __init__(self, process: ChildProcess, log_fd: int) -> None:
        self.process = process
        self.sent = False
        self._log_fd: int | None = log_fd
        self._log = bytearray()

    @classmethod
    def start(cls, dirs: SandboxDirs, cgroup_dirs: list[Path] | None, command: Sequence[str],
              env: dict[str, str], wait: bool = True) -> Launcher:
        """Start a launcher now (a spawn on the calling, event-loop, thread: about 1 ms);
        ``wait``: see ``launcher_argv``."""
        procs = [d / "cgroup.procs" for d in cgroup_dirs or []]
        log_r, log_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            process = ChildProcess.spawn(launcher_argv(procs, command, dirs.root, wait), env=env,
                                         stderr=log_w, blocked=DRAIN_SIGNALS,
                                         pass_fds={LIFELINE_FD: lifeline.read_end()})
        except BaseException:
            os.close(log_r)
            raise
        finally:
            os.close(log_w)
        dirs.write_pid(process.pid)
        return cls(process, log_r)

    def log(self) -> str:
        """What the launcher, its wrapper and the helper have written on stderr (the last
        LOG_MAX_BYTES of it)."""
        while self._log_fd is not None:
            try:
                data = os.read(self._log_fd, 65536)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                break
            self._log += data
            del self._log[:-LOG_MAX_BYTES]
        return self._log.decode(errors="replace").strip()

    def close_log(self) -> None:
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None

    def set_rlimits(self, limits: dict[str, int]) -> None:
        """Set resource limits (``{"RLIMIT_NOFILE": 4096, ...}``, soft = hard) on the parked
        launcher: what it execs, and everything that starts, inherits them."""
        for name, value in limits.items():
            resource.prlimit(self.process.pid, getattr(resource, name), (value, value))

    async def go(self, data: bytes = b"") -> None:
        """Let the launcher exec its command; ``data`` follows on its stdin (bwrap's
        options), then EOF."""
        stdin = self.process.stdin
        assert stdin is not None and not self.sent
        self.sent = True
        try:
            await stdin.send_all(GO + data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # it died already: the READY wait reports it, with the log
        finally:
            await stdin.aclose()

    async def discard(self) -> None:
        """Kill an unused launcher and wait for it (its dirs and cgroup are the caller's)."""
        with contextlib.suppress(OSError):
            os.killpg(self.process.pid, signal.SIGKILL)
        if self.process.stdin is not None:
            await self.process.stdin.aclose()
        if self.process.stdout is not None:
            await self.process.stdout.aclose()
        with trio.move_on_after(2.0):
            await self.process.wait()
