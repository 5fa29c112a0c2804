"""Unpack one untrusted layer tar into a directory.

The rules (the layer comes from anywhere):

- no entry lands outside the directory: names are made relative (a leading ``/`` is
  dropped), names with ``..`` are skipped, and no entry is written through a symlink or a
  non-directory of the layer (such entries are skipped); a symlink's *target* may point
  anywhere: it is resolved inside the sandbox;
- hardlinks only to regular files this layer wrote before them (others are skipped);
- device nodes, fifos and sockets are skipped;
- setuid and setgid bits are stripped; every file is the daemon user's (no chown); the
  owner always has rw (directories rwx), so the store can remove what it unpacked;
- whiteouts (``.wh.NAME``) and opaque markers (``.wh..wh..opq``) are not written: they
  are returned, and applied when layers are composed (``_compose``);
- directory modes and times are applied after the files are in.

A gzip layer is decompressed by a ``pigz -dc``/``gzip -dc`` child while this thread
untars; the compressed bytes are hashed in a feeder thread and the tar stream here, so
both the blob digest and the diff id are checked without a second read.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Protocol

from .._exceptions import ImageError

_CHUNK = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


class Readable(Protocol):
    """What a blob is read through: a binary file, or a slice of one."""

    def read(self, n: int = -1, /) -> bytes: ...


@dataclass
class LayerResult:
    """What one unpacked layer holds (kept beside it in the store as JSON)."""

    diff_id: str
    bytes: int = 0
    whiteouts: list[str] = field(default_factory=list)
    opaque: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _decompressor(magic: bytes) -> list[str] | None:
    if magic.startswith(_GZIP_MAGIC):
        exe = shutil.which("pigz") or shutil.which("gzip")
        if exe is None:
            raise ImageError("a gzip layer needs gzip or pigz on PATH")
        return [exe, "-dc"]
    if magic.startswith(_ZSTD_MAGIC):
        exe = shutil.which("zstd")
        if exe is None:
            raise ImageError("a zstd layer needs zstd on PATH")
        return [exe, "-dc", "-q"]
    return None


class _HashingReader:
    """A read-only file object that hashes what passes through it.

    At the end of the data it adds zeros up to a whole tar block plus the two-block end
    marker, which umoci leaves out (Go's archive/tar, like this, does not need them); the
    zeros are not hashed, so a truncated tar still fails its diff id check.
    """

    def __init__(self, raw: Readable) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.count = 0
        self.tail: bytes | None = None

    def read(self, n: int = -1) -> bytes:
        if self.tail is None:
            data = self.raw.read(n)
            if data or n == 0:
                self.sha.update(data)
                self.count += len(data)
                return data
            self.tail = bytes(-self.count % 512 + 1024)
        data, self.tail = (self.tail, b"") if n < 0 else (self.tail[:n], self.tail[n:])
        return data

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass


class _Feeder(threading.Thread):
    """Copies the compressed blob into the decompressor, hashing and counting it."""

    def __init__(self, blob: Readable, head: bytes, sink: IO[bytes]) -> None:
        super().__init__(name="rolloutd-image-feed", daemon=True)
        self.blob, self.head, self.sink = blob, head, sink
        self.sha = hashlib.sha256()
        self.fed = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            data = self.head
            while data:
                self.sha.update(data)
                self.sink.write(data)
                self.fed += len(data)
                data = self.blob.read(_CHUNK)
        except BrokenPipeError:
            pass  # the decompressor stopped: its exit status tells why
        except BaseException as e:  # reported by unpack_layer
            self.error = e
        finally:
            try:
                self.sink.close()
            except BrokenPipeError:
                pass


def unpack_layer(blob: Readable, dest: str, *, what: str, diff_id: str | None = None,
                 blob_digest: str | None = None,
                 progress: Callable[[int], None] | None = None) -> LayerResult:
    """Unpack the layer tar ``blob`` (plain, gzip or zstd) into the existing dir ``dest``.

    ``diff_id`` (of the tar) and ``blob_digest`` (of the bytes read), when given, are
    checked; a mismatch, a truncated or corrupt stream is an :class:`ImageError` naming
    ``what``. ``progress(blob_bytes_read)`` is called from this thread as it goes.
    Returns the diff id actually seen and the layer's whiteouts.
    """
    head = blob.read(4)
    argv = _decompressor(head)
    proc: subprocess.Popen[bytes] | None = None
    feeder: _Feeder | None = None
    if argv is None:
        raw: Readable = _Prefixed(head, blob)
    else:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        feeder = _Feeder(blob, head, proc.stdin)
        feeder.start()
        raw = proc.stdout
    reader = _HashingReader(raw)

    def fed() -> int:
        return feeder.fed if feeder is not None else reader.count

    try:
        try:
            result = _untar(reader, dest, fed, progress)
            reader.drain()
        except (tarfile.TarError, EOFError, OSError) as e:
            if isinstance(e, OSError) and e.filename is not None:
                raise ImageError(f"{what}: cannot write {e.filename}: {e.strerror}") from e
            raise ImageError(f"{what}: not a valid layer tar ({e})") from e
        finally:
            if proc is not None:
                assert proc.stdout is not None and proc.stderr is not None
                proc.stdout.close()
                if feeder is not None and feeder.is_alive():
                    proc.kill()
                err = proc.stderr.read().decode(errors="replace").strip()
                proc.stderr.close()
                rc = proc.wait()
                if feeder is not None:
                    feeder.join()
        if proc is not None and rc != 0:
            raise ImageError(f"{what}: {argv[0] if argv else ''} failed: {err or rc}")
        if feeder is not None and feeder.error is not None:
            raise ImageError(f"{what}: cannot read the blob: {feeder.error}")
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    seen = "sha256:" + reader.sha.hexdigest()
    if diff_id is not None and seen != diff_id:
        raise ImageError(f"{what}: its tar has digest {seen}, the config says {diff_id}")
    if blob_digest is not None:
        got = "sha256:" + (feeder.sha.hexdigest() if feeder is not None else reader.sha.hexdigest())
        if got != blob_digest:
            raise ImageError(f"{what}: blob digest {got} does not match {blob_digest}")
    if progress is not None:
        progress(fed())
    result.diff_id = seen
    return result


class _Prefixed:
    """``head`` then the rest of ``raw``: the magic bytes already read, put back."""

    def __init__(self, head: bytes, raw: Readable) -> None:
        self.head, self.raw = head, raw

    def read(self, n: int = -1) -> bytes:
        if self.head:
            if n < 0:
                data, self.head = self.head + self.raw.read(), b""
                return data
            data, self.head = self.head[:n], self.head[n:]
            return data
        return self.raw.read(n)


def remove_entry(path: str) -> bool:
    """Remove what is at ``path`` (a whole tree for a dir; a link, not its target):
    whether it was a directory (False when nothing was there)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
        return True
    os.unlink(path)
    return False


def clean_name(name: str) -> str | None:
    """``name`` relative and normalised, or None when it climbs out (``..``) or is empty."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return "/".join(parts)


def _untar(reader: _HashingReader, dest: str, fed: Callable[[], int],
           progress: Callable[[int], None] | None) -> LayerResult:
    result = LayerResult(diff_id="")
    dirs_ok: set[str] = {""}  # relative dirs known to be real dirs of this layer
    files: set[str] = set()  # regular files written (hardlink targets)
    dir_meta: dict[str, tuple[int, float]] = {}
    last = 0

    def ensure_dir(rel: str) -> bool:
        """Make ``rel`` a real directory of the layer; False if something else is there."""
        if rel in dirs_ok:
            return True
        parent = rel.rpartition("/")[0]
        if not ensure_dir(parent):
            return False
        path = os.path.join(dest, rel)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            os.mkdir(path, 0o755)
        else:
            if not stat.S_ISDIR(st.st_mode):
                return False
        dirs_ok.add(rel)
        return True

    def make_room(path: str, rel: str) -> None:
        if remove_entry(path):
            prefix = rel + "/"
            dirs_ok.difference_update([d for d in dirs_ok if d == rel or d.startswith(prefix)])
        files.discard(rel)

    with tarfile.open(fileobj=reader, mode="r|", bufsize=_CHUNK) as tar:  # type: ignore[call-overload]
        for member in tar:
            if progress is not None and fed() - last >= _CHUNK:
                last = fed()
                progress(last)
            rel = clean_name(member.name)
            if rel is None:
                if member.name.strip("/.") or ".." in member.name:
                    result.skipped.append(member.name)
                continue
            parent, _, base = rel.rpartition("/")
            if base.startswith(WHITEOUT):
                if base == OPAQUE:
                    result.opaque.append(parent)
                else:
                    result.whiteouts.append(f"{parent}/{base[len(WHITEOUT):]}".lstrip("/"))
                continue
            if not ensure_dir(parent):
                result.skipped.append(member.name)
                continue
            path = os.path.join(dest, rel)
            mode = member.mode & 0o1777 & ~(stat.S_ISUID | stat.S_ISGID)
            if member.isdir():
                try:
                    st = os.lstat(path)
                    if not stat.S_ISDIR(st.st_mode):
                        make_room(path, rel)
                        os.mkdir(path, 0o700)
                except FileNotFoundError:
                    os.mkdir(path, 0o700)
                dirs_ok.add(rel)
                dir_meta[rel] = (mode | 0o700, member.mtime)
            elif member.isreg():
                make_room(path, rel)
                src = tar.extractfile(member)
                assert src is not None
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with open(fd, "wb", closefd=True) as out:
                    shutil.copyfileobj(src, out, _CHUNK)
                    os.fchmod(fd, (mode & 0o777) | 0o600)
                    os.utime(fd, (member.mtime, member.mtime))
                files.add(rel)
                result.bytes += member.size
            elif member.issym():
                make_room(path, rel)
                os.symlink(member.linkname, path)
            elif member.islnk():
                target = clean_name(member.linkname)
                if target is None or target not in files or target == rel:
                    result.skipped.append(member.name)
                    continue
                make_room(path, rel)
                os.link(os.path.join(dest, target), path, follow_symlinks=False)
                files.add(rel)
            else:  # devices, fifos: not in a rootless sandbox
                result.skipped.append(member.name)
    for rel in sorted(dir_meta, key=len, reverse=True):
        mode, mtime = dir_meta[rel]
        path = os.path.join(dest, rel)
        os.chmod(path, mode)
        os.utime(path, (mtime, mtime))
    return result


def sanitize_tree(dest: str) -> int:
    """Make a tree another tool unpacked (unsquashfs) follow the rules above: remove
    devices, fifos and sockets, strip setuid/setgid, give the owner rw (dirs rwx), own
    every entry. Returns the bytes of its regular files."""
    uid, gid = os.getuid(), os.getgid()
    total = 0
    for top, dirnames, filenames in os.walk(dest):
        for name in dirnames + filenames:
            path = os.path.join(top, name)
            st = os.lstat(path)
            kind = stat.S_IFMT(st.st_mode)
            if kind not in (stat.S_IFDIR, stat.S_IFREG, stat.S_IFLNK):
                os.unlink(path)
                continue
            if st.st_uid != uid or st.st_gid != gid:
                os.lchown(path, uid, gid)
            if kind == stat.S_IFLNK:
                continue
            mode = stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID)
            mode |= 0o700 if kind == stat.S_IFDIR else 0o600
            if mode != stat.S_IMODE(st.st_mode):
                os.chmod(path, mode)
            if kind == stat.S_IFREG:
                total += st.st_size
    return total
