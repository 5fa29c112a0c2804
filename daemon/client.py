"""Python clients for trainers: ``Client`` (blocking) and ``AsyncClient`` (trio or asyncio).

    from rolloutd.daemon.client import Client
    with Client("http://127.0.0.1:8321") as c:
        trajs = c.run({"kind": "math", "question": "1+1?", "answer": "2"}, n=4)

Errors from the server raise ``RolloutdError`` with its HTTP status, type and message.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx

from rolloutd.daemon.errors import DaemonError
from rolloutd.daemon.streams import PATH as STREAM_PATH
from rolloutd.daemon.streams import stream_chunks, stream_request
from rolloutd.daemon.trajectory import Trajectory

DEFAULT_URL = "http://127.0.0.1:8321"
#: Generous: a wait=true request lasts as long as its rollouts.
DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)


class RolloutdError(DaemonError):
    """The daemon answered with an error (or could not be reached: status 0)."""

    def __init__(self, status: int, type: str, message: str) -> None:
        super().__init__(f"{status} {type}: {message}")
        self.status = status
        self.type = type
        self.message = message


@dataclass
class Submission:
    group_id: str
    ids: list[str]
    replayed: bool = False


def _token(token: str | None, token_file: str | os.PathLike[str] | None) -> str | None:
    if token:
        return token
    path = token_file or os.environ.get("ROLLOUTD_TOKEN_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get("ROLLOUTD_TOKEN") or None


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _submit_body(task: Mapping[str, Any], n: int, options: Mapping[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"task": dict(task), "n": n}
    body.update({k: v for k, v in options.items() if v is not None})
    return body


def _check(resp: httpx.Response) -> Any:
    if resp.is_success:
        return resp.json()
    try:
        err = resp.json()["error"]
        raise RolloutdError(resp.status_code, err.get("type", "error"), err.get("message", ""))
    except (ValueError, KeyError, TypeError):
        raise RolloutdError(resp.status_code, "http_error", resp.text[:500]) from None


def _submission(data: Mapping[str, Any]) -> Submission:
    return Submission(data["group_id"], list(data["ids"]), bool(data.get("replayed", False)))


@dataclass
class BatchGroup:
    """A kept group of a dynamic-sampling batch: G trajectories of one task. ``task`` is None
    when the daemon had released it (the batch ended before the stream was opened) and the
    caller did not pass the batch's prompts (or the group was carried from another batch)."""

    group_id: str
    prompt_index: int
    task: dict[str, Any] | None
    rewards: list[float | None]
    rollouts: list[Trajectory]
    #: The batch of the same stream that started the group (its prompts[prompt_index]); None
    #: when this batch started it.
    carried_from: str | None = None


def _batch_body(
    prompts: Sequence[Mapping[str, Any]], group_size: int, keep: int, options: Mapping[str, Any]
) -> dict[str, Any]:
    body: dict[str, Any] = {"prompts": [dict(p) for p in prompts], "group_size": group_size, "keep": keep}
    body.update({k: v for k, v in options.items() if v is not None})
    return body


def _batch_group(line: str, prompts: Sequence[Mapping[str, Any]] | None) -> BatchGroup:
    d = json.loads(line)
    task, carried_from = d["task"], d.get("carried_from")
    if task is None and prompts is not None and carried_from is None:
        task = dict(prompts[d["prompt_index"]])  # a carried group's prompt is another batch's
    return BatchGroup(d["group_id"], d["prompt_index"], task, d["rewards"],
                      [Trajectory.model_validate(t) for t in d["rollouts"]], carried_from)


def _image_body(source: str, name: str | None) -> dict[str, Any]:
    return {"source": source, **({"name": name} if name is not None else {})}


def _image_line(
    data: Mapping[str, Any], progress: Callable[[int, int], None]
) -> dict[str, Any] | None:
    """One line of a streamed import: progress (None), the image, or the error raised."""
    if "progress" in data:
        progress(int(data["progress"]["done"]), int(data["progress"]["total"]))
        return None
    if "error" in data:
        raise RolloutdError(422, str(data["error"].get("type")), str(data["error"].get("message")))
    return dict(data["image"])


