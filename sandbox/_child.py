"""A child process forked from the event loop's own thread.

``trio.lowlevel.open_process`` forks from a worker thread, and Linux delivers
``PR_SET_PDEATHSIG`` (bwrap's ``--die-with-parent``, the local helper's parent-death signal)
when the *thread* that forked exits, not the process. Trio retires idle worker threads after
10 s, which would kill every sandbox 10 s after it opened. Forking from the thread that runs
the event loop ties the signal to the daemon's lifetime, which is what we want.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

import trio


class ChildProcess:
    """The few things the backends need of a child: pid, stdin, stdout, wait, returncode."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid
        self._pidfd: int | None = os.pidfd_open(popen.pid)
        self.stdin: trio.lowlevel.FdStream | None = None
        self.stdout: trio.lowlevel.FdStream | None = None
        if popen.stdin is not None:
            self.stdin = trio.lowlevel.FdStream(os.dup(popen.stdin.fileno()))
            popen.stdin.close()
        if popen.stdout is not None:
            self.stdout = trio.lowlevel.FdStream(os.dup(popen.stdout.fileno()))
            popen.stdout.close()

    @classmethod
    def spawn(cls, argv: list[str], **options: Any) -> ChildProcess:
        """Fork and exec now, on the calling (event-loop) thread: a few milliseconds."""
        return cls(subprocess.Popen(argv, **options))

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    async def wait(self) -> int:
        while (code := self._popen.poll()) is None:
            assert self._pidfd is not None
            await trio.lowlevel.wait_readable(self._pidfd)
        self._close_pidfd()
        return code

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            trio.lowlevel.notify_closing(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
