"""The LLM backend pool as clients and trainers manage it, and the served model's renderer.

Every operation needs the pool (``ServiceUnavailable`` without one) and names backends by
the pool's ids (``NotFound`` for another). Building a backend may load a tokenizer, so the
renderer is loaded once, off the event loop. Returns data; the API layer shapes answers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from rolloutd.daemon.config import Settings
from rolloutd.daemon.errors import InvalidBackend, NotFound, ReloadFailed, ServiceUnavailable
from rolloutd.daemon.llm.base import BackendUnavailable, LLMError

if TYPE_CHECKING:
    from rolloutd.daemon.llm.chat import ChatRenderer
    from rolloutd.daemon.llm.pool import BackendPool
    from rolloutd.daemon.llm.weights import ReloadRequest


class Backends:
    """``pool`` gives the pool once the node has started it (None: this daemon has none)."""

    def __init__(self, settings: Settings, pool: Callable[[], BackendPool | None]) -> None:
        self.settings = settings
        self._pool = pool
        self._renderer: ChatRenderer | None = None
        self._renderer_lock = trio.Lock()

    # ---- the served model's renderer ---------------------------------------------------

    async def renderer(self) -> ChatRenderer:
        """The chat renderer for the served model, loaded once (off the event loop): the
        ``tokenizer`` setting's directory, or the embedded SmolLM2 tokenizer."""
        async with self._renderer_lock:
            if self._renderer is None:
                self._renderer = await trio.to_thread.run_sync(self._load_renderer)
            return self._renderer

    def _load_renderer(self) -> ChatRenderer:
        from rolloutd.daemon.llm.chat import ChatRenderer, load_embedded_tokenizer

        s = self.settings
        if s.tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(s.tokenizer, local_files_only=True)
        else:
            tok = load_embedded_tokenizer()
        return ChatRenderer.for_tokenizer(
            tok, s.chat_family, reasoning=s.reasoning, context_length=s.context_length
        )

    # ---- the pool ---------------------------------------------------------------------

    @property
    def pool(self) -> BackendPool:
        pool = self._pool()
        if pool is None:
            raise ServiceUnavailable("this daemon has no LLM backend pool")
        return pool

    def describe(self) -> dict[str, Any]:
        pool = self.pool
        return {"backends": pool.describe(), "policy_version": pool.policy_version}

    async def add(self, spec: dict[str, Any]) -> str:
        """Register a backend from its spec (``id`` optional); returns its id."""
        from rolloutd.daemon.llm.pool import make_backend

        pool = self.pool
        renderer = await self.renderer()
        try:
            backend = make_backend(spec, renderer=renderer)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidBackend(f"bad backend spec: {exc}") from None
        return pool.add(backend, backend_id=spec.get("id"))

    def _known(self, backend_id: str) -> BackendPool:
        pool = self.pool
        if not any(b["id"] == backend_id for b in pool.describe()):
            raise NotFound(f"no backend with id {backend_id!r}")
        return pool

    async def remove(self, backend_id: str) -> None:
        await self._known(backend_id).remove(backend_id)

    async def pause(self) -> None:
        """Stop sending new LLM requests (in-flight ones finish)."""
        await self.pool.pause()

    def resume(self) -> None:
        self.pool.resume()

    def set_policy_version(self, version: int) -> None:
        self.pool.set_policy_version(version)

    async def reload(self, backend_id: str, req: ReloadRequest) -> dict[str, Any]:
        """Weight sync: pause, load, drop the cache, set the policy version, resume."""
        pool = self._known(backend_id)
        try:
            return await pool.reload(backend_id, req)
        except BackendUnavailable as exc:
            raise ServiceUnavailable(f"reload failed: {exc}") from None
        except LLMError as exc:
            raise ReloadFailed(str(exc)) from None
