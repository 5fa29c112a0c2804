"""Task images as clients and the pipeline see them: the node's one image store, import
and removal for the API, and prefetch ahead of INIT.

The store (``rolloutd.sandbox.images``) is synchronous and may block for seconds (an
unpack): every call goes through a worker thread. Prefetch resolves an image in the
background as soon as a rollout or a batch that needs it is accepted, at most
``PREFETCH_CONCURRENCY`` at a time; INIT's open then finds it unpacked, or waits on the
same unpack (the store unpacks a ref once however many ask). A task's image is not
checked at submit (the task schema takes any ref, and a schema-valid request is accepted):
one that cannot be found or read fails its rollouts in INIT with ``ImageNotFound`` /
``ImageError``, never a reward, and prefetch has begun on it by then. Returns data; the API
layer shapes answers.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

import trio
from pydantic import BaseModel, ConfigDict, Field

from rolloutd.daemon.config import Settings
from rolloutd.daemon.errors import ImageInUse, InvalidImage, NotFound
from rolloutd.sandbox import ImageError, ImageNotFound
from rolloutd.sandbox.images import Image, ImageStore

log = logging.getLogger(__name__)

#: Unpacks prefetch runs at once (each is one CPU-bound decompression).
PREFETCH_CONCURRENCY = 2
#: Refs remembered as prefetched (their second mention does nothing).
PREFETCH_MEMORY = 10_000
#: How often the store's figures are re-read while the node runs (and after each change).
FIGURES_EVERY_S = 10.0

Progress = Callable[[int, int], None]


class ImageInfo(BaseModel):
    """An image in the store, as the API lists it."""

    digest: str
    names: list[str]
    source: str
    size: int = Field(description="Bytes of unpacked data the image uses.")
    layers: list[str]
    env: dict[str, str]
    workdir: str | None
    created: float
    last_used: float


class ImageImport(BaseModel):
    """``POST /v1/images``: import a local source or pull a ``docker://`` reference."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(min_length=1, max_length=4096, description=(
        "oci:DIR[:TAG], docker-archive:FILE[:NAME], a .sif file, or docker://REF (see "
        "docs/sandbox.md)."))
    name: str | None = Field(None, min_length=1, max_length=512,
                             description="A name to find the image by later.")


class PrefetchRequest(BaseModel):
    """``POST /v1/federation/prefetch``: a peer that holds a batch asks this daemon, a home of
    these images, to fetch them ahead of the groups it will place here (answered at once)."""

    model_config = ConfigDict(extra="forbid")

    images: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(
        min_length=1, max_length=256, description="Image refs, as tasks name them.")


