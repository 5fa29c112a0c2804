"""apptainer (also a ``singularity`` binary): one instance per sandbox.

``instance start`` fixes the namespaces, so every isolation flag goes there:
``--containall`` (or ``--contain --pid --ipc``), ``--no-mount home,cwd,tmp``,
``--cleanenv``, ``--net --network none`` unless the spec asks for network, a writable
layer (a sparse ext3 overlay of ``disk_mb``, else ``--writable-tmpfs``), and binds for the
workspace, the control dir (same path inside) and the helper's lib dir (read-only). The
helper then runs in the instance through ``exec instance://NAME``.

Images take the same refs as on bwrap (docs/sandbox.md): a ``.sif`` is used as it is; an
OCI layout (``oci:DIR[:TAG]``) or a ``docker save`` tarball (``docker-archive:FILE``) is
converted once with ``apptainer build`` into the SIF cache; an image of the image store
(a digest or a name) is built from its unpacked rootfs; ``docker://`` refs are pulled and
converted once (spython when a ``singularity`` binary is on PATH, else an explicit
``pull``). Every command line is built here explicitly and run with ``trio.run_process``:
cancellable and bounded.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import trio

from ._backend import Backend, Handle
from ._exceptions import ImageNotFound, SandboxStartError
from ._models import SandboxSpec
from .images import ImageStore

log = logging.getLogger(__name__)

_PULL_LIMITER = trio.CapacityLimiter(1)


def instance_name(boot_tag: str, sandbox_id: str) -> str:
    return f"rld-{boot_tag}-{sandbox_id}"


def sif_name(ref: str) -> str:
    """Cache file name for an image ref: readable prefix plus a digest."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", ref.split("://", 1)[-1])[:60]
    return f"{stem}-{hashlib.sha256(ref.encode()).hexdigest()[:10]}.sif"


def start_argv(exe: str, spec: SandboxSpec, *, image: str, name: str, workspace: str,
               control_dir: str, lib_dir: str, overlay: str | None,
               containall: bool = True) -> list[str]:
    """``apptainer instance start`` with every isolation flag (they cannot be added later)."""
    argv = [exe, "instance", "start"]
    argv += ["--containall"] if containall else ["--contain", "--pid", "--ipc"]
    argv += ["--no-home", "--no-mount", "home,cwd,tmp", "--cleanenv"]
    if not spec.network:
        argv += ["--net", "--network", "none"]
    argv += ["--overlay", overlay] if overlay else ["--writable-tmpfs"]
    argv += ["--bind", f"{workspace}:{spec.workdir}",
             "--bind", f"{control_dir}:{control_dir}",
             "--bind", f"{lib_dir}:{lib_dir}:ro"]
    for bind in spec.binds:
        argv += ["--bind", f"{bind.host}:{bind.dest}" + (":ro" if bind.readonly else "")]
    argv += [image, name]
    return argv


def exec_argv(exe: str, name: str, workdir: str, command: list[str]) -> list[str]:
    return [exe, "exec", "--cleanenv", "--pwd", workdir, f"instance://{name}", *command]


def stop_argv(exe: str, name: str, *, force: bool = False) -> list[str]:
    return [exe, "instance", "stop", *(["--force"] if force else ["--timeout", "5"]), name]


def overlay_argv(exe: str, path: str, size_mb: int) -> list[str]:
    return [exe, "overlay", "create", "--sparse", "--size", str(size_mb), path]


def pull_argv(exe: str, dest: str, ref: str) -> list[str]:
    return [exe, "pull", "--force", dest, ref]


def build_argv(exe: str, dest: str, source: str) -> list[str]:
    """``apptainer build`` of a SIF from an OCI layout, a docker archive or a rootfs dir."""
    return [exe, "build", "--force", dest, source]


def build_source(ref: str) -> str | None:
    """The ``apptainer build`` source for an image ref that is an OCI layout or a docker
    archive (None for anything else)."""
    if ref.startswith(("oci:", "docker-archive:")):
        return ref
    if os.path.isdir(ref) and os.path.exists(os.path.join(ref, "oci-layout")):
        return "oci:" + ref
    if ref.endswith((".tar", ".tar.gz", ".tgz")) and os.path.isfile(ref):
        return "docker-archive:" + ref
    return None


def _exists(path: str | Path) -> bool:
    return os.path.exists(path)  # a local stat: fine to call from the event loop


