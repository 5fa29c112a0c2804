"""Build small test images in memory: layer tars, OCI layouts, docker-archive tars."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path


def entry(name: str, data: bytes | None = b"", *, kind: bytes = tarfile.REGTYPE,
          mode: int = 0o644, link: str = "") -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.linkname = link
    info.mtime = 1_700_000_000
    if kind == tarfile.REGTYPE:
        info.size = len(data or b"")
    else:
        data = None
    return info, data


def d(name: str, mode: int = 0o755):
    return entry(name, kind=tarfile.DIRTYPE, mode=mode)


def layer_tar(entries) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def config_json(diff_ids: list[str], env=("PATH=/usr/bin:/bin", "LANG=C.UTF-8"),
                workdir: str = "/work") -> bytes:
    return json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": list(env), "WorkingDir": workdir, "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }).encode()


def write_blob(layout: Path, data: bytes) -> str:
    digest = sha(data)
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest.split(":")[1]).write_bytes(data)
    return digest


def oci_layout(layout: Path, images: dict[str, list[bytes]], *, gz: bool = True) -> dict[str, str]:
    """An OCI layout with one manifest per tag (layers: plain tars, bottom first);
    returns tag -> manifest digest."""
    layout.mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    manifests, digests = [], {}
    for tag, tars in images.items():
        layer_descs = []
        for tar in tars:
            blob = gzip.compress(tar, mtime=0) if gz else tar
            layer_descs.append({
                "mediaType": "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gz else ""),
                "digest": write_blob(layout, blob), "size": len(blob)})
        config = config_json([sha(t) for t in tars])
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": write_blob(layout, config), "size": len(config)},
            "layers": layer_descs}).encode()
        digest = write_blob(layout, manifest)
        digests[tag] = digest
        manifests.append({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                          "digest": digest, "size": len(manifest),
                          "annotations": {"org.opencontainers.image.ref.name": tag}})
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))
    return digests


def docker_archive(path: Path, tars: list[bytes], tags: list[str], *, gz_layers: bool = False) -> str:
    """A legacy `docker save` tar; returns the image digest (of the config)."""
    config = config_json([sha(t) for t in tars])
    cdigest = sha(config)
    files: dict[str, bytes] = {f"{cdigest[7:]}.json": config}
    layer_paths = []
    for tar in tars:
        blob = gzip.compress(tar, mtime=0) if gz_layers else tar
        name = f"{sha(tar)[7:]}/layer.tar"
        files[name] = blob
        layer_paths.append(name)
    files["manifest.json"] = json.dumps(
        [{"Config": f"{cdigest[7:]}.json", "RepoTags": tags, "Layers": layer_paths}]).encode()
    path.write_bytes(layer_tar([entry(n, b) for n, b in files.items()]))
    return cdigest
