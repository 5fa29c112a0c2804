"""Launchers: the first host process of a sandbox, parked in its cgroup until told to go.

A launcher is ``/bin/sh`` that moves itself into the sandbox's cgroup(s), reads one line
from its stdin, and, if the line is ``go``, execs the backend's wrapper; bwrap then reads
its options from the rest of that stdin (``--args 0``), so a launcher can be started before
the spec of the sandbox it will become is known. The pid never changes: the launcher *is*
bwrap (or the local helper) afterwards, forked from the event loop's thread (see
_child.py), recorded in the sandbox's pid file for the orphan sweep.

Why not move bwrap into the cgroup when the sandbox opens: the first write to a
``cgroup.procs`` after an idle spell waits for an RCU grace period in the kernel
(``cgroup_threadgroup_rwsem``, which v1 and v2 share; about 10 ms measured here on v1,
unless cgroupfs is mounted with ``favordynmods``). A backend keeps ``spares`` launchers parked,
each with its sandbox dirs and cgroup reserved, so that wait is paid before the request
arrives; with none parked, one is started on demand and the wait is in the open, as before.

If the daemon dies, a parked launcher reads EOF and exits, and the next daemon's sweep
removes its reserved dirs and cgroup like a sandbox's (by their free lock). A spare that
died meanwhile is discarded at the next open.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shlex
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

import trio

from ._child import ChildProcess
from ._layout import SandboxDirs

GO = b"go\n"
#: The launcher shell's $0: how a parked launcher shows in ``ps`` (and how tests tell a
#: daemon's parked spares from leaked processes).
NAME = "rolloutd-launcher"


def launcher_argv(procs_files: Sequence[Path], command: Sequence[str]) -> list[str]:
    """``sh -c`` that joins each cgroup, waits for ``go`` on stdin, then execs ``command``."""
    steps = [f"echo $$ > {shlex.quote(str(p))}" for p in procs_files]
    steps += ["IFS= read -r line", '[ "$line" = go ]', 'exec "$@"']
    return ["/bin/sh", "-c", " && ".join(steps), NAME, *command]


class Launcher:
    """One launcher process (its dirs and cgroup are the caller's ``Handle``'s)."""

    def __init__(self, process: ChildProcess) -> None:
        self.process = process
        self.sent = False

    @classmethod
    def start(cls, dirs: SandboxDirs, cgroup_dirs: list[Path] | None, command: Sequence[str],
              env: dict[str, str]) -> Launcher:
        """Start a launcher now (a fork on the calling, event-loop, thread: about 1 ms)."""
        procs = [d / "cgroup.procs" for d in cgroup_dirs or []]
        log_fd = os.open(dirs.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                         0o600)
        try:
            process = ChildProcess.spawn(
                launcher_argv(procs, command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log_fd, start_new_session=True, env=env, cwd=str(dirs.root))
        finally:
            os.close(log_fd)
        dirs.write_pid(process.pid)
        return cls(process)

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
