"""The image store: import, lookup, sharing, composition, hostile layers, GC, errors."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import shutil
import stat
import struct
import tarfile
import threading
from pathlib import Path

import pytest

from rolloutd.sandbox import SandboxStartError
from rolloutd.sandbox.images import ImageError, ImageNotFound, ImageStore

from ._build import d, docker_archive, entry, layer_tar, oci_layout, sha

BASE = layer_tar([
    d("bin"), entry("bin/sh", b"#!shell", mode=0o755), d("etc"),
    entry("etc/passwd", b"root:x:0:0"), entry("etc/hostname", b"base"),
    d("opt"), entry("opt/a", b"a"), entry("opt/b", b"b"),
    entry("bin/sh-link", kind=tarfile.SYMTYPE, link="/bin/sh"),
])
TOP = layer_tar([
    d("etc"), entry("etc/.wh.hostname"), d("opt"), entry("opt/.wh..wh..opq"),
    entry("opt/c", b"c"), entry("etc/motd", b"hi"),
])


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


def test_import_multi_layer_applies_whiteouts(store, tmp_path):
    digests = oci_layout(tmp_path / "oci", {"v1": [BASE, TOP]})
    image = store.import_(f"oci:{tmp_path / 'oci'}:v1", name="localhost/test:v1")
    assert image.digest == digests["v1"]
    assert image.layers == (sha(BASE), sha(TOP))
    root = image.rootfs
    assert root == store.root / "rootfs" / image.digest[7:]
    assert (root / "bin/sh").read_bytes() == b"#!shell"
    assert os.readlink(root / "bin/sh-link") == "/bin/sh"
    assert not (root / "etc/hostname").exists()
    assert (root / "etc/motd").read_text() == "hi"
    assert sorted(os.listdir(root / "opt")) == ["c"]
    assert not any(n.startswith(".wh.") for _, _, fs in os.walk(root) for n in fs)
    assert image.config.env == {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    assert image.config.workdir == "/work" and image.config.cmd == ("/bin/sh",)
    assert image.names == ("localhost/test:v1",)
    assert image.size == sum(len(x) for x in (b"#!shell", b"root:x:0:0", b"base", b"a", b"b",
                                              b"c", b"hi"))


def test_lookup_by_digest_prefix_name(store, tmp_path):
    oci_layout(tmp_path / "oci", {"v1": [BASE]})
    image = store.import_(f"oci:{tmp_path / 'oci'}:v1", name="test:v1")
    assert image.rootfs == store.root / "layers" / sha(BASE)[7:]  # one layer: no farm
    for ref in (image.digest, image.digest[7:], image.digest[7:19], image.digest[:19], "test:v1"):
        assert store.lookup(ref).digest == image.digest, ref
    assert store.lookup(image.digest[7:15]) is None  # too short for a prefix
    assert store.lookup("nope:v1") is None
    assert store.resolve("test:v1").digest == image.digest
    assert [i.digest for i in store.images()] == [image.digest]


def test_resolve_counts_hits_and_misses(store, tmp_path):
    oci_layout(tmp_path / "oci", {"latest": [BASE]})
    ref = str(tmp_path / "oci")  # a bare layout dir
    seen = []
    first = store.resolve(ref, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1]
    again = store.resolve(ref)
    assert again.digest == first.digest and again.last_used >= first.last_used
    stats = store.statistics()
    assert (stats["hits"], stats["misses"], stats["images"], stats["layers"]) == (1, 1, 1, 1)
    assert stats["unpack_s_total"] >= stats["unpack_s_last"] > 0


def test_layers_shared_between_images(store, tmp_path):
    oci_layout(tmp_path / "oci", {"a": [BASE, TOP], "b": [BASE]}, gz=False)
    a = store.import_(f"oci:{tmp_path / 'oci'}:a")
    b = store.import_(f"oci:{tmp_path / 'oci'}:b")
    assert a.layers[0] == b.layers[0]
    assert sorted(os.listdir(store.root / "layers")) == sorted(
        [h[7:] for h in a.layers] + [h[7:] + ".json" for h in a.layers])
    stats = store.statistics()
    assert stats["layers"] == 2 and stats["bytes"] == a.size  # BASE counted once
    assert b.size < a.size
    # a composed rootfs shares the layer's inodes
    assert os.stat(a.rootfs / "bin/sh").st_ino == os.stat(b.rootfs / "bin/sh").st_ino


def test_docker_archive_plain_and_gzip(store, tmp_path):
    digest = docker_archive(tmp_path / "img.tar", [BASE, TOP], ["test:v2"], gz_layers=True)
    image = store.resolve(str(tmp_path / "img.tar"))
    assert image.digest == digest and image.names == ("test:v2",)
    assert (image.rootfs / "etc/motd").read_text() == "hi"
    docker_archive(tmp_path / "plain.tar", [BASE], ["x:1", "y:2"])
    assert store.import_(f"docker-archive:{tmp_path / 'plain.tar'}:y:2").names == ("y:2",)
    (tmp_path / "img.tar.gz").write_bytes(gzip.compress((tmp_path / "img.tar").read_bytes()))
    assert store.import_(str(tmp_path / "img.tar.gz")).digest == digest


def test_hostile_layer_is_neutralised(store, tmp_path):
    outside = tmp_path / "outside"
    hostile = layer_tar([
        entry("../escape", b"x"), entry("a/../../escape2", b"x"),
        entry(str(outside / "abs"), b"abs"),  # absolute: lands inside, relative
        entry("evil", kind=tarfile.SYMTYPE, link=str(outside)),
        entry("evil/through-link", b"x"),
        entry("hard-out", kind=tarfile.LNKTYPE, link="../../../etc/passwd"),
        entry("hard-abs", kind=tarfile.LNKTYPE, link="/etc/passwd"),
        entry("suid", b"s", mode=0o4755), entry("sgid", b"s", mode=0o2711),
        entry("noperm", b"n", mode=0o000), d("lockeddir", mode=0o000),
        entry("lockeddir/f", b"f"),
        entry("dev", kind=tarfile.CHRTYPE), entry("fifo", kind=tarfile.FIFOTYPE),
        entry("real", b"real"), entry("hard-in", kind=tarfile.LNKTYPE, link="real"),
    ])
    outside.mkdir()
    oci_layout(tmp_path / "oci", {"x": [hostile]})
    image = store.import_(f"oci:{tmp_path / 'oci'}:x")
    root = image.rootfs
    assert os.listdir(outside) == []
    assert not (tmp_path / "escape").exists() and not (store.root / "escape").exists()
    assert (root / str(outside).lstrip("/") / "abs").read_bytes() == b"abs"
    assert os.readlink(root / "evil") == str(outside)  # a target may point anywhere
    assert not os.path.lexists(root / "hard-out") and not os.path.lexists(root / "hard-abs")
    assert stat.S_IMODE(os.stat(root / "suid").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(root / "sgid").st_mode) == 0o711
    assert stat.S_IMODE(os.stat(root / "noperm").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(root / "lockeddir").st_mode) == 0o700
    assert not os.path.lexists(root / "dev") and not os.path.lexists(root / "fifo")
    assert os.stat(root / "hard-in").st_ino == os.stat(root / "real").st_ino
    for top, dirs, files in os.walk(root):
        for n in dirs + files:
            assert os.lstat(os.path.join(top, n)).st_uid == os.getuid()
    store.remove(image.digest)  # the store can remove everything it unpacked
    assert os.listdir(store.root / "layers") == []


def test_concurrent_resolve_unpacks_once(store, tmp_path):
    oci_layout(tmp_path / "oci", {"v": [BASE, TOP]})
    ref = f"oci:{tmp_path / 'oci'}:v"
    results, errors = [], []

    def go():
        try:
            results.append(store.resolve(ref).digest)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=go) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and len(results) == 6
    stats = store.statistics()
    assert (stats["misses"], stats["hits"]) == (1, 5)


def test_gc_lru_keeps_acquired_and_drops_layers(store, tmp_path):
    big = [layer_tar([entry(f"f{i}", bytes([i]) * 1000)]) for i in range(3)]
    oci_layout(tmp_path / "oci", {f"t{i}": [big[i]] for i in range(3)})
    imgs = [store.import_(f"oci:{tmp_path / 'oci'}:t{i}") for i in range(3)]
    held = store.acquire(imgs[0].digest)  # the oldest, but in use
    with pytest.raises(ImageError, match="in use"):
        store.remove(held.digest)
    report = store.gc(max_bytes=1000)
    assert report.removed_images == [imgs[1].digest, imgs[2].digest]
    assert report.freed_bytes == 2000 and report.kept_bytes == 1000
    assert [i.digest for i in store.images()] == [imgs[0].digest]
    assert store.statistics()["layers"] == 1
    store.release(held)
    assert store.gc(max_bytes=0).removed_images == [imgs[0].digest]
    assert store.statistics()["bytes"] == 0 and os.listdir(store.root / "rootfs") == []


def test_max_bytes_gc_after_import(tmp_path):
    store = ImageStore(tmp_path / "s", max_bytes=1500)
    tars = [layer_tar([entry("f", bytes([i]) * 1000)]) for i in range(2)]
    oci_layout(tmp_path / "oci", {"a": [tars[0]], "b": [tars[1]]})
    store.import_(f"oci:{tmp_path / 'oci'}:a")
    b = store.import_(f"oci:{tmp_path / 'oci'}:b")
    assert [i.digest for i in store.images()] == [b.digest]
    big = ImageStore(tmp_path / "s2", max_bytes=10)
    assert big.import_(f"oci:{tmp_path / 'oci'}:a").rootfs.is_dir()  # never the new one


def test_remove(store, tmp_path):
    oci_layout(tmp_path / "oci", {"a": [BASE, TOP], "b": [BASE]})
    a = store.import_(f"oci:{tmp_path / 'oci'}:a", name="a")
    store.import_(f"oci:{tmp_path / 'oci'}:b", name="b")
    assert store.remove("a").digest == a.digest
    assert not a.rootfs.exists() and store.lookup("a") is None
    assert store.statistics()["layers"] == 1  # BASE stays: b uses it
    with pytest.raises(ImageNotFound):
        store.remove("a")


def test_missing_sources(store, tmp_path):
    with pytest.raises(ImageNotFound, match="no stored image"):
        store.resolve("nothing:here")
    with pytest.raises(ImageNotFound):
        store.resolve(f"oci:{tmp_path / 'absent'}")
    oci_layout(tmp_path / "oci", {"a": [BASE], "b": [TOP]})
    with pytest.raises(ImageNotFound, match="tags: a, b"):
        store.resolve(f"oci:{tmp_path / 'oci'}:zzz")
    with pytest.raises(ImageError, match="name one of the tags: a, b"):
        store.resolve(f"oci:{tmp_path / 'oci'}")
    assert issubclass(ImageNotFound, ImageError) and issubclass(ImageError, SandboxStartError)


def _only_layer_blob(layout: Path) -> Path:
    manifest = json.loads((layout / "blobs/sha256" / json.loads(
        (layout / "index.json").read_text())["manifests"][0]["digest"][7:]).read_text())
    return layout / "blobs/sha256" / manifest["layers"][0]["digest"][7:]


def test_corrupt_sources(store, tmp_path):
    oci_layout(tmp_path / "trunc", {"a": [BASE]})
    blob = _only_layer_blob(tmp_path / "trunc")
    blob.write_bytes(blob.read_bytes()[:-30])
    with pytest.raises(ImageError, match="layer"):
        store.resolve(str(tmp_path / "trunc"))
    oci_layout(tmp_path / "swap", {"a": [BASE]})
    blob = _only_layer_blob(tmp_path / "swap")
    blob.write_bytes(gzip.compress(TOP))
    with pytest.raises(ImageError, match="digest"):
        store.resolve(str(tmp_path / "swap"))
    oci_layout(tmp_path / "json", {"a": [BASE]})
    (tmp_path / "json/index.json").write_text("{not json")
    with pytest.raises(ImageError, match="not valid JSON"):
        store.resolve(str(tmp_path / "json"))
    (tmp_path / "junk.tar").write_bytes(b"junk" * 100)
    with pytest.raises(ImageError, match="tar"):
        store.resolve(str(tmp_path / "junk.tar"))
    assert store.images() == [] and store.statistics()["layers"] == 0
    assert os.listdir(store.root / "tmp") == []


def test_diff_id_mismatch(store, tmp_path):
    oci_layout(tmp_path / "oci", {"a": [BASE]}, gz=False)
    layout = tmp_path / "oci"
    index = json.loads((layout / "index.json").read_text())
    mpath = layout / "blobs/sha256" / index["manifests"][0]["digest"][7:]
    manifest = json.loads(mpath.read_text())
    cpath = layout / "blobs/sha256" / manifest["config"]["digest"][7:]
    config = json.loads(cpath.read_text())
    config["rootfs"]["diff_ids"] = [sha(TOP)]  # lies about the layer's content
    from ._build import write_blob
    manifest["config"]["digest"] = write_blob(layout, json.dumps(config).encode())
    index["manifests"][0]["digest"] = write_blob(layout, json.dumps(manifest).encode())
    (layout / "index.json").write_text(json.dumps(index))
    with pytest.raises(ImageError, match="the config says"):
        store.resolve(str(layout))
    assert not (store.root / "layers" / sha(TOP)[7:]).exists()


def test_a_ref_seen_before_is_resolved_without_reading_every_record(store, tmp_path, monkeypatch):
    """Every sandbox open resolves its image: with hundreds of per-task images stored, that
    must not read every record. A known ref costs one stat and one record read, and is
    looked up again in full once anything in the store changed (here: a name moved)."""
    oci_layout(tmp_path / "oci", {f"t{i}": [layer_tar([entry("f", bytes([i]))])] for i in range(6)})
    imgs = [store.import_(f"oci:{tmp_path / 'oci'}:t{i}", name=f"task-{i}") for i in range(6)]
    source = f"oci:{tmp_path / 'oci'}:t3"
    reads: list[str] = []
    real_read = ImageStore._read_record

    def counting(self, path):
        reads.append(path.name)
        return real_read(self, path)

    monkeypatch.setattr(ImageStore, "_read_record", counting)
    for ref, want in (("task-2", imgs[2]), (source, imgs[3])):
        assert store.resolve(ref).digest == want.digest  # the first time: a scan
        assert len(reads) >= 6
        reads.clear()
        for _ in range(3):
            assert store.resolve(ref).digest == want.digest
        assert reads == [want.digest[7:] + ".json"] * 3
        reads.clear()
    # the name moves to a newer image: the store changed, so the ref is looked up in full
    oci_layout(tmp_path / "oci2", {"v": [layer_tar([entry("g", b"new")])]})
    newer = store.import_(f"oci:{tmp_path / 'oci2'}:v", name="task-2")
    assert store.resolve("task-2").digest == newer.digest
    assert store.statistics()["hits"] >= 8


def test_last_use_is_recorded_at_most_once_a_minute(store, tmp_path):
    oci_layout(tmp_path / "oci", {"v1": [BASE]})
    image = store.import_(f"oci:{tmp_path / 'oci'}:v1", name="test:v1")
    record = store.root / "images" / f"{image.digest[7:]}.json"
    before = record.stat().st_mtime_ns, image.last_used
    for _ in range(3):
        store.release(store.acquire("test:v1"))
    assert (record.stat().st_mtime_ns, store.lookup("test:v1").last_used) == before
    rec = json.loads(record.read_text())  # as if last used two minutes ago
    rec["last_used"] -= 120
    record.write_text(json.dumps(rec))
    store.release(store.acquire("test:v1"))
    assert store.lookup("test:v1").last_used > before[1]


def _flags(path: Path) -> int | None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return struct.unpack("i", fcntl.ioctl(fd, 0x80086601, b"\0" * 4))[0]
    except OSError:
        return None  # a file system without inode flags
    finally:
        os.close(fd)


def test_unpacks_go_to_block_groups_picked_afresh(tmp_path):
    """The store's work dir carries ext4's top-of-hierarchy flag (chattr +T) where the file
    system has inode flags: without it, an unpack after a removal crawled through the inodes
    that removal freed (docs/sandbox.md). Nothing else is flagged, and a file system
    without the flag still takes a store."""
    store = ImageStore(tmp_path / "store")
    flags = _flags(store.root / "tmp")
    if flags is not None:
        assert flags & 0x00020000
        assert not (_flags(store.root / "layers") or 0) & 0x00020000
    again = ImageStore(tmp_path / "store")  # flagged already: left as it is
    assert _flags(again.root / "tmp") == flags
    shm = Path("/dev/shm") / f"rolloutd-store-{os.getpid()}"
    try:
        ImageStore(shm)  # tmpfs: no such flag, no error
    finally:
        shutil.rmtree(shm, ignore_errors=True)