def _unreachable(exc: httpx.HTTPError) -> RolloutdError:
    return RolloutdError(0, "unreachable", f"{type(exc).__name__}: {exc}")


class Client:
    """Blocking client."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._http = httpx.Client(
            base_url=url, headers=_headers(_token(token, token_file)), timeout=timeout, transport=transport
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            return _check(self._http.request(method, path, **kwargs))
        except httpx.HTTPError as exc:
            raise _unreachable(exc) from exc

    def submit(self, task: Mapping[str, Any], *, n: int = 1, **options: Any) -> Submission:
        """Queue ``n`` samples of a task; options are RolloutRequest fields (sampling, limits, ...)."""
        return _submission(self._call("POST", "/v1/rollouts", json=_submit_body(task, n, options)))

    def get(self, rollout_id: str) -> Trajectory:
        return Trajectory.model_validate(self._call("GET", f"/v1/rollouts/{rollout_id}"))

    def cancel(self, rollout_id: str) -> str:
        return str(self._call("DELETE", f"/v1/rollouts/{rollout_id}")["status"])

    def replay(self, rollout_id: str) -> str:
        """Replay a finished rollout's model outputs against a fresh sandbox: the new id."""
        return str(self._call("POST", f"/v1/rollouts/{rollout_id}/replay")["id"])

    def token_pieces(self, rollout_id: str) -> list[str]:
        """The text of each of the rollout's ``token_ids`` (the served tokenizer's)."""
        return list(self._call("GET", f"/v1/rollouts/{rollout_id}/tokens")["pieces"])

    def status(self) -> dict[str, Any]:
        return dict(self._call("GET", "/v1/status"))

    def stream(self, ids: Sequence[str]) -> Iterator[Trajectory]:
        """Trajectories as they finish (past MAX_STREAM_IDS, one stream after another)."""
        for chunk in stream_chunks(ids):
            method, request = stream_request(chunk)
            for line in self._lines(method, STREAM_PATH, **request):
                yield Trajectory.model_validate(json.loads(line))

    def _lines(self, method: str, url: str, **request: Any) -> Iterator[str]:
        """The lines of an NDJSON answer (RolloutdError for an error answer)."""
        try:
            with self._http.stream(method, url, **request) as resp:
                if not resp.is_success:
                    resp.read()
                    _check(resp)
                for line in resp.iter_lines():
                    if line.strip():
                        yield line
        except httpx.HTTPError as exc:
            raise _unreachable(exc) from exc

    def wait(self, ids: Sequence[str]) -> list[Trajectory]:
        """Every trajectory, in the order of ``ids``."""
        done = {t.id: t for t in self.stream(ids)}
        return [done[i] for i in ids]

    def run(self, task: Mapping[str, Any], *, n: int = 1, **options: Any) -> list[Trajectory]:
        """Submit and wait."""
        return self.wait(self.submit(task, n=n, **options).ids)

    def add_backend(self, spec: Mapping[str, Any]) -> str:
        """Register an LLM backend (``{"kind": "model-server", "url": ..., "id": ...}``); its id."""
        return str(self._call("POST", "/v1/backends", json=dict(spec))["id"])

    def reload_backend(
        self, backend_id: str, path: str | os.PathLike[str], *, version: int | None = None,
        partial: bool = False,
    ) -> dict[str, Any]:
        """Weight sync: the backend loads the safetensors under ``path`` (pause, load, drop its
        cache, set the policy version to ``version`` or current + 1, resume)."""
        body = {"path": os.fspath(path), "version": version, "partial": partial}
        return dict(self._call("POST", f"/v1/backends/{backend_id}/reload", json=body))

    def set_policy_version(self, version: int) -> None:
        self._call("PUT", "/v1/policy_version", json={"version": version})

    def create_batch(
        self, prompts: Sequence[Mapping[str, Any]], *, group_size: int, keep: int, **options: Any
    ) -> dict[str, Any]:
        """Start dynamic sampling; options are BatchRequest fields. Returns its progress (with ``id``)."""
        return dict(self._call("POST", "/v1/batches", json=_batch_body(prompts, group_size, keep, options)))

    def batch_status(self, batch_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/batches/{batch_id}"))

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return dict(self._call("DELETE", f"/v1/batches/{batch_id}"))

    def batch_groups(
        self, batch_id: str, *, start: int = 0, prompts: Sequence[Mapping[str, Any]] | None = None
    ) -> Iterator[BatchGroup]:
        """Kept groups as they are kept, until the batch ends. ``prompts`` (the batch's) fill in
        the task of a group whose task the daemon released (the batch had ended)."""
        for line in self._lines("GET", f"/v1/batches/{batch_id}/groups", params={"start": start}):
            yield _batch_group(line, prompts)

    def import_image(
        self, source: str, *, name: str | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]:
        """Import ``source`` into the daemon's image store (``oci:DIR[:TAG]``,
        ``docker-archive:FILE``, a ``.sif``, ``docker://REF``); the image. ``progress(done,
        total)`` is called with the unpacked bytes as the daemon reports them."""
        body = _image_body(source, name)
        if progress is None:
            return dict(self._call("POST", "/v1/images", json=body))
        try:
            with self._http.stream("POST", "/v1/images", json=body,
                                   headers={"Accept": "application/x-ndjson"}) as resp:
                if not resp.is_success:
                    resp.read()
                    _check(resp)
                for line in resp.iter_lines():
                    if line.strip():
                        done = _image_line(json.loads(line), progress)
                        if done is not None:
                            return done
        except httpx.HTTPError as exc:
            raise _unreachable(exc) from exc
        raise RolloutdError(0, "unreachable", "the daemon ended the import without an answer")

    def images(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/images")["images"])

    def remove_image(self, ref: str) -> dict[str, Any]:
        return dict(self._call("DELETE", f"/v1/images/{ref}"))

    def gc_images(self, *, max_gb: float | None = None) -> dict[str, Any]:
        return dict(self._call("POST", "/v1/images/gc", json={"max_gb": max_gb}))

    def sample_batch(
        self, prompts: Sequence[Mapping[str, Any]], *, group_size: int, keep: int, **options: Any
    ) -> Iterator[BatchGroup]:
        """Create a batch and yield its kept groups (at most ``keep``). Leaving the loop early
        disconnects, which cancels the batch unless ``cancel_on_disconnect=False``."""
        batch = self.create_batch(prompts, group_size=group_size, keep=keep, **options)
        yield from self.batch_groups(batch["id"], prompts=prompts)


class AsyncClient:
    """Async client (httpx picks trio or asyncio automatically)."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=url, headers=_headers(_token(token, token_file)), timeout=timeout, transport=transport
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            return _check(await self._http.request(method, path, **kwargs))
        except httpx.HTTPError as exc:
            raise _unreachable(exc) from exc

    async def submit(self, task: Mapping[str, Any], *, n: int = 1, **options: Any) -> Submission:
        return _submission(await self._call("POST", "/v1/rollouts", json=_submit_body(task, n, options)))

    async def get(self, rollout_id: str) -> Trajectory:
        return Trajectory.model_validate(await self._call("GET", f"/v1/rollouts/{rollout_id}"))

    async def cancel(self, rollout_id: str) -> str:
        return str((await self._call("DELETE", f"/v1/rollouts/{rollout_id}"))["status"])

    async def replay(self, rollout_id: str) -> str:
        return str((await self._call("POST", f"/v1/rollouts/{rollout_id}/replay"))["id"])

    async def token_pieces(self, rollout_id: str) -> list[str]:
        return list((await self._call("GET", f"/v1/rollouts/{rollout_id}/tokens"))["pieces"])

    async def status(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/v1/status"))

    async def stream(self, ids: Sequence[str]) -> AsyncIterator[Trajectory]:
        """Trajectories as they finish (past MAX_STREAM_IDS, one stream after another)."""
        for chunk in stream_chunks(ids):
            method, request = stream_request(chunk)
            async with aclosing(self._lines(method, STREAM_PATH, **request)) as lines:
                async for line in lines:
                    yield Trajectory.model_validate(json.loads(line))

    async def _lines(self, method: str, url: str, **request: Any) -> AsyncGenerator[str]:
        """The lines of an NDJSON answer (RolloutdError for an error answer)."""
        try:
            async with self._http.stream(method, url, **request) as resp:
                if not resp.is_success:
                    await resp.aread()
                    _check(resp)
                # typed AsyncIterator by httpx, an async generator at run time: close it
                async with aclosing(resp.aiter_lines()) as lines:  # type: ignore[type-var]
                    async for line in lines:
                        if line.strip():
                            yield line
        except httpx.HTTPError as exc:
            raise _unreachable(exc) from exc

    async def wait(self, ids: Sequence[str]) -> list[Trajectory]:
        done = {t.id: t async for t in self.stream(ids)}
        return [done[i] for i in ids]

    async def run(self, task: Mapping[str, Any], *, n: int = 1, **options: Any) -> list[Trajectory]:
        return await self.wait((await self.submit(task, n=n, **options)).ids)

    async def add_backend(self, spec: Mapping[str, Any]) -> str:
        return str((await self._call("POST", "/v1/backends", json=dict(spec)))["id"])

    async def reload_backend(
        self, backend_id: str, path: str | os.PathLike[str], *, version: int | None = None,
        partial: bool = False,
    ) -> dict[str, Any]:
        body = {"path": os.fspath(path), "version": version, "partial": partial}
        return dict(await self._call("POST", f"/v1/backends/{backend_id}/reload", json=body))

    async def set_policy_version(self, version: int) -> None:
        await self._call("PUT", "/v1/policy_version", json={"version": version})

    async def create_batch(
        self, prompts: Sequence[Mapping[str, Any]], *, group_size: int, keep: int, **options: Any
    ) -> dict[str, Any]:
        body = _batch_body(prompts, group_size, keep, options)
        return dict(await self._call("POST", "/v1/batches", json=body))

    async def import_image(self, source: str, *, name: str | None = None) -> dict[str, Any]:
        return dict(await self._call("POST", "/v1/images", json=_image_body(source, name)))

    async def images(self) -> list[dict[str, Any]]:
        return list((await self._call("GET", "/v1/images"))["images"])

    async def remove_image(self, ref: str) -> dict[str, Any]:
        return dict(await self._call("DELETE", f"/v1/images/{ref}"))

    async def gc_images(self, *, max_gb: float | None = None) -> dict[str, Any]:
        return dict(await self._call("POST", "/v1/images/gc", json={"max_gb": max_gb}))

    async def batch_status(self, batch_id: str) -> dict[str, Any]:
        return dict(await self._call("GET", f"/v1/batches/{batch_id}"))

    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return dict(await self._call("DELETE", f"/v1/batches/{batch_id}"))

    async def batch_groups(
        self, batch_id: str, *, start: int = 0, prompts: Sequence[Mapping[str, Any]] | None = None
    ) -> AsyncGenerator[BatchGroup]:
        async with aclosing(self._lines("GET", f"/v1/batches/{batch_id}/groups", params={"start": start})) as lines:
            async for line in lines:
                yield _batch_group(line, prompts)

    async def sample_batch(
        self, prompts: Sequence[Mapping[str, Any]], *, group_size: int, keep: int, **options: Any
    ) -> AsyncIterator[BatchGroup]:
        """Create a batch and yield its kept groups; see ``Client.sample_batch``."""
        batch = await self.create_batch(prompts, group_size=group_size, keep=keep, **options)
        async with aclosing(self.batch_groups(batch["id"], prompts=prompts)) as groups:
            async for group in groups:
                yield group