class ImageGc(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_gb: float | None = Field(None, ge=0, le=1e9, description="Default: image_cache_max_gb.")


def info(image: Image) -> ImageInfo:
    return ImageInfo(digest=image.digest, names=list(image.names), source=image.source,
                     size=image.size, layers=list(image.layers), env=dict(image.config.env),
                     workdir=image.config.workdir, created=image.created,
                     last_used=image.last_used)


def task_images(tasks: Iterable[dict[str, Any]]) -> list[str]:
    """The distinct image refs ``tasks`` name, in order."""
    refs = (task.get("image") for task in tasks)
    return list(dict.fromkeys(ref for ref in refs if isinstance(ref, str) and ref))


class Images:
    """The node's image store and its prefetcher. Start ``run`` in a nursery for prefetch
    (without it, prefetch requests are ignored and INIT unpacks on demand)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        root = settings.image_cache_dir or settings.cache_dir / "images"
        gb = settings.image_cache_max_gb
        self.store = ImageStore(Path(root), max_bytes=int(gb * 2**30) if gb else None)
        self._nursery: trio.Nursery | None = None
        self._limiter = trio.CapacityLimiter(PREFETCH_CONCURRENCY)
        self._seen: dict[str, None] = {}
        self._figures: dict[str, float | int] = {}  # the store's, refreshed by _refresh
        self._resolved: dict[str, str] = {}  # ref -> digest, of each prefetch that succeeded
        self._held: list[str] = []  # refs of stored images (see held)
        self.prefetched = 0
        self.prefetch_failed = 0
        self.prefetching = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                while True:  # the store's figures, for /v1/status and /metrics
                    await self._refresh(held=True)
                    await trio.sleep(FIGURES_EVERY_S)
            finally:
                self._nursery = None

    async def _refresh(self, *, held: bool = False) -> None:
        """Re-read the store's counts and sizes (a scan of its records) off the event loop;
        with ``held``, also the refs it holds (another scan: not after every prefetch)."""
        self._figures = await trio.to_thread.run_sync(self.store.statistics)
        if held:
            resolved = list(self._resolved.items())
            stored = await trio.to_thread.run_sync(self._held_refs, resolved)
            before = dict(resolved)  # a prefetch that ended meanwhile keeps its ref first
            fresh = [ref for ref in reversed(self._resolved) if ref not in before]
            self._held = [*fresh, *(ref for ref in stored if ref not in fresh)]

    def _held_refs(self, resolved: list[tuple[str, str]]) -> list[str]:
        images = self.store.images()
        stored = {image.digest for image in images}
        refs = dict.fromkeys(ref for ref, digest in reversed(resolved) if digest in stored)
        for image in images:
            refs.update(dict.fromkeys([*image.names, image.source]))
        return list(refs)

    def held(self) -> list[str]:
        """The image refs this node holds unpacked, the most recently resolved first: the
        refs its prefetches resolved (as tasks name them) whose image is still stored, then
        the names and sources of its store's images. Read from the store every
        ``FIGURES_EVERY_S`` and after each import, removal and gc; a prefetch puts its ref
        first at once. What a thief tells a victim when it asks for work (daemon/steal.py)."""
        return self._held

    # ---- the API's operations -------------------------------------------------------

    async def import_(self, req: ImageImport, progress: Progress | None = None) -> ImageInfo:
        """Import (or pull) ``req.source``; an image already stored is answered as is."""
        try:
            image = await trio.to_thread.run_sync(
                lambda: self.store.import_(req.source, name=req.name, progress=progress))
        except ImageNotFound as exc:
            raise NotFound(str(exc)) from None
        except ImageError as exc:
            raise InvalidImage(str(exc)) from None
        await self._refresh(held=True)
        return info(image)

    async def list(self) -> list[ImageInfo]:
        return [info(image) for image in await trio.to_thread.run_sync(self.store.images)]

    async def remove(self, ref: str) -> ImageInfo:
        try:
            gone = info(await trio.to_thread.run_sync(self.store.remove, ref))
            await self._refresh(held=True)
            return gone
        except ImageNotFound:
            raise NotFound(f"no image {ref!r} in the store") from None
        except ImageError as exc:
            raise ImageInUse(str(exc)) from None

    async def gc(self, req: ImageGc) -> dict[str, Any]:
        gb = req.max_gb if req.max_gb is not None else self.settings.image_cache_max_gb
        max_bytes = int(gb * 2**30) if gb is not None else None
        report = await trio.to_thread.run_sync(self.store.gc, max_bytes)
        await self._refresh(held=True)
        return {"removed": list(report.removed_images), "freed_bytes": report.freed_bytes,
                "kept_bytes": report.kept_bytes}

    # ---- submit and prefetch --------------------------------------------------------

    def prefetch(self, tasks: Iterable[dict[str, Any]]) -> None:
        """Resolve the images of ``tasks`` in the background (each ref once)."""
        if self._nursery is None:
            return
        for ref in task_images(tasks):
            if ref in self._seen:
                continue
            self._seen[ref] = None
            if len(self._seen) > PREFETCH_MEMORY:
                del self._seen[next(iter(self._seen))]
            self._nursery.start_soon(self._prefetch, ref)

    async def _prefetch(self, ref: str) -> None:
        self.prefetching += 1
        try:
            async with self._limiter:
                started = time.monotonic()
                image = await trio.to_thread.run_sync(self.store.resolve, ref)
            self.prefetched += 1
            self._resolved.pop(ref, None)
            self._resolved[ref] = image.digest
            if len(self._resolved) > PREFETCH_MEMORY:
                del self._resolved[next(iter(self._resolved))]
            self._held = [ref, *(r for r in self._held if r != ref)]
            await self._refresh()
            log.info("prefetched image %s in %.1f s", ref, time.monotonic() - started)
        except (ImageError, OSError) as exc:  # INIT reports it on the rollout itself
            self.prefetch_failed += 1
            self._seen.pop(ref, None)
            log.warning("prefetch of image %s failed: %s", ref, exc)
        finally:
            self.prefetching -= 1

    def statistics(self) -> dict[str, Any]:
        return {**self._figures, "prefetched": self.prefetched,
                "prefetching": self.prefetching, "prefetch_failed": self.prefetch_failed,
                "root": os.fspath(self.store.root)}
