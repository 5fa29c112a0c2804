"""The real test images (tests/_images.py) are built and well formed."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from tests._images import (
    LAYERED_EXPECT,
    LAYERED_GONE,
    MARKER,
    TestImages,
    build_test_images,
)


def blob(layout: Path, digest: str) -> bytes:
    algo, hexd = digest.split(":")
    data = (layout / "blobs" / algo / hexd).read_bytes()
    assert hashlib.sha256(data).hexdigest() == hexd, digest
    return data


def check_layout(layout: Path, tag: str, marker: str, workdir: str) -> dict:
    assert json.loads((layout / "oci-layout").read_text())["imageLayoutVersion"] == "1.0.0"
    index = json.loads((layout / "index.json").read_text())
    [desc] = [
        m
        for m in index["manifests"]
        if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag
    ]
    manifest = json.loads(blob(layout, desc["digest"]))
    config = json.loads(blob(layout, manifest["config"]["digest"]))
    for layer in manifest["layers"]:
        blob(layout, layer["digest"])
    assert len(config["rootfs"]["diff_ids"]) == len(manifest["layers"])
    env = dict(e.split("=", 1) for e in config["config"]["Env"])
    assert env["ROLLOUTD_IMAGE"] == marker
    assert "/bin" in env["PATH"].split(":")
    assert config["config"]["WorkingDir"] == workdir
    # readable by an unprivileged reader (umoci writes 0600; the builder fixes it)
    for dirpath, _, files in os.walk(layout):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o755, dirpath
        for f in files:
            assert stat.S_IMODE(os.stat(os.path.join(dirpath, f)).st_mode) == 0o644, f
    # an independent reader accepts it
    out = subprocess.run(
        ["skopeo", "inspect", f"oci:{layout}:{tag}"], capture_output=True, text=True, check=True
    ).stdout
    assert len(json.loads(out)["Layers"]) == len(manifest["layers"])
    return manifest


def test_oci_layouts(test_images: TestImages) -> None:
    m = check_layout(test_images.debian_oci, test_images.tag, "debian", "/")
    assert len(m["layers"]) == 1
    m = check_layout(test_images.busybox_oci, test_images.tag, "busybox", "/work")
    assert len(m["layers"]) == 1
    m = check_layout(test_images.layered_oci, test_images.tag, "layered", "/work")
    assert len(m["layers"]) == 3


def test_rootfs_markers(test_images: TestImages) -> None:
    assert (test_images.debian_rootfs / MARKER).read_text() == "debian\n"
    assert (test_images.debian_rootfs / "usr/bin/python3").exists()
    bb = test_images.busybox_rootfs
    assert (bb / MARKER).read_text() == "busybox\n"
    assert os.readlink(bb / "bin/sh") == "busybox"
    assert (bb / "work").is_dir() and (bb / "tmp").is_dir()
    assert not (bb / "usr/bin/python3").exists()
    assert (bb / "etc/passwd").read_text().startswith("root:x:0:0:")


def test_layered_whiteout_and_opaque(test_images: TestImages, tmp_path: Path) -> None:
    """umoci's own unpack composes the layers as the image store must."""
    rootless = [] if os.geteuid() == 0 else ["--rootless"]
    bundle = tmp_path / "bundle"
    subprocess.run(
        [
            "umoci",
            "unpack",
            *rootless,
            "--image",
            f"{test_images.layered_oci}:{test_images.tag}",
            bundle,
        ],
        check=True,
        capture_output=True,
    )
    rootfs = bundle / "rootfs"
    for path, content in LAYERED_EXPECT.items():
        assert (rootfs / path).read_text() == content, path
    for path in LAYERED_GONE:
        assert not (rootfs / path).exists(), path
    assert sorted(p.name for p in (rootfs / "data/dir").iterdir()) == ["new"]
    assert (rootfs / "bin/busybox").is_file()


def test_docker_archive(test_images: TestImages) -> None:
    with tarfile.open(test_images.debian_tar) as tar:
        [entry] = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
        assert entry["RepoTags"] == ["localhost/rolloutd-debian:test"]
        names = set(tar.getnames())
        assert entry["Config"] in names
        assert all(layer in names for layer in entry["Layers"])


def test_sif(test_images: TestImages) -> None:
    listing = subprocess.run(
        ["siftool", "list", test_images.debian_sif], capture_output=True, text=True, check=True
    ).stdout
    assert "Squashfs" in listing and f"|{test_images.debian_sif_offset}-" in listing
    files = subprocess.run(
        ["unsquashfs", "-o", str(test_images.debian_sif_offset), "-l", test_images.debian_sif],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "squashfs-root/etc/rolloutd-image" in files.split()
    assert "squashfs-root/usr/bin/python3" in files.split()


def test_build_is_idempotent(test_images: TestImages) -> None:
    t0 = time.monotonic()
    again = build_test_images(test_images.root.parent)
    assert again == test_images
    assert time.monotonic() - t0 < 5


def test_missing_tool_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import _images

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(_images.ImageToolMissing, match="mmdebstrap.*apt-get install mmdebstrap"):
        _images.require_tools("mmdebstrap")
    with pytest.raises(_images.ImageBuildError, match="umoci failed"):
        monkeypatch.undo()
        _images.run(["umoci", "gc", "--layout", "/nonexistent"])
