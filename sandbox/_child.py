"""A child process spawned from the event loop's own thread, with a clean signal state.

``trio.lowlevel.open_process`` forks from a worker thread, and Linux delivers
``PR_SET_PDEATHSIG`` (bwrap's ``--die-with-parent``, the local helper's parent-death signal)
when the *thread* that forked exits, not the process. Trio retires idle worker threads after
10 s, which would kill every sandbox 10 s after it opened. Spawning from the thread that runs
the event loop ties the signal to the daemon's lifetime, which is what we want.

``posix_spawn`` rather than ``subprocess.Popen``: Popen's child keeps the caller's blocked
signal mask and ignored signals (a daemon started by a process that blocked SIGINT, or under
``nohup``, would hand them to bwrap and the helper). Here the child starts with every
signal at its default and none blocked but those the caller names, in a session of its
own, with only fds 0-2 open and those the caller passes (the daemon's own fds are
close-on-exec; those it inherited without the flag are closed).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence

import trio

from ._helper import RESET_SIGNALS


class ChildProcess:
    """The few things the backends need of a child: pid, stdin, stdout, wait, returncode."""

    def __init__(self, pid: int, stdin: int | None = None, stdout: int | None = None) -> None:
        self.pid = pid
        self._returncode: int | None = None
        self._pidfd: int | None = os.pidfd_open(pid)
        self._waiting = trio.Lock()  # Trio lets one task at a time wait on an fd
        self.stdin = trio.lowlevel.FdStream(stdin) if stdin is not None else None
        self.stdout = trio.lowlevel.FdStream(stdout) if stdout is not None else None

    @classmethod
    def spawn(cls, argv: Sequence[str], *, env: dict[str, str], stderr: int,
              blocked: Collection[int] = (), pass_fds: Mapping[int, int] | None = None,
              ) -> ChildProcess:
        """Start ``argv`` now, on the calling (event-loop) thread (a vfork and an exec): a
        new session, every signal at its default and none blocked but ``blocked``, stdin
        and stdout on pipes (their other ends are ``stdin`` and ``stdout``), stderr on
        ``stderr``, and each fd of ``pass_fds`` ({child fd: ours}, above 2, ours not
        equal to the child's) at its place."""
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        try:
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
        except OSError:
            os.close(in_r)
            os.close(in_w)
            raise
        actions: list[tuple[int, ...]] = [(os.POSIX_SPAWN_DUP2, fd, target)
                                          for target, fd in ((0, in_r), (1, out_w), (2, stderr))]
        actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in _inheritable_fds()]
        actions += [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in (pass_fds or {}).items()]
        try:
            pid = os.posix_spawn(argv[0], list(argv), env, file_actions=actions, setsid=True,
                                 setsigmask=tuple(blocked), setsigdef=RESET_SIGNALS)
        except BaseException:
            os.close(in_w)
            os.close(out_r)
            raise
        finally:
            os.close(in_r)
            os.close(out_w)
        return cls(pid, in_w, out_r)

    @property
    def returncode(self) -> int | None:
        if self._returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                pid, status = self.pid, 0
            if pid:
                self._returncode = os.waitstatus_to_exitcode(status)
                self._close_pidfd()
        return self._returncode

    async def wait(self) -> int:
        """Its exit status, once it has exited; any number of tasks may wait at once."""
        async with self._waiting:
            while (code := self.returncode) is None:
                assert self._pidfd is not None
                try:
                    await trio.lowlevel.wait_readable(self._pidfd)
                except trio.ClosedResourceError:  # reaped meanwhile through ``returncode``
                    pass
        return code

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            trio.lowlevel.notify_closing(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)


def _inheritable_fds() -> list[int]:
    """This process's fds above 2 without close-on-exec (what Popen's ``close_fds`` closed):
    only ones inherited that way, since Python opens every fd close-on-exec."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                if os.get_inheritable(fd):
                    found.append(fd)
            except OSError:  # the listing's own fd, or closed meanwhile
                pass
    return found
