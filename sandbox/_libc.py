"""The few libc calls that Python 3.11's ``os`` lacks, through ctypes: mount and unmount."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
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


