"""The few libc calls that Python 3.11's ``os`` lacks, through ctypes: mount, unmount, and
a network namespace of its own for the calling thread (``unshare``/``setns``)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import logging
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_libc_handle: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc_handle
    if _libc_handle is None:
        _libc_handle = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return _libc_handle


def mount_tmpfs(path: Path, size_mb: int) -> bool:
    """Mount a size-capped tmpfs on ``path`` (root only); inodes are capped too (one per
    16 KiB, as ext4 does), or an empty-file flood would only stop at the memory limit."""
    inodes = max(4096, size_mb * 64)
    opts = f"size={size_mb}m,nr_inodes={inodes},mode=0755,uid={os.getuid()},gid={os.getgid()}".encode()
    if _c().mount(b"tmpfs", str(path).encode(), b"tmpfs", 0, opts) != 0:
        log.warning("cannot mount tmpfs on %s: %s", path, os.strerror(ctypes.get_errno()))
        return False
    return True


def umount(point: str) -> None:
    if _c().umount2(point.encode(), 2) != 0:  # MNT_DETACH
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL (not mounted), ENOENT
            log.warning("cannot unmount %s: %s", point, os.strerror(err))


CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


@contextlib.contextmanager
def own_netns() -> Iterator[None]:
    """Run the block in a new network namespace, its loopback up, on the calling thread
    only: a process spawned in the block starts there (and keeps the namespace alive; we
    hold no reference to it), and the thread is back in its own namespace afterwards.
    Needs CAP_SYS_ADMIN (a root daemon); OSError if the namespace cannot be made."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _c().unshare(CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
        try:
            _loopback_up()
            yield
        finally:
            if _c().setns(home, CLONE_NEWNET) != 0:
                # Every socket this thread made afterwards would be cut off from the host:
                # never carry on like that.
                err = ctypes.get_errno()
                raise RuntimeError(f"cannot return to the daemon's network namespace: "
                                   f"{os.strerror(err)}")
    finally:
        os.close(home)


def _loopback_up() -> None:
    """Bring ``lo`` up in the calling thread's network namespace (the kernel gives it
    127.0.0.1/8 and ::1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock.fileno(), _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))
