"""Where images come from: parse a source ref and read its manifest, config and layers.

    oci:PATH[:TAG]              an OCI layout dir (or any dir holding ``oci-layout``)
    docker-archive:PATH[:NAME]  a `docker save` tar (or any file ending .tar/.tar.gz/.tgz);
                                legacy manifest.json or an OCI layout inside
    sif:PATH                    a SIF file (or any file ending .sif)
    docker://REF                copied with skopeo into an OCI layout first

Nothing is unpacked here: a :class:`Source` describes the layers and opens their blobs.
Every blob named by a digest is checked against it as it is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from .._exceptions import ImageError, ImageNotFound
from ._models import ImageConfig
from ._unpack import Readable, clean_name

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HEX_NAME = re.compile(r"(?:^|/)([0-9a-f]{64})(?:\.json)?$")
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json")
_REF_NAME = "org.opencontainers.image.ref.name"
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
#: How long ``skopeo copy docker://...`` may take.
SKOPEO_TIMEOUT_S = 900.0


@dataclass
class LayerBlob:
    """One layer blob of a source, opened on demand."""

    what: str
    size: int
    diff_id: str | None
    digest: str | None
    open: Callable[[], contextlib.AbstractContextManager[Readable]]


@dataclass
class Source:
    """A source image, read but not unpacked."""

    digest: str
    config: ImageConfig
    layers: list[LayerBlob] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    sif: str | None = None


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _load_json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ImageError(f"{what}: not valid JSON ({e})") from e


class _Bounded:
    """``size`` bytes of an open file from ``offset`` (a member of an uncompressed tar)."""

    def __init__(self, f: IO[bytes], offset: int, size: int) -> None:
        self.f, self.left = f, size
        f.seek(offset)

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data


class _Files:
    """Blob access by relative path: a directory, or the members of a plain tar file."""

    def __init__(self, root: str, tar_members: dict[str, tarfile.TarInfo] | None = None) -> None:
        self.root, self.members = root, tar_members

    def _member(self, rel: str) -> tarfile.TarInfo:
        assert self.members is not None
        name: str | None = clean_name(rel)
        for _ in range(16):  # follow links between members (docker save dedups layers)
            member = self.members.get(name or "")
            if member is None:
                raise ImageError(f"{self.root}: the archive has no {rel}")
            if not (member.issym() or member.islnk()):
                return member
            base = "" if member.islnk() else os.path.dirname(name or "")
            name = clean_name(os.path.normpath(os.path.join(base, member.linkname)))
        raise ImageError(f"{self.root}: {rel}: too many links")

    def exists(self, rel: str) -> bool:
        if self.members is None:
            return os.path.exists(os.path.join(self.root, rel))
        return clean_name(rel) in self.members

    def size(self, rel: str) -> int:
        if self.members is None:
            return os.path.getsize(self._path(rel))
        return self._member(rel).size

    def _path(self, rel: str) -> str:
        clean = clean_name(rel)
        if clean is None:
            raise ImageError(f"{self.root}: bad blob path {rel!r}")
        return os.path.join(self.root, clean)

    @contextlib.contextmanager
    def open(self, rel: str) -> Iterator[Readable]:
        try:
            if self.members is None:
                with open(self._path(rel), "rb") as f:
                    yield f
            else:
                member = self._member(rel)
                with open(self.root, "rb") as f:
                    yield _Bounded(f, member.offset_data, member.size)
        except FileNotFoundError as e:
            raise ImageError(f"{self.root}: missing blob {rel}") from e
        except PermissionError as e:
            raise ImageError(f"{self.root}: cannot read blob {rel}: permission denied") from e

    def read(self, rel: str, digest: str | None = None) -> bytes:
        with self.open(rel) as f:
            data = f.read()
        if digest is not None and _sha(data) != digest:
            raise ImageError(f"{self.root}: blob {rel} does not match its digest {digest}")
        return data


def _blob_path(digest: str, where: str) -> str:
    if not _DIGEST.fullmatch(str(digest)):
        raise ImageError(f"{where}: unsupported or malformed digest {digest!r}")
    return "blobs/sha256/" + digest.split(":", 1)[1]


def _layer_blobs(files: _Files, where: str, paths: list[tuple[str, str | None]],
                 diff_ids: list[str]) -> list[LayerBlob]:
    if len(paths) != len(diff_ids):
        raise ImageError(f"{where}: {len(paths)} layers but {len(diff_ids)} diff ids")
    out = []
    for (rel, digest), diff_id in zip(paths, diff_ids, strict=True):
        if not _DIGEST.fullmatch(str(diff_id)):
            raise ImageError(f"{where}: unsupported or malformed diff id {diff_id!r}")
        out.append(LayerBlob(what=f"{where}: layer {rel}", size=files.size(rel),
                             diff_id=diff_id, digest=digest,
                             open=lambda rel=rel: files.open(rel)))  # type: ignore[misc]
    return out


def _config(raw: Any, where: str) -> tuple[ImageConfig, list[str]]:
    if not isinstance(raw, dict):
        raise ImageError(f"{where}: the image config is not a JSON object")
    diff_ids = (raw.get("rootfs") or {}).get("diff_ids")
    if not isinstance(diff_ids, list):
        raise ImageError(f"{where}: the image config has no rootfs.diff_ids")
    return ImageConfig.from_oci(raw.get("config") or {}), [str(d) for d in diff_ids]


def _read_oci(files: _Files, where: str, tag: str | None) -> Source:
    index = _load_json(files.read("index.json"), f"{where}/index.json")
    manifests = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(manifests, list) or not manifests:
        raise ImageError(f"{where}: index.json lists no manifests")
    tags = [str((m.get("annotations") or {}).get(_REF_NAME, "")) for m in manifests]
    if tag is not None:
        chosen = [m for m, t in zip(manifests, tags, strict=True) if t == tag]
        if not chosen:
            raise ImageNotFound(f"{where}: no tag {tag!r} (tags: {', '.join(tags) or 'none'})")
        desc = chosen[0]
    elif len(manifests) == 1:
        desc = manifests[0]
    else:
        raise ImageError(f"{where}: {len(manifests)} images; name one of the tags: "
                         f"{', '.join(t or '(untagged)' for t in tags)}")
    for _ in range(4):  # an index (multi-arch) points at manifests
        digest = str(desc.get("digest"))
        data = files.read(_blob_path(digest, where), digest)
        manifest = _load_json(data, f"{where}: manifest {digest}")
        if not isinstance(manifest, dict):
            raise ImageError(f"{where}: manifest {digest} is not a JSON object")
        if desc.get("mediaType") in _INDEX_TYPES or "manifests" in manifest:
            desc = _pick_platform(manifest.get("manifests") or [], where)
            continue
        break
    else:
        raise ImageError(f"{where}: image indexes nested too deep")
    cdesc = manifest.get("config") or {}
    cdigest = str(cdesc.get("digest"))
    raw = _load_json(files.read(_blob_path(cdigest, where), cdigest), f"{where}: config")
    config, diff_ids = _config(raw, where)
    layer_descs = manifest.get("layers") or []
    paths: list[tuple[str, str | None]] = []
    for layer in layer_descs:
        ldigest = str(layer.get("digest"))
        paths.append((_blob_path(ldigest, where), ldigest))
    layers = _layer_blobs(files, where, paths, diff_ids)
    return Source(digest=digest, config=config, layers=layers)


def _pick_platform(manifests: list[Any], where: str) -> Any:
    arch = _ARCH.get(platform.machine().lower(), platform.machine().lower())
    seen = []
    for m in manifests:
        plat = m.get("platform") or {}
        seen.append(f"{plat.get('os')}/{plat.get('architecture')}")
        if plat.get("os") == "linux" and plat.get("architecture") == arch:
            return m
    raise ImageError(f"{where}: no linux/{arch} image in the index (has: {', '.join(seen)})")


def _read_docker_archive(path: str, name: str | None, tmp: str) -> Source:
    with open(path, "rb") as f:
        magic = f.read(2)
    plain = path
    if magic == b"\x1f\x8b":  # a .tar.gz: random access needs the plain tar
        plain = os.path.join(tmp, "archive.tar")
        exe = shutil.which("pigz") or shutil.which("gzip") or "gzip"
        with open(path, "rb") as src, open(plain, "wb") as dst:
            proc = subprocess.run([exe, "-dc"], stdin=src, stdout=dst, stderr=subprocess.PIPE,
                                  check=False)
        if proc.returncode != 0:
            raise ImageError(f"{path}: cannot decompress: "
                             f"{proc.stderr.decode(errors='replace').strip()}")
    try:
        with tarfile.open(plain, "r:") as tar:
            members = {}
            for m in tar.getmembers():
                clean = clean_name(m.name)
                if clean is not None:
                    members[clean] = m
    except (tarfile.TarError, EOFError) as e:
        raise ImageError(f"{path}: not a readable tar archive ({e})") from e
    files = _Files(plain, members)
    if "manifest.json" not in members:
        if "index.json" in members:
            return _read_oci(files, path, name)
        raise ImageError(f"{path}: not a docker-archive (no manifest.json or index.json)")
    entries = _load_json(files.read("manifest.json"), f"{path}: manifest.json")
    if not isinstance(entries, list) or not entries:
        raise ImageError(f"{path}: manifest.json lists no images")
    all_tags = [str(t) for e in entries for t in (e.get("RepoTags") or [])]
    if name is not None:
        chosen = [e for e in entries if name in (e.get("RepoTags") or [])]
        if not chosen:
            raise ImageNotFound(f"{path}: no image named {name!r} "
                                f"(names: {', '.join(all_tags) or 'none'})")
        entry = chosen[0]
    elif len(entries) == 1:
        entry = entries[0]
    else:
        raise ImageError(f"{path}: {len(entries)} images; name one of: {', '.join(all_tags)}")
    config_rel = str(entry.get("Config"))
    config_bytes = files.read(config_rel)
    digest = _sha(config_bytes)
    named = _HEX_NAME.search(config_rel)
    if named and named.group(1) != digest.split(":", 1)[1]:
        raise ImageError(f"{path}: config {config_rel} does not match its digest")
    config, diff_ids = _config(_load_json(config_bytes, f"{path}: config"), path)
    paths: list[tuple[str, str | None]] = []
    for rel in entry.get("Layers") or []:
        found = re.search(r"blobs/sha256/([0-9a-f]{64})$", str(rel))
        paths.append((str(rel), f"sha256:{found.group(1)}" if found else None))
    layers = _layer_blobs(files, path, paths, diff_ids)
    names = [name] if name is not None else [str(t) for t in entry.get("RepoTags") or []]
    return Source(digest=digest, config=config, layers=layers, names=names)


def _split_tag(rest: str, exists: Callable[[str], bool]) -> tuple[str, str | None]:
    """``PATH[:TAG]``: the whole string when it names an existing path, else split at the
    first colon after which the path exists (a name may hold colons: ``debian:12``)."""
    if exists(rest) or ":" not in rest:
        return rest, None
    at = rest.find(":")
    while at != -1:
        if exists(rest[:at]):
            return rest[:at], rest[at + 1:] or None
        at = rest.find(":", at + 1)
    path, _, tag = rest.rpartition(":")
    return path, tag or None


def _sha_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _skopeo(ref: str, tmp: str) -> str:
    exe = shutil.which("skopeo")
    if exe is None:
        raise ImageError(f"docker://{ref}: pulling needs skopeo on PATH")
    layout = os.path.join(tmp, "pulled")
    argv = [exe, "copy", "--quiet", f"docker://{ref}", f"oci:{layout}:latest"]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=SKOPEO_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        raise ImageError(f"docker://{ref}: skopeo copy took over {SKOPEO_TIMEOUT_S:.0f} s") from e
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()[-2000:]
        raise ImageError(f"docker://{ref}: skopeo copy failed: {err}")
    return layout


def source_path(ref: str) -> str | None:
    """The local file or dir a source ref reads (for change detection), if any."""
    kind, path, _ = _parse(ref)
    return path if kind in ("oci", "docker-archive", "sif") else None


def _parse(ref: str) -> tuple[str | None, str, str | None]:
    if ref.startswith("docker://"):
        return "docker", ref[len("docker://"):], None
    for kind, exists in (("oci", os.path.isdir), ("docker-archive", os.path.isfile)):
        if ref.startswith(kind + ":"):
            path, tag = _split_tag(ref[len(kind) + 1:], exists)
            return kind, path, tag
    if ref.startswith("sif:"):
        return "sif", ref[4:], None
    if os.path.isdir(ref) and os.path.exists(os.path.join(ref, "oci-layout")):
        return "oci", ref, None
    if os.path.isfile(ref):
        if ref.endswith(".sif"):
            return "sif", ref, None
        if ref.endswith((".tar", ".tar.gz", ".tgz")):
            return "docker-archive", ref, None
    return None, ref, None


def is_source(ref: str) -> bool:
    """Whether ``ref`` is source syntax or an existing source path (else: a stored name)."""
    return _parse(ref)[0] is not None


def open_source(ref: str, tmp: str) -> Source:
    """Read the source ``ref`` (``tmp``: an empty scratch dir the caller removes)."""
    kind, path, tag = _parse(ref)
    if kind is None:
        raise ImageNotFound(f"no stored image and no source named {ref!r}")
    if kind == "docker":
        source = _read_oci(_Files(_skopeo(path, tmp)), ref, "latest")
        source.names = [path]
        return source
    if not os.path.exists(path):
        raise ImageNotFound(f"{ref}: {path} does not exist")
    try:
        if kind == "oci":
            if not os.path.isfile(os.path.join(path, "index.json")):
                raise ImageNotFound(f"{ref}: {path} is not an OCI layout (no index.json)")
            return _read_oci(_Files(path), path, tag)
        if kind == "docker-archive":
            return _read_docker_archive(path, tag, tmp)
        return Source(digest=_sha_file(path), config=ImageConfig.from_oci({}), sif=path)
    except PermissionError as e:
        raise ImageError(f"{ref}: cannot read {e.filename}: permission denied") from e
