"""Read a SIF file's primary system partition (squashfs) without Apptainer.

The SIF global header (little endian, after a 32-byte launch script): magic
``SIF_MAGIC\\0``, version, arch, a 16-byte id, then int64 created, modified, descriptors
free, descriptors total, descriptors offset, descriptors size, data offset, data size.
Each descriptor: int32 data type, bool used, uint32 id, group, link, then int64 offset,
size, size with padding, created, modified, uid, gid, a 128-byte name and 384 bytes of
type-specific data (for a partition: int32 fs type, int32 partition type, arch).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from dataclasses import dataclass

from .._exceptions import ImageError

_MAGIC = b"SIF_MAGIC\0"
_HEADER = struct.Struct("<32s10s3s3s16s8q")
_DESCRIPTOR = struct.Struct("<i?IIIqqqqqqq128s")
_PARTITION = struct.Struct("<ii")
DATA_PARTITION = 0x4004
FS_SQUASH = 1
PART_PRIMSYS = 2
_SQUASHFS_MAGIC = b"hsqs"


@dataclass(frozen=True)
class Partition:
    offset: int
    size: int
    fstype: int
    parttype: int


def partitions(path: str) -> list[Partition]:
    """The data partitions the SIF at ``path`` describes (ImageError if it is no SIF)."""
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise ImageError(f"{path}: not a SIF file (too short)")
        fields = _HEADER.unpack(head)
        if fields[1] != _MAGIC:
            raise ImageError(f"{path}: not a SIF file (no SIF_MAGIC)")
        _, _, total, desc_off, desc_size, _, _ = fields[6:13]
        if total <= 0 or desc_size < total * _DESCRIPTOR.size:
            raise ImageError(f"{path}: SIF descriptors are corrupt")
        stride = desc_size // total
        f.seek(desc_off)
        raw = f.read(desc_size)
        file_size = os.fstat(f.fileno()).st_size
    found = []
    for i in range(total):
        chunk = raw[i * stride:(i + 1) * stride]
        if len(chunk) < _DESCRIPTOR.size + _PARTITION.size:
            raise ImageError(f"{path}: SIF descriptors are truncated")
        dtype, used, _, _, _, offset, size = _DESCRIPTOR.unpack_from(chunk)[:7]
        if not used or dtype != DATA_PARTITION:
            continue
        fstype, parttype = _PARTITION.unpack_from(chunk, _DESCRIPTOR.size)
        if offset < 0 or size <= 0 or offset + size > file_size:
            raise ImageError(f"{path}: SIF partition out of the file's bounds")
        found.append(Partition(offset, size, fstype, parttype))
    return found


def primary_partition(path: str) -> Partition:
    """The primary system partition (squashfs) of the SIF at ``path``."""
    parts = partitions(path)
    for part in parts:
        if part.fstype == FS_SQUASH and part.parttype == PART_PRIMSYS:
            return part
    raise ImageError(f"{path}: the SIF has no squashfs primary system partition "
                     f"({len(parts)} data partitions)")


def extract(path: str, dest: str, *, timeout_s: float = 600.0) -> None:
    """Extract the primary partition of ``path`` into ``dest`` (which must not exist)."""
    part = primary_partition(path)
    with open(path, "rb") as f:
        f.seek(part.offset)
        if f.read(4) != _SQUASHFS_MAGIC:
            raise ImageError(f"{path}: the primary partition is not squashfs")
    exe = shutil.which("unsquashfs")
    if exe is None:
        raise ImageError(f"{path}: reading a SIF needs unsquashfs (squashfs-tools) on PATH")
    argv = [exe, "-no-progress", "-no-xattrs", "-o", str(part.offset), "-d", dest, path]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise ImageError(f"{path}: unsquashfs took over {timeout_s:.0f} s") from e
    # 2: non-fatal errors, such as device nodes a non-root user cannot make (dropped anyway)
    if proc.returncode not in (0, 2) or not os.path.isdir(dest):
        err = (proc.stderr or proc.stdout).decode(errors="replace").strip()[-2000:]
        raise ImageError(f"{path}: unsquashfs failed ({proc.returncode}): {err}")