class ApptainerBackend(Backend):
    """Options: apptainer (binary path; default: ``apptainer`` then ``singularity`` on
    PATH), images (the image store: stored images by digest or name, and its ``sif/``
    dir as the SIF cache), image_cache_dir (default: the store's ``sif/``, else
    <state_dir>/images), containall (default True; False
    gives ``--contain --pid --ipc``), pull_timeout_s, command_timeout_s."""

    name: ClassVar[str] = "apptainer"
    parkable: ClassVar[bool] = False  # the helper runs in an instance started per spec

    def __init__(self, *, apptainer: str | None = None, image_cache_dir: str | None = None,
                 containall: bool = True, pull_timeout_s: float = 1800.0,
                 command_timeout_s: float = 120.0, images: ImageStore | None = None,
                 **options: Any) -> None:
        super().__init__(**options)
        self.exe = apptainer or shutil.which("apptainer") or shutil.which("singularity") or ""
        self.images = images
        if image_cache_dir:
            self.image_cache = Path(image_cache_dir)
        elif images is not None:
            self.image_cache = images.root / "sif"
        else:
            self.image_cache = self.layout.state_dir / "images"
        self.containall = containall
        self.pull_timeout_s = pull_timeout_s
        self.command_timeout_s = command_timeout_s
        self._image_locks: dict[str, trio.Lock] = {}

    def check(self) -> None:
        if not self.exe or not os.access(self.exe, os.X_OK):
            raise SandboxStartError("apptainer backend: neither `apptainer` nor `singularity` "
                                    "is installed (or the configured binary is not executable)")

    def _helper_python(self, spec: SandboxSpec) -> str:
        return spec.python or "python3"  # the image's interpreter

    def _sandbox_python(self, spec: SandboxSpec) -> str:
        return spec.python or "python3"

    def _disk_mechanism(self, spec: SandboxSpec, handle: Handle) -> str:
        return "overlay" if spec.disk_mb else "writable-tmpfs (64 MiB default)"

    async def _prepare(self, spec: SandboxSpec, handle: Handle) -> None:
        self.check()
        if not spec.image:
            raise SandboxStartError("apptainer sandboxes need spec.image (.sif or docker://)")
        image = await self.image(spec.image)
        overlay = None
        if spec.disk_mb:
            overlay = str(handle.dirs.root / "overlay.img")
            await self._run(overlay_argv(self.exe, overlay, spec.disk_mb))
        name = instance_name(handle.dirs.boot_tag, handle.dirs.id)
        argv = start_argv(self.exe, spec, image=image, name=name,
                          workspace=str(handle.dirs.workspace),
                          control_dir=str(handle.dirs.control),
                          lib_dir=str(self.layout.lib_dir()), overlay=overlay,
                          containall=self.containall)
        assert handle.plan is not None
        await self._run(handle.plan.exec_prefix() + argv)
        handle.extra["instance"] = name

    def _command(self, spec: SandboxSpec | None, handle: Handle, helper: list[str]) -> list[str]:
        assert spec is not None  # not parkable
        return exec_argv(self.exe, handle.extra["instance"], self._workdir(spec, handle), helper)

    async def _finish(self, handle: Handle) -> None:
        name = handle.extra.pop("instance", None)
        if name is not None:
            await self._stop(name)

    async def _sweep_one(self, tag: str, sandbox_id: str, root: Path) -> None:
        if self.exe:
            await self._stop(instance_name(tag, sandbox_id))

    async def _stop(self, name: str) -> None:
        for force in (False, True):
            with contextlib.suppress(SandboxStartError):
                await self._run(stop_argv(self.exe, name, force=force), timeout_s=10.0)
                return

    async def _run(self, argv: list[str], timeout_s: float | None = None) -> None:
        limit = timeout_s or self.command_timeout_s
        with trio.move_on_after(limit) as scope:
            result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True,
                                            check=False, stdin=subprocess.DEVNULL)
        if scope.cancelled_caught:
            raise SandboxStartError(f"`{' '.join(argv[:3])}` took longer than {limit:.0f} s")
        if result.returncode != 0:
            raise SandboxStartError(f"`{' '.join(argv[:3])}` failed ({result.returncode}): "
                                    f"{result.stderr.decode(errors='replace').strip()[-1000:]}")

    async def image(self, ref: str) -> str:
        """A local .sif for ``ref``: a .sif path as is; an OCI layout, a docker archive or a
        stored image built once, a ``docker://`` (or other) ref pulled once, into the cache."""
        ref = ref.removeprefix("sif:")
        source = build_source(ref)
        if source is None and "://" not in ref and not ref.endswith(".sif"):
            stored = self.images.lookup(ref) if self.images is not None else None
            if stored is not None:
                source = str(stored.rootfs)
        if source is not None:
            return await self._cached(ref, build_argv, source)
        if "://" not in ref:
            if not _exists(ref):
                raise ImageNotFound(f"apptainer image {ref} does not exist")
            return ref
        return await self._cached(ref, pull_argv, ref)

    async def _cached(self, ref: str, make: Callable[[str, str, str], list[str]],
                      source: str) -> str:
        dest = self.image_cache / sif_name(ref)
        lock = self._image_locks.setdefault(ref, trio.Lock())
        async with lock:
            if _exists(dest):
                return str(dest)
            self.image_cache.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_suffix(f".part{os.getpid()}")
            log.info("converting %s into %s (once)", ref, dest)
            if make is pull_argv and os.path.basename(self.exe) == "singularity" \
                    and shutil.which("singularity"):
                await self._pull_spython(ref, tmp)
            else:
                await self._run(make(self.exe, str(tmp), source), timeout_s=self.pull_timeout_s)
            tmp.rename(dest)
        return str(dest)

    async def _pull_spython(self, ref: str, dest: Path) -> None:
        from spython.main import Client

        def pull() -> str:
            return str(Client.pull(ref, name=dest.name, pull_folder=str(dest.parent), force=True))

        with trio.move_on_after(self.pull_timeout_s):
            await trio.to_thread.run_sync(pull, limiter=_PULL_LIMITER)
        if not _exists(dest):
            raise SandboxStartError(f"pulling {ref} failed (spython)")
