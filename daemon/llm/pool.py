"""The backend pool: which backend serves a turn, and what happens when one dies.

Routing, in order:

1. **Sticky per rollout**: every turn of a rollout (``sticky_key``) goes to the backend that
   served its first turn, so the backend's prefix cache holds the whole conversation.
2. **Sticky per group**: the first turn of a new rollout whose ``group_key`` already has a
   backend goes there too (a GRPO group shares its prompt).
3. **Least loaded** otherwise: fewest requests in flight (counted up on dispatch, down on
   return), then fewest live sticky rollouts, then fewest served; ties rotate.

Unhealthy backends are skipped; the health loop (:meth:`BackendPool.run`) probes every backend
every ``health_interval_s`` and brings recovered ones back. A request that fails with
:class:`BackendUnavailable` (or exceeds ``request_timeout_s``) marks its backend unhealthy and
is retried on another; the rollout (and its group) moves there, and the completion records
``retries`` and ``switches`` in ``Completion.extra``. When no healthy backend is left, a turn
fails with :class:`NoBackend` at once, unless a backend is expected (:meth:`expect`: a
supervised server, which is starting or restarting): then it waits up to ``backend_wait_s``
for one to become healthy and retries there (a backend that failed this request is tried
again once a probe has found it healthy). Dead backends that nobody restarts fail turns at once. :meth:`pause` stops dispatch and waits
for in-flight requests to drain (weight sync); :meth:`resume` lets waiting turns go on. Every
completion is stamped with ``policy_version`` at dispatch and at return. :meth:`reload` is the
whole weight sync from a directory for one backend (pause, load, set the version, resume; see
:mod:`rolloutd.daemon.llm.weights`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import trio

from rolloutd.daemon.llm.base import (
    Backend,
    BackendUnavailable,
    BadResponse,
    Completion,
    NoBackend,
    SamplingParams,
)
from rolloutd.daemon.llm.weights import ReloadRequest, reload_backend

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0


@dataclass
class _Member:
    id: str
    backend: Backend
    order: int
    healthy: bool = True
    removed: bool = False
    in_flight: int = 0
    sessions: int = 0
    served: int = 0
    failures: int = 0
    last_error: str | None = None


@dataclass
class _Stats:
    requests: int = 0
    sticky_hits: int = 0
    group_hits: int = 0
    new_assignments: int = 0
    retries: int = 0
    switches: int = 0
    errors: int = 0


class BackendPool:
    """Routes completions over registered backends. Run :meth:`run` in a nursery for health."""

    def __init__(
        self,
        *,
        health_interval_s: float = 5.0,
        request_timeout_s: float = 600.0,
        probe_timeout_s: float = 5.0,
        backend_wait_s: float = 0.0,
    ) -> None:
        self.health_interval_s = health_interval_s
        self.request_timeout_s = request_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.backend_wait_s = backend_wait_s
        self._expected: dict[str, int] = {}
        self.policy_version = 0
        self._members: dict[str, _Member] = {}
        self._sticky: dict[str, str] = {}
        self._sticky_group: dict[str, str] = {}
        self._groups: dict[str, str] = {}
        self._group_keys: dict[str, set[str]] = {}
        self._ids = itertools.count(1)
        self._order = itertools.count()
        self._in_flight = 0
        self._changed = trio.Event()
        self._paused = False
        self._unpaused = trio.Event()
        self._unpaused.set()
        self._stats = _Stats()

    # -- registry -----------------------------------------------------------------------------

    def add(self, backend: Backend, *, backend_id: str | None = None) -> str:
        """Register a backend (healthy until a probe or a request says otherwise)."""
        bid = backend_id or f"{getattr(backend, 'kind', 'backend')}-{next(self._ids)}"
        old = self._members.get(bid)
        if old is not None and not old.removed:
            raise ValueError(f"backend id {bid!r} is already registered")
        self._members[bid] = _Member(bid, backend, next(self._order))
        log.info("backend %s added (%s)", bid, getattr(backend, "url", None) or backend.name)
        self._notify()
        return bid

    @contextmanager
    def expect(self, backend_id: str) -> Iterator[None]:
        """While this is entered a backend is on its way (a supervised server starting or
        restarting): a turn that finds no healthy backend waits for one, up to
        ``backend_wait_s``, instead of failing with ``NoBackend`` at once."""
        self._expected[backend_id] = self._expected.get(backend_id, 0) + 1
        try:
            yield
        finally:
            self._expected[backend_id] -= 1
            if not self._expected[backend_id]:
                del self._expected[backend_id]
            self._notify()

    async def remove(self, backend_id: str) -> None:
        """Stop routing to a backend, wait (bounded) for its requests, and close it."""
        m = self._members.get(backend_id)
        if m is None or m.removed:
            raise KeyError(backend_id)
        m.removed = True
        with trio.move_on_after(self.request_timeout_s):
            while m.in_flight:
                await self._wait_changed()
        self._members.pop(backend_id, None)
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            await m.backend.aclose()
        log.info("backend %s removed", backend_id)

    def get(self, backend_id: str) -> Backend:
        return self._members[backend_id].backend

    def mark_unhealthy(self, backend_id: str, reason: str) -> None:
        """Take a backend out of routing until a probe succeeds (e.g. its process died)."""
        m = self._members.get(backend_id)
        if m is not None:
            m.healthy = False
            m.last_error = reason

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "id": m.id,
                "kind": getattr(m.backend, "kind", None),
                "name": m.backend.name,
                "url": getattr(m.backend, "url", None),
                "healthy": m.healthy,
                "in_flight": m.in_flight,
                "paused": self._paused,
                "served": m.served,
                "failures": m.failures,
                "sessions": m.sessions,
                "last_error": m.last_error,
            }
            for m in self._members.values()
            if not m.removed
        ]

    def statistics(self) -> dict[str, Any]:
        live = [m for m in self._members.values() if not m.removed]
        s = self._stats
        return {
            "backends": len(live),
            "healthy": sum(m.healthy for m in live),
            "in_flight": self._in_flight,
            "paused": self._paused,
            "policy_version": self.policy_version,
            "requests": s.requests,
            "sticky_hits": s.sticky_hits,
            "group_hits": s.group_hits,
            "new_assignments": s.new_assignments,
            "retries": s.retries,
            "switches": s.switches,
            "errors": s.errors,
            "sticky_sessions": len(self._sticky),
            "groups": len(self._groups),
        }

    # -- weight sync --------------------------------------------------------------------------

    def set_policy_version(self, v: int) -> None:
        self.policy_version = int(v)

    async def pause(self) -> None:
        """Stop dispatching new requests and wait until none is in flight."""
        if not self._paused:
            self._paused = True
            self._unpaused = trio.Event()
        while self._in_flight:
            await self._wait_changed()

    def resume(self) -> None:
        self._paused = False
        self._unpaused.set()

    @property
    def paused(self) -> bool:
        return self._paused

    async def reload(self, backend_id: str, req: ReloadRequest) -> dict[str, Any]:
        """Weight sync from a directory: pause -> load ``req.path`` into the backend (it drops
        its cache) -> set the version -> resume.

        ``req.version`` defaults to the current version + 1. Raises ``KeyError`` for an unknown
        backend and :class:`LLMError` subclasses when loading fails (the pool resumes on the old
        weights and version; :class:`~rolloutd.daemon.llm.weights.ReloadUnsupported` for a backend that
        is not :class:`~rolloutd.daemon.llm.weights.Reloadable`). Returns ``{"id", "version", "path",
        "partial", "drain_s", "total_s", "backend": what the backend reported}``.
        """
        backend = self.get(backend_id)
        new_version = self.policy_version + 1 if req.version is None else int(req.version)
        t0 = time.monotonic()
        was_paused = self.paused
        await self.pause()
        paused_s = time.monotonic() - t0
        try:
            result = await reload_backend(backend, req.path, partial=req.partial, version=new_version)
            self.set_policy_version(new_version)
        finally:
            if not was_paused:
                self.resume()
        return {"id": backend_id, "version": new_version, "path": req.path, "partial": req.partial,
                "drain_s": round(paused_s, 3), "total_s": round(time.monotonic() - t0, 3),
                "backend": result}

    # -- health -------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Probe every backend now and then every ``health_interval_s``; close all on exit."""
        try:
            await self.probe_all()
            task_status.started()
            while True:
                await trio.sleep(self.health_interval_s)
                await self.probe_all()
        finally:
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await self.aclose()

    async def probe_all(self) -> None:
        async with trio.open_nursery() as nursery:
            for m in list(self._members.values()):
                if not m.removed:
                    nursery.start_soon(self._probe, m)

    async def _probe(self, m: _Member) -> None:
        ok = False
        with trio.move_on_after(self.probe_timeout_s):
            try:
                ok = await m.backend.health()
            except Exception as exc:  # a probe failure is data, not a crash
                m.last_error = f"health probe: {exc!r}"
        if ok and not m.healthy:
            log.info("backend %s is healthy again", m.id)
        elif not ok and m.healthy:
            log.warning("backend %s failed its health probe", m.id)
        changed = m.healthy != ok
        m.healthy = ok
        if changed:
            self._notify()

    async def aclose(self) -> None:
        for m in list(self._members.values()):
            await m.backend.aclose()

    # -- routing ------------------------------------------------------------------------------

    def forget(self, sticky_key: str) -> None:
        """End of a rollout: drop its stickiness (and its group's, when it was the last)."""
        bid = self._sticky.pop(sticky_key, None)
        if bid is not None and bid in self._members:
            self._members[bid].sessions -= 1
        group = self._sticky_group.pop(sticky_key, None)
        if group is not None:
            keys = self._group_keys.get(group, set())
            keys.discard(sticky_key)
            if not keys:
                self._group_keys.pop(group, None)
                self._groups.pop(group, None)

    def _bind(self, m: _Member, sticky_key: str, group_key: str | None) -> None:
        old = self._sticky.get(sticky_key)
        if old != m.id:
            if old is not None and old in self._members:
                self._members[old].sessions -= 1
            m.sessions += 1
            self._sticky[sticky_key] = m.id
        if group_key is not None:
            self._groups[group_key] = m.id
            self._group_keys.setdefault(group_key, set()).add(sticky_key)
            self._sticky_group[sticky_key] = group_key

    def route(self, sticky_key: str, group_key: str | None = None, *, exclude: Sequence[str] = ()) -> str:
        """Choose (and bind) the backend for the next turn of ``sticky_key``; returns its id."""
        usable = [m for m in self._members.values() if m.healthy and not m.removed and m.id not in exclude]
        if not usable:
            raise NoBackend("no healthy backend is registered" + (f" (tried {list(exclude)})" if exclude else ""))
        by_id = {m.id: m for m in usable}
        sticky = self._sticky.get(sticky_key)
        if sticky in by_id:
            self._stats.sticky_hits += 1
            return sticky  # type: ignore[return-value]
        grouped = self._groups.get(group_key) if group_key is not None else None
        if grouped in by_id:
            chosen = by_id[grouped]  # type: ignore[index]
            self._stats.group_hits += 1
        else:
            chosen = min(usable, key=lambda m: (m.in_flight, m.sessions, m.served, m.order))
            chosen.order = next(self._order)  # rotate among equals
            self._stats.new_assignments += 1
        self._bind(chosen, sticky_key, group_key)
        return chosen.id

    async def _wait_changed(self) -> None:
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def complete(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        sticky_key: str,
        group_key: str | None = None,
    ) -> Completion:
        """One turn: route, send, fail over. ``Completion.extra`` gets ``backend_id``,
        ``retries``, ``switches`` (ids moved to), ``policy_version_start``/``_end``."""
        while self._paused:
            await self._unpaused.wait()
        self._stats.requests += 1
        pv_start = self.policy_version
        previous = self._sticky.get(sticky_key)
        tried: list[str] = []  # every failed attempt (counted as retries)
        excluded: list[str] = []  # failed and not healthy again since
        switches: list[str] = []
        deadline: float | None = None
        while True:
            while self._paused:
                await self._unpaused.wait()
            try:
                bid = self.route(sticky_key, group_key, exclude=excluded)
            except NoBackend:
                if deadline is None:
                    deadline = trio.current_time() + self.backend_wait_s
                if not self._expected or trio.current_time() >= deadline:
                    self._stats.errors += 1
                    if trio.current_time() >= deadline and self.backend_wait_s:  # it did wait
                        raise NoBackend(f"no healthy backend within {self.backend_wait_s:g} s"
                                        + (f" (tried {tried})" if tried else "")) from None
                    raise
                with trio.move_on_at(deadline):
                    await self._wait_changed()
                excluded = [b for b in excluded if b in self._members and not self._members[b].healthy]
                continue
            if previous is not None and bid != previous:
                switches.append(bid)
                self._stats.switches += 1
            previous = bid
            m = self._members[bid]
            m.in_flight += 1
            self._in_flight += 1
            try:
                with trio.fail_after(self.request_timeout_s):
                    completion = await m.backend.complete(prompt_ids, params, max_tokens=max_tokens)
            except (BackendUnavailable, trio.TooSlowError) as exc:
                m.healthy = False
                m.failures += 1
                m.last_error = repr(exc)
                tried.append(bid)
                excluded.append(bid)
                self._stats.retries += 1
                log.warning("backend %s failed a request for %s: %r; retrying elsewhere", bid, sticky_key, exc)
                continue
            finally:
                m.in_flight -= 1
                self._in_flight -= 1
                self._notify()
            break
        if len(completion.token_ids) != len(completion.logprobs):
            raise BadResponse(
                f"backend {bid} returned {len(completion.token_ids)} ids and {len(completion.logprobs)} logprobs"
            )
        m.served += 1
        completion.extra.update(
            backend_id=bid,
            retries=len(tried),
            switches=switches,
            policy_version_start=pv_start,
            policy_version_end=self.policy_version,
        )
        return completion

from rolloutd.daemon.llm._factory import make_backend  # noqa: E402  (re-exported: CONTRACTS.md names it here)

__all__ = ["BackendPool", "make_backend"]
