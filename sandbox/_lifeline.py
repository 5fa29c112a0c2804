"""The daemon's lifeline: a pipe whose write end only this process holds.

Every launcher gets the read end as ``LIFELINE_FD`` (3), and bwrap and the helper inherit
it. When this process dies, however it dies, the kernel closes the write end and the read
end reports a hang-up; the helper, which watches it, then kills everything in the sandbox
and exits (bwrap's helper is its PID namespace's init, so the kernel ends the rest).

Why not the parent-death signal alone: bwrap sets it in its outer process only after
creating the namespaces, and in the sandbox's first process only after setting up its
mounts; a daemon killed before then leaves a sandbox that nothing ends. A closed pipe has
no such window: a helper that starts after the daemon died sees the hang-up at once.

One pipe per process, made at import (so that no test sees it as a leaked fd), remade in
a forked child, which must not keep its parent's sandboxes alive.
"""

from __future__ import annotations

import fcntl
import os

from ._helper import LIFELINE_FD


def _make() -> tuple[int, int]:
    read, write = os.pipe2(os.O_CLOEXEC)
    if read <= LIFELINE_FD:  # dup2 onto itself would keep close-on-exec: move it above
        moved = fcntl.fcntl(read, fcntl.F_DUPFD_CLOEXEC, LIFELINE_FD + 1)
        os.close(read)
        read = moved
    return read, write


_fds = _make()


def _remake() -> None:
    global _fds
    for fd in _fds:
        os.close(fd)
    _fds = _make()


os.register_at_fork(after_in_child=_remake)


def read_end() -> int:
    """The fd a launcher passes on as ``LIFELINE_FD``."""
    return _fds[0]
