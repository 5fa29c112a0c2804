"""The content-addressed image store.

    root/layers/<hex>/       one unpacked layer (named by its diff id), shared by images
    root/layers/<hex>.json   what the layer holds: bytes, whiteouts, opaque dirs (written
                             before the dir is renamed into place: the dir marks it done)
    root/images/<hex>.json   the image record (digest, layers, config, names, source, times)
    root/rootfs/<hex>/       a multi-layer image's composed rootfs (hardlinks into the layer
                             dirs, whiteouts applied); a one-layer image uses its layer dir
    root/locks/              flock files: one import of a ref, of an image, of a layer at a
                             time; "use-<hex>" held shared while an image is acquired
    root/tmp/<pid>.<rand>/   partial work, renamed into place; a dead process's is cleared

``root/tmp`` is marked as the top of a directory hierarchy where the file system takes the
hint (ext4's ``T`` attribute; see ``_spread_subdirs``), so that each unpack's files go
to a block group chosen afresh rather than to the one the last removal just emptied.

Every method is synchronous and blocks (unpacking takes seconds): the daemon calls them in a
worker thread. Threads and processes sharing one root coordinate through the flocks: an
image or layer is unpacked once however many ask for it at the same time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .._exceptions import ImageError, ImageNotFound
from . import _sif
from ._compose import compose
from ._models import GcReport, Image, ImageConfig
from ._sources import Source, is_source, open_source, source_path
from ._unpack import LayerResult, sanitize_tree, unpack_layer

_HEX = re.compile(r"[0-9a-f]{64}")
_PREFIX = re.compile(r"(?:sha256:)?([0-9a-f]{12,64})")
#: Shortest digest prefix a ref may use.
MIN_PREFIX = 12
#: An image's recorded last use is rewritten at most this often (gc orders by it): every
#: sandbox open acquires its image, and a record write each time costs more than the rest.
LAST_USED_EVERY_S = 60.0


def _hex(digest: str) -> str:
    return digest.split(":", 1)[1]


def _stamp(ref: str) -> list[int] | None:
    path = source_path(ref)
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _named(rec: dict[str, Any], ref: str) -> bool:
    """Whether record ``rec`` carries the name ``ref``."""
    return ref.strip() in rec.get("names", ())


def _from_source(rec: dict[str, Any], ref: str, stamp: list[int] | None) -> bool:
    """Whether record ``rec`` was imported from the source ``ref`` as it stands (``stamp``)."""
    return rec.get("source") == ref and rec.get("source_stamp") == stamp


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class ImageStore:
    """Container images unpacked once into ``root``, shared by every sandbox that uses them.

    ``max_bytes``: after each import, :meth:`gc` keeps the store under this size.
    """

    def __init__(self, root: Path | str, *, max_bytes: int | None = None) -> None:
        self.root = Path(root).absolute()
        self.max_bytes = max_bytes
        for sub in ("layers", "images", "rootfs", "tmp", "locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        _spread_subdirs(self.root / "tmp")
        self._stats_lock = threading.Lock()
        self._hits = self._misses = 0
        self._unpack_total = self._unpack_last = 0.0
        self._held: dict[str, list[int]] = {}  # digest -> fds of its shared use locks
        # ref -> (the records dir's mtime, digest) of its last resolution: see _known
        self._refs: dict[str, tuple[int, str]] = {}
        self._clear_tmp()

    # -- locks and scratch space ----------------------------------------------------------

    @contextlib.contextmanager
    def _flock(self, name: str, *, shared: bool = False) -> Iterator[None]:
        fd = self._lock_fd(name, shared=shared)
        try:
            yield
        finally:
            os.close(fd)

    def _lock_fd(self, name: str, *, shared: bool = False, block: bool = True) -> int:
        """An fd holding the flock ``name`` (a fresh open file: excludes other threads too)."""
        fd = os.open(self.root / "locks" / name, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
                        | (0 if block else fcntl.LOCK_NB))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _clear_tmp(self) -> None:
        for entry in (self.root / "tmp").iterdir():
            pid = entry.name.partition(".")[0]
            if pid.isdigit() and int(pid) != os.getpid():
                try:
                    os.kill(int(pid), 0)
                    continue  # its process still works there
                except ProcessLookupError:
                    pass
                except PermissionError:
                    continue
            elif pid.isdigit():
                continue
            if entry.is_dir():
                _rmtree(entry)
            else:
                entry.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _workdir(self) -> Iterator[Path]:
        path = self.root / "tmp" / f"{os.getpid()}.{secrets.token_hex(6)}"
        path.mkdir()
        try:
            yield path
        finally:
            _rmtree(path)

    # -- records ----------------------------------------------------------------------------

    def _record_path(self, digest: str) -> Path:
        return self.root / "images" / f"{_hex(digest)}.json"

    def _read_record(self, path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _records(self) -> list[dict[str, Any]]:
        out = []
        for path in (self.root / "images").glob("*.json"):
            if _HEX.fullmatch(path.stem) and (rec := self._read_record(path)) is not None:
                out.append(rec)
        return out

    def _image(self, rec: dict[str, Any]) -> Image:
        layers = tuple(rec["layers"])
        if len(layers) == 1:
            rootfs = self.root / "layers" / _hex(layers[0])
        else:
            rootfs = self.root / "rootfs" / _hex(rec["digest"])
        return Image(digest=rec["digest"], rootfs=rootfs,
                     config=ImageConfig.from_json(rec["config"]), layers=layers,
                     size=int(rec["size"]), names=tuple(rec["names"]), source=rec["source"],
                     created=float(rec["created"]), last_used=float(rec["last_used"]))

    def _touch(self, rec: dict[str, Any]) -> Image:
        now = time.time()
        if not now - LAST_USED_EVERY_S < float(rec["last_used"]) <= now:
            rec["last_used"] = now
            _write_json(self._record_path(rec["digest"]), rec)
        return self._image(rec)

    def _records_mtime(self) -> int:
        return os.stat(self.root / "images").st_mtime_ns

    def _known(self, ref: str) -> dict[str, Any] | None:
        """The record ``ref`` resolved to last time, if nothing in the records dir changed
        since (every record write is a rename there) and the record still answers to ``ref``:
        one stat and one small read instead of reading every record (a store of per-task
        images holds hundreds, and every sandbox open resolves its image)."""
        known = self._refs.get(ref)
        if known is None:
            return None
        mtime, digest = known
        rec = self._read_record(self._record_path(digest)) if self._records_mtime() == mtime else None
        if rec is not None and (_named(rec, ref) or _from_source(rec, ref, _stamp(ref))):
            return rec
        self._refs.pop(ref, None)
        return None

    def _remember(self, ref: str, rec: dict[str, Any], mtime: int) -> None:
        if not _PREFIX.fullmatch(ref.strip()):  # a digest is found without a scan anyway
            self._refs[ref] = (mtime, rec["digest"])

    def _find(self, ref: str) -> dict[str, Any] | None:
        ref = ref.strip()
        m = _PREFIX.fullmatch(ref)
        if m:
            prefix = m.group(1)
            if len(prefix) == 64:
                return self._read_record(self.root / "images" / f"{prefix}.json")
            found = [p for p in (self.root / "images").glob(f"{prefix}*.json")
                     if _HEX.fullmatch(p.stem)]
            if len(found) > 1:
                raise ImageError(f"digest prefix {ref!r} is ambiguous ({len(found)} images)")
            if found:
                return self._read_record(found[0])
        named = [r for r in self._records() if _named(r, ref)]
        return max(named, key=lambda r: r["created"]) if named else None

    def _find_source(self, ref: str) -> dict[str, Any] | None:
        stamp = _stamp(ref)
        return next((rec for rec in self._records() if _from_source(rec, ref, stamp)), None)

    # -- public API -------------------------------------------------------------------------

    def lookup(self, ref: str) -> Image | None:
        """The stored image ``ref`` names (digest, unique prefix of at least 12 hex digits,
        or name); never imports."""
        rec = self._find(ref)
        return self._image(rec) if rec is not None else None

    def resolve(self, ref: str, *,
                progress: Callable[[int, int], None] | None = None) -> Image:
        """A stored image, else the source ``ref`` imported (once, however many threads or
        processes ask at the same time)."""
        rec = self._known(ref)
        if rec is not None:
            with self._stats_lock:
                self._hits += 1
            return self._touch(rec)
        mtime = self._records_mtime()  # before the scan: a change during it is seen next time
        rec = self._find(ref) or (self._find_source(ref) if is_source(ref) else None)
        if rec is not None:
            self._remember(ref, rec, mtime)
        if rec is None and is_source(ref):
            key = hashlib.sha256(ref.encode()).hexdigest()[:32]
            with self._flock(f"ref-{key}"):
                rec = self._find_source(ref)
                if rec is None:
                    image, unpacked = self._import(ref, None, progress)
                    with self._stats_lock:  # another ref of a stored image: a hit
                        self._misses += unpacked
                        self._hits += not unpacked
                    return image
        if rec is None:
            raise ImageNotFound(f"no stored image and no source named {ref!r}")
        with self._stats_lock:
            self._hits += 1
        return self._touch(rec)

    def import_(self, ref: str, *, name: str | None = None,
                progress: Callable[[int, int], None] | None = None) -> Image:
        """Import the source ``ref`` (see the package docs), adding ``name`` to its names.

        An image already stored (same digest) is not unpacked again. ``progress(done,
        total)`` is called in this thread with the blob bytes read so far.
        """
        return self._import(ref, name, progress)[0]

    def _import(self, ref: str, name: str | None,
                progress: Callable[[int, int], None] | None) -> tuple[Image, bool]:
        unpacked = False
        with self._workdir() as work:
            source = open_source(ref, str(work))
            names = [name] if name is not None else source.names
            hex_ = _hex(source.digest)
            layer_fds: list[int] = []
            try:
                with self._flock(f"image-{hex_}"):
                    rec = self._read_record(self._record_path(source.digest))
                    if rec is None:
                        unpacked = True
                        t0 = time.monotonic()
                        layers = self._unpack(source, work, layer_fds, progress)
                        size = sum(info.bytes for _, info in layers)
                        if len(layers) > 1:
                            self._compose(hex_, layers, work)
                        elapsed = time.monotonic() - t0
                        with self._stats_lock:
                            self._unpack_total += elapsed
                            self._unpack_last = elapsed
                        now = time.time()
                        rec = {"digest": source.digest, "layers": [i.diff_id for _, i in layers],
                               "config": source.config.to_json(), "size": size, "names": [],
                               "created": now, "last_used": now}
                    rec["source"] = ref
                    rec["source_stamp"] = _stamp(ref)
                    rec["last_used"] = time.time()
                    with self._flock("store"):
                        self._claim_names(rec, names)
                        _write_json(self._record_path(source.digest), rec)
                    use = self._lock_fd(f"use-{hex_}", shared=True)
            finally:
                for fd in layer_fds:
                    os.close(fd)
        try:
            if self.max_bytes is not None:
                self.gc(self.max_bytes)
        finally:
            os.close(use)
        return self._image(rec), unpacked

    def _claim_names(self, rec: dict[str, Any], names: list[str]) -> None:
        """Give ``names`` to ``rec``, taking them from any other image (a name is unique)."""
        if not names:
            return
        for other in self._records():
            if other["digest"] != rec["digest"] and set(other["names"]) & set(names):
                other["names"] = [n for n in other["names"] if n not in names]
                _write_json(self._record_path(other["digest"]), other)
        rec["names"] = list(dict.fromkeys([*rec["names"], *names]))

    def _unpack(self, source: Source, work: Path, layer_fds: list[int],
                progress: Callable[[int, int], None] | None) -> list[tuple[str, LayerResult]]:
        """Each layer of ``source`` in the store (unpacked if not yet there); each layer's
        shared lock is appended to ``layer_fds`` (it keeps gc off until the record exists)."""
        if source.sif is not None:
            return [self._layer(source.digest, layer_fds, lambda d: self._unpack_sif(source, d))]
        total = sum(layer.size for layer in source.layers) or 1
        done = 0
        out = []
        for layer in source.layers:
            assert layer.diff_id is not None

            def report(n: int, base: int = done) -> None:
                if progress is not None:
                    progress(base + n, total)

            def fill(dest: Path, layer: Any = layer) -> LayerResult:
                with layer.open() as blob:
                    return unpack_layer(blob, str(dest), what=layer.what,
                                        diff_id=layer.diff_id, blob_digest=layer.digest,
                                        progress=report)

            out.append(self._layer(layer.diff_id, layer_fds, fill))
            done += layer.size
            if progress is not None:
                progress(done, total)
        return out

    def _unpack_sif(self, source: Source, dest: Path) -> LayerResult:
        assert source.sif is not None
        dest.rmdir()  # unsquashfs makes it
        _sif.extract(source.sif, str(dest))
        return LayerResult(diff_id=source.digest, bytes=sanitize_tree(str(dest)))

    def _layer(self, diff_id: str, layer_fds: list[int],
               fill: Callable[[Path], LayerResult]) -> tuple[str, LayerResult]:
        hex_ = _hex(diff_id)
        final = self.root / "layers" / hex_
        meta = self.root / "layers" / f"{hex_}.json"
        fd = self._lock_fd(f"layer-{hex_}")
        layer_fds.append(fd)
        if not (final.is_dir() and meta.is_file()):
            with self._workdir() as work:
                dest = work / "layer"
                dest.mkdir()
                info = fill(dest)
                info.diff_id = diff_id
                _rmtree(final)
                _write_json(meta, dataclasses.asdict(info))
                os.rename(dest, final)
        fcntl.flock(fd, fcntl.LOCK_SH)  # unpacked: others may read it now
        data = json.loads(meta.read_text())
        return str(final), LayerResult(**data)

    def _compose(self, hex_: str, layers: list[tuple[str, LayerResult]], work: Path) -> None:
        final = self.root / "rootfs" / hex_
        _rmtree(final)
        dest = work / "rootfs"
        dest.mkdir()
        compose(str(dest), layers)
        os.rename(dest, final)

    def images(self) -> list[Image]:
        """Every stored image, most recently used first."""
        return sorted((self._image(r) for r in self._records()),
                      key=lambda i: i.last_used, reverse=True)

    def acquire(self, ref: str) -> Image:
        """:meth:`resolve`, and mark the image in use (gc and remove leave it) until
        :meth:`release`."""
        for _ in range(5):
            image = self.resolve(ref)
            fd = self._lock_fd(f"use-{_hex(image.digest)}", shared=True)
            if self._record_path(image.digest).exists():  # not removed in between
                with self._stats_lock:
                    self._held.setdefault(image.digest, []).append(fd)
                return image
            os.close(fd)
        raise ImageError(f"{ref}: removed while being acquired, five times")

    def release(self, image: Image) -> None:
        """Undo one :meth:`acquire` of ``image``."""
        with self._stats_lock:
            fds = self._held.get(image.digest)
            if not fds:
                raise ValueError(f"{image.digest} is not acquired")
            fd = fds.pop()
            if not fds:
                del self._held[image.digest]
        os.close(fd)

    def remove(self, ref: str) -> Image:
        """Remove the stored image ``ref`` (and its layers no other image uses)."""
        with self._flock("store"):
            rec = self._find(ref)
            if rec is None:
                raise ImageNotFound(f"no stored image named {ref!r}")
            if not self._drop_image(rec):
                raise ImageError(f"{rec['digest']} is in use")
            self._drop_layers()
        return self._image(rec)

    def _drop_image(self, rec: dict[str, Any]) -> bool:
        """Remove one image unless it is in use (called with the store lock held)."""
        hex_ = _hex(rec["digest"])
        fds = []
        try:
            # non-blocking both: an import holds image-<hex> while it waits for the store lock
            for name in (f"use-{hex_}", f"image-{hex_}"):
                fds.append(self._lock_fd(name, block=False))
            self._record_path(rec["digest"]).unlink(missing_ok=True)
            _rmtree(self.root / "rootfs" / hex_)
            return True
        except BlockingIOError:
            return False
        finally:
            for fd in fds:
                os.close(fd)

    def _layer_sizes(self) -> dict[str, int]:
        sizes = {}
        for path in (self.root / "layers").glob("*.json"):
            try:
                sizes[path.stem] = int(json.loads(path.read_text())["bytes"])
            except (OSError, ValueError, KeyError, TypeError):
                sizes[path.stem] = 0
        for path in (self.root / "layers").iterdir():
            if path.is_dir():
                sizes.setdefault(path.name, 0)
        return sizes

    def _drop_layers(self) -> int:
        """Remove layers (and composed rootfs dirs) no image references; freed bytes."""
        records = self._records()
        used = {_hex(d) for r in records for d in r["layers"]}
        composed = {_hex(r["digest"]) for r in records if len(r["layers"]) > 1}
        freed = 0
        for hex_, size in self._layer_sizes().items():
            if hex_ in used:
                continue
            try:
                fd = self._lock_fd(f"layer-{hex_}", block=False)
            except BlockingIOError:
                continue  # an import is unpacking it or about to record it
            try:
                _rmtree(self.root / "layers" / hex_)
                (self.root / "layers" / f"{hex_}.json").unlink(missing_ok=True)
                freed += size
            finally:
                os.close(fd)
        for path in (self.root / "rootfs").iterdir():
            if path.name not in composed:
                try:
                    fd = self._lock_fd(f"image-{path.name}", block=False)
                except BlockingIOError:
                    continue
                try:
                    if not self._record_path(f"sha256:{path.name}").exists():
                        _rmtree(path)
                finally:
                    os.close(fd)
        return freed

    def gc(self, max_bytes: int | None = None) -> GcReport:
        """Remove least recently used images (never one in use) until the layers they
        leave take at most ``max_bytes`` (default: the store's; None: no image removed),
        then every layer no image references."""
        limit = self.max_bytes if max_bytes is None else max_bytes
        removed: list[str] = []
        with self._flock("store"):
            freed = self._drop_layers()
            total = sum(self._layer_sizes().values())
            if limit is not None and total > limit:
                for rec in sorted(self._records(), key=lambda r: r["last_used"]):
                    if total <= limit:
                        break
                    if self._drop_image(rec):
                        removed.append(rec["digest"])
                        dropped = self._drop_layers()
                        freed += dropped
                        total -= dropped
        return GcReport(removed_images=removed, freed_bytes=freed, kept_bytes=total)

    def statistics(self) -> dict[str, float | int]:
        """Counts and sizes: images, layers, bytes (unpacked layer data), hits and misses
        of :meth:`resolve`, seconds spent unpacking (total and last)."""
        sizes = self._layer_sizes()
        with self._stats_lock:
            return {"images": len(self._records()), "layers": len(sizes),
                    "bytes": sum(sizes.values()), "hits": self._hits, "misses": self._misses,
                    "unpack_s_total": self._unpack_total, "unpack_s_last": self._unpack_last}


_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_TOPDIR_FL = 0x00020000


def _spread_subdirs(path: Path) -> None:
    """Set the "top of a directory hierarchy" flag on ``path`` (``chattr +T``; its owner
    may), where the file system has it: ext4 then places each new subdir in a block group
    picked at random among those with room (Orlov), and the subdir's files follow it.
    Without it an unpack's files go to the group with the most free inodes, which is the one
    that the last removal of a store, a layer or a test tree just emptied; on an ext4 without
    a journal every inode allocated there is first checked against the inodes deleted in the
    last one to six minutes (``recently_deleted``), one inode table read each, so the unpack
    of a 324 MB image took 8-13 s instead of 3.3 s after a few removals. Elsewhere (another
    file system, a tmpfs) it does nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        flags = struct.unpack("i", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, b"\0" * 4))[0]
        if not flags & _FS_TOPDIR_FL:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, struct.pack("i", flags | _FS_TOPDIR_FL))
    except OSError:  # ENOTTY/EOPNOTSUPP: no such flags here; EPERM: not ours
        pass
    finally:
        os.close(fd)
