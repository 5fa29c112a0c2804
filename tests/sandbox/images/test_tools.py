"""The store reads what real tools write: umoci's OCI layouts, skopeo's docker-archives,
siftool's SIF files (skipped where a tool is missing)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rolloutd.sandbox.images import ImageError, ImageStore
from rolloutd.sandbox.images._sif import primary_partition


def _need(*tools: str) -> None:
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed")


def _rootfs(path: Path) -> Path:
    (path / "bin").mkdir(parents=True)
    (path / "etc").mkdir()
    (path / "bin/hello").write_text("#!/bin/sh\necho hello\n")
    (path / "bin/hello").chmod(0o755)
    (path / "etc/os-release").write_text("ID=test\n")
    os.symlink("hello", path / "bin/hi")
    return path


def _run(*argv: str | Path) -> None:
    subprocess.run([str(a) for a in argv], check=True, capture_output=True, timeout=120)


@pytest.mark.slow
def test_umoci_layout_and_skopeo_archive(tmp_path):
    _need("umoci", "skopeo")
    src = _rootfs(tmp_path / "src")
    oci = tmp_path / "oci"
    _run("umoci", "init", "--layout", oci)
    _run("umoci", "new", "--image", f"{oci}:t")
    _run("umoci", "insert", "--image", f"{oci}:t", src, "/")
    _run("umoci", "config", "--image", f"{oci}:t", "--config.env", "PATH=/bin:/usr/bin",
         "--config.workingdir", "/etc")
    archive = tmp_path / "img.tar"
    _run("skopeo", "copy", "--quiet", f"oci:{oci}:t", f"docker-archive:{archive}:localhost/t:1")
    store = ImageStore(tmp_path / "store")
    image = store.resolve(f"oci:{oci}:t")
    assert (image.rootfs / "bin/hello").read_text().endswith("echo hello\n")
    assert os.readlink(image.rootfs / "bin/hi") == "hello"
    assert image.config.env["PATH"] == "/bin:/usr/bin" and image.config.workdir == "/etc"
    other = store.resolve(str(archive))
    assert other.names == ("localhost/t:1",)
    assert other.layers == image.layers  # the same diff ids: one layer dir
    assert store.statistics()["layers"] == 1


@pytest.mark.slow
def test_sif(tmp_path):
    _need("mksquashfs", "siftool", "unsquashfs")
    src = _rootfs(tmp_path / "src")
    os.chmod(src / "bin/hello", 0o4755)
    sqfs, sif = tmp_path / "root.sqfs", tmp_path / "img.sif"
    _run("mksquashfs", src, sqfs, "-noappend", "-comp", "gzip", "-no-progress")
    _run("siftool", "new", sif)
    _run("siftool", "add", sif, sqfs, "--datatype", "4", "--parttype", "2", "--partfs", "1",
         "--partarch", "2")
    part = primary_partition(str(sif))
    assert part.size == sqfs.stat().st_size
    store = ImageStore(tmp_path / "store")
    image = store.resolve(str(sif))
    assert (image.rootfs / "etc/os-release").read_text() == "ID=test\n"
    assert os.stat(image.rootfs / "bin/hello").st_mode & 0o7777 == 0o755
    assert image.config.env["PATH"].startswith("/usr/local/sbin")
    assert store.resolve(f"sif:{sif}").digest == image.digest
    assert store.statistics()["misses"] == 1
    (tmp_path / "bad.sif").write_bytes(b"#!/bin/sh\n" + b"\0" * 200)
    with pytest.raises(ImageError, match="not a SIF"):
        store.resolve(str(tmp_path / "bad.sif"))
