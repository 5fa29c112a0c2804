"""Routes for the image store (``/v1/images``).

    POST   /v1/images            import a local source or pull docker://; with
                                 ``Accept: application/x-ndjson`` the answer streams
                                 ``{"progress": {"done", "total"}}`` lines, then
                                 ``{"image": {...}}`` or ``{"error": {...}}``
    GET    /v1/images            the stored images
    DELETE /v1/images/{ref}      remove one (a digest, a unique digest prefix, or a name
                                 without '/'; the CLI finds other names' digests)
    POST   /v1/images/gc         shrink the store to a size (least recently used first)
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

import trio
from pydantic import BaseModel
from quart import request
from quart_schema import document_request, document_response
from quart_trio import QuartTrio

from rolloutd.daemon.api._errors import answer_for
from rolloutd.daemon.api._http import (
    BODY_ERRORS,
    NDJSON,
    IdConverter,
    errors,
    json_body,
    ndjson,
    parse,
)
from rolloutd.daemon.errors import RequestError
from rolloutd.daemon.images import ImageGc, ImageImport, ImageInfo

#: Progress lines at most this often (seconds).
PROGRESS_EVERY_S = 0.25


class Images(Protocol):
    """What these routes call (``rolloutd.daemon.images.Images``)."""

    async def import_(self, req: ImageImport,
                      progress: Callable[[int, int], None] | None = None) -> ImageInfo: ...
    async def list(self) -> list[ImageInfo]: ...
    async def remove(self, ref: str) -> ImageInfo: ...
    async def gc(self, req: ImageGc) -> dict[str, Any]: ...


class ImageList(BaseModel):
    images: list[ImageInfo]


class GcReport(BaseModel):
    removed: list[str]
    freed_bytes: int
    kept_bytes: int


class ImageRef(IdConverter):
    """An image's digest, digest prefix or name (a path segment; never ``gc``)."""

    reserved = ("gc",)


def register(app: QuartTrio, images: Images) -> None:
    app.url_map.converters["image_ref"] = ImageRef

    @app.post("/v1/images")
    @document_request(ImageImport)
    @document_response(ImageInfo, 201)
    @errors(*BODY_ERRORS, 404)
    async def import_image() -> Any:
        """Import an image into the store (once: a stored image is answered as is)."""
        req = parse(ImageImport, await json_body())
        if NDJSON in request.headers.get("Accept", ""):
            return ndjson(_with_progress(images, req))
        return (await images.import_(req)).model_dump(), 201

    @app.get("/v1/images")
    @document_response(ImageList, 200)
    @errors()
    async def list_images() -> Any:
        return {"images": [image.model_dump() for image in await images.list()]}

    @app.delete("/v1/images/<image_ref:ref>")
    @document_response(ImageInfo, 200)
    @errors(404, 405, 409)  # 405: `gc` is no image
    async def remove_image(ref: str) -> Any:
        """Remove an image; its layers go once no other image uses them."""
        return (await images.remove(ref)).model_dump()

    @app.post("/v1/images/gc")
    @document_request(ImageGc)
    @document_response(GcReport, 200)
    @errors(*BODY_ERRORS)
    async def gc_images() -> Any:
        """Remove least recently used images (never one in use) until the store fits."""
        return await images.gc(parse(ImageGc, await json_body()))


async def _with_progress(images: Images, req: ImageImport) -> AsyncGenerator[str]:
    """The import as NDJSON lines: progress while it unpacks, then the image or the error."""
    send, recv = trio.open_memory_channel[tuple[int, int]](1)
    token = trio.lowlevel.current_trio_token()
    last = [0.0]

    def progress(done: int, total: int) -> None:  # called from the store's worker thread
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S or done >= total:
            last[0] = now
            try:
                token.run_sync_soon(_offer, send, (done, total))
            except trio.RunFinishedError:
                pass

    outcome: dict[str, Any] = {}

    async def work() -> None:
        try:
            outcome["image"] = (await images.import_(req, progress)).model_dump()
        except RequestError as exc:
            answer = answer_for(exc)
            outcome["error"] = {"type": answer[1] if answer else "error", "message": str(exc)}
        finally:
            await send.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(work)
        async for done, total in recv:
            yield json.dumps({"progress": {"done": done, "total": total}})
    yield json.dumps(outcome)


def _offer(send: trio.MemorySendChannel[tuple[int, int]], item: tuple[int, int]) -> None:
    try:
        send.send_nowait(item)
    except (trio.WouldBlock, trio.ClosedResourceError):
        pass  # a line is pending (the next one carries newer figures) or the import ended
