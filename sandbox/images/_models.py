"""What the image store hands out: an image, its runtime config, a GC report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The PATH an image gets when its config names none (SIF images, bare layouts).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True, slots=True)
class ImageConfig:
    """The parts of an image's config a sandbox uses."""

    env: dict[str, str]
    """From the config's "Env" (KEY=VALUE list), PATH included."""
    workdir: str | None
    user: str | None
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]

    @classmethod
    def from_oci(cls, config: dict[str, Any]) -> ImageConfig:
        """From an OCI/docker image config's "config" object (missing keys: defaults)."""
        env: dict[str, str] = {}
        for item in config.get("Env") or ():
            key, sep, value = str(item).partition("=")
            if sep:
                env[key] = value
        env.setdefault("PATH", DEFAULT_PATH)
        return cls(
            env=env,
            workdir=str(config.get("WorkingDir") or "") or None,
            user=str(config.get("User") or "") or None,
            entrypoint=tuple(str(a) for a in config.get("Entrypoint") or ()),
            cmd=tuple(str(a) for a in config.get("Cmd") or ()),
        )

    def to_json(self) -> dict[str, Any]:
        return {"env": self.env, "workdir": self.workdir, "user": self.user,
                "entrypoint": list(self.entrypoint), "cmd": list(self.cmd)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ImageConfig:
        return cls(env=dict(data["env"]), workdir=data["workdir"], user=data["user"],
                   entrypoint=tuple(data["entrypoint"]), cmd=tuple(data["cmd"]))


@dataclass(frozen=True, slots=True)
class Image:
    """One stored image. ``rootfs`` is read-only: it is never modified after creation."""

    digest: str
    """"sha256:<hex>": OCI, the manifest's digest; docker-archive, the config blob's digest
    (the image id: `docker save` keeps no manifest bytes); SIF, the file's digest."""
    rootfs: Path
    config: ImageConfig
    layers: tuple[str, ...]
    """Layer ids bottom first: diff ids ("sha256:..", of the uncompressed tar); a SIF's one
    layer has the SIF's digest."""
    size: int
    """Bytes of unpacked data this image uses (each of its layers counted once)."""
    names: tuple[str, ...]
    source: str
    created: float
    last_used: float


@dataclass(frozen=True, slots=True)
class GcReport:
    """What :meth:`ImageStore.gc` did."""

    removed_images: list[str]
    """Digests of the images removed."""
    freed_bytes: int
    kept_bytes: int
