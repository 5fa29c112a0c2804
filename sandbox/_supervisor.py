"""SandboxSupervisor: owns every live sandbox of the daemon.

Each sandbox lives in a task of the supervisor's nursery (``backend.open`` held open
until ``release``), so a sandbox opened in one pipeline stage and used in the next is
owned by one object, and cancelling ``run`` tears all of them down, in parallel, each
shielded and bounded. At start it sweeps what earlier boots left behind. An optional
warm pool keeps sandboxes of one template spec open ahead of demand.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from ._backend import Backend
from ._exceptions import SandboxClosed, SandboxStartError
from ._models import SandboxSpec
from ._registry import open_backend
from ._sandbox import Sandbox

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    sandbox: Sandbox
    released: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)


class SandboxSupervisor:
    """Options besides the backend options (passed to every backend): ``pool_size``
    (warm sandboxes kept open, default 0) and ``pool_spec`` (the template they are
    opened with; only requests equal to it are served from the pool)."""

    def __init__(self, *, default_backend: str, state_dir: Path | str, boot_id: str,
                 pool_size: int = 0, pool_spec: SandboxSpec | dict[str, Any] | None = None,
                 **backend_options: Any) -> None:
        self.default_backend = default_backend
        self.state_dir = Path(state_dir)
        self.boot_id = boot_id
        self.pool_size = pool_size
        self.pool_spec = SandboxSpec.model_validate(pool_spec or {})
        self._options = backend_options
        self._backends: dict[str, Backend] = {}
        self._live: dict[str, _Entry] = {}
        self._pool: deque[Sandbox] = deque()
        self._pool_wanted = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.swept = 0
        self.pool_hits = 0

    # ----- lifecycle -------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check the default backend (fail loudly if it is missing), sweep orphans of
        earlier boots, then serve until cancelled; on the way out every live sandbox is
        torn down (shielded, bounded)."""
        default = await self._backend(self.default_backend)
        try:
            for backend in self._backends.values():
                self.swept += await backend.sweep()
            if default.name == "local":
                log.warning("sandbox backend is LOCAL: no isolation; for development only")
            default.warm_up()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.pool_size > 0:
                    nursery.start_soon(self._fill_pool)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self._pool.clear()
            for backend in self._backends.values():
                await backend.aclose()  # its spare launchers (shielded, bounded)

    async def _backend(self, name: str) -> Backend:
        backend = self._backends.get(name)
        if backend is None:
            backend = open_backend(name, state_dir=self.state_dir, boot_id=self.boot_id,
                                   **self._options)
            await trio.to_thread.run_sync(backend.check)
            # installs and byte-compiles the helper once (a subprocess): not on the loop
            await trio.to_thread.run_sync(backend.layout.lib_dir)
            self._backends[name] = backend
        return backend

    # ----- open / release --------------------------------------------------------------
    async def open(self, spec: SandboxSpec) -> Sandbox:
        """Open a sandbox owned by the supervisor; ``release`` it when done."""
        if self._nursery is None:
            raise SandboxStartError("the sandbox supervisor is not running")
        name = spec.backend or self.default_backend
        if self.pool_size and name == self.default_backend and self._pool_match(spec):
            while self._pool:
                sandbox = self._pool.popleft()
                self._pool_wanted.set()
                if not sandbox.closed:
                    self.pool_hits += 1
                    return sandbox
                await self.release(sandbox)
            self._pool_wanted.set()
        backend = await self._backend(name)
        opened: Sandbox = await self._nursery.start(self._hold, backend, spec)
        return opened

    async def release(self, sb: Sandbox) -> None:
        """Tear a sandbox down (bounded by the backend's teardown timeout). Idempotent."""
        entry = self._live.get(sb.id)
        if entry is None:
            return
        entry.released.set()
        await entry.done.wait()

    def _pool_match(self, spec: SandboxSpec) -> bool:
        # A job's own lifetime differs per job; a pooled sandbox is released with its job.
        ignore = {"backend": None, "lifetime_s": None}
        return spec.model_copy(update=ignore) == self.pool_spec.model_copy(update=ignore)

    async def _hold(self, backend: Backend, spec: SandboxSpec, *,
                    task_status: trio.TaskStatus[Sandbox] = trio.TASK_STATUS_IGNORED) -> None:
        entry: _Entry | None = None
        try:
            async with backend.open(spec) as sandbox:
                entry = _Entry(sandbox)
                self._live[sandbox.id] = entry
                task_status.started(sandbox)
                with trio.move_on_after(spec.lifetime_s if spec.lifetime_s else float("inf")):
                    await entry.released.wait()
                if not entry.released.is_set():
                    log.info("sandbox %s: lifetime of %.1f s reached, released", sandbox.id,
                             spec.lifetime_s)
        except (OSError, SandboxClosed) as exc:
            if entry is None:
                raise
            log.warning("sandbox teardown error: %s", exc)  # never crash the supervisor
        finally:
            if entry is not None:
                self._live.pop(entry.sandbox.id, None)
                entry.done.set()

    async def _fill_pool(self) -> None:
        backend = await self._backend(self.default_backend)
        spec = self.pool_spec.model_copy(update={"backend": None})
        assert self._nursery is not None
        while True:
            while len(self._pool) < self.pool_size:
                try:
                    self._pool.append(await self._nursery.start(self._hold, backend, spec))
                except SandboxStartError as exc:
                    log.warning("warm pool: cannot open a sandbox: %s", exc)
                    await trio.sleep(1.0)
            self._pool_wanted = trio.Event()
            await self._pool_wanted.wait()

    # ----- reporting -------------------------------------------------------------------
    def describe(self) -> list[dict[str, Any]]:
        """One dict per live sandbox (pooled ones included, marked ``pooled``)."""
        now = time.monotonic()
        pooled = {sb.id for sb in self._pool}
        return [{"id": e.sandbox.id, "backend": e.sandbox.backend,
                 "age_s": round(now - e.sandbox.opened_at, 3),
                 "workspace": str(e.sandbox.workspace), "limits": e.sandbox.limits,
                 "pooled": e.sandbox.id in pooled} for e in self._live.values()]

    def statistics(self) -> dict[str, Any]:
        backends = {name: b.statistics() for name, b in self._backends.items()}
        default = self._backends.get(self.default_backend)
        return {"backend": self.default_backend,
                "live": len(self._live) - len(self._pool),
                "pool_idle": len(self._pool), "pool_hits": self.pool_hits,
                "opened": sum(b["opened"] for b in backends.values()),
                "closed": sum(b["closed"] for b in backends.values()),
                "start_failures": sum(b["start_failures"] for b in backends.values()),
                "swept": self.swept,
                "limits_mechanism": default.limits.kind if default else None,
                "isolated": default.isolated if default else None,
                "backends": backends}
