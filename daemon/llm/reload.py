"""Weight sync from a directory: load new safetensors weights into a serving backend.

A trainer that holds its own copy of the policy saves the updated tensors with
``safetensors.torch.save_file`` into a directory and asks rolloutd to load them::

    POST /v1/backends/{id}/reload   {"path": "/runs/x/step-12", "version": 12, "partial": true}

:func:`reload_in_pool` does the whole sync for one pooled backend: pause the pool (no new
turn starts; in-flight requests finish), load the weights into the backend (which also drops
its prefix/KV cache, since cached keys were computed by the old weights), set the pool's
policy version, resume. Turns sampled afterwards carry the new version in
``policy_version_start``/``_end``; a turn that was waiting in the pause starts on the new
version. If loading fails the pool resumes on the old weights and version, and the error is
raised.

How a backend loads (:func:`reload_backend`):

- ``transformers`` (embedded): in process, :meth:`TransformersBackend.reload_weights`;
- ``model-server``: ``POST {url}/v1/reload`` (``rolloutd model-server``'s own route);
- ``vllm``: refused (:class:`ReloadUnsupported`). vLLM's weight updates go through the
  trainer's own transport (NCCL / CUDA IPC, see shared research); do that between
  ``POST /v1/backends/pause`` and ``/resume`` and then ``PUT /v1/policy_version``.

:func:`load_weights` is the blocking loader both in-process paths use. Every tensor in the
directory's ``*.safetensors`` files must name a parameter (or buffer) of the model with the
same shape; with ``partial=False`` every parameter must be given (tied parameters, such as
SmolLM2's ``lm_head`` tied to the embeddings, count as given with their twin). Everything is
checked before the first tensor is copied, so a bad directory leaves the model unchanged.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from daemon.llm.base import Backend, BackendRejected, BackendUnavailable
from daemon.llm.vllm import error_text

if TYPE_CHECKING:
    from daemon.llm.pool import BackendPool

#: A reload over HTTP may read a few GB from disk; allow for it.
RELOAD_HTTP_TIMEOUT_S = 600.0


class WeightsError(BackendRejected):
    """The weights cannot be loaded (no such directory, unknown tensor, wrong shape, ...)."""


class ReloadUnsupported(WeightsError):
    """This backend kind cannot load weights from a directory through rolloutd."""


def weight_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a directory (or the file itself), sorted."""
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        return [p]
    if not p.is_dir():
        raise WeightsError(f"no weights directory at {str(p)!r}")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors file in {str(p)!r}")
    return files


def load_weights(model: Any, path: str | Path, *, partial: bool = False) -> dict[str, Any]:
    """Blocking: copy the tensors under ``path`` into ``model`` in place (see module doc).

    Returns ``{"tensors": n, "kept": parameters not in the files, "files": [...], "seconds"}``.
    """
    import torch
    from safetensors.torch import load_file

    t0 = time.monotonic()
    files = weight_files(path)
    given: dict[str, Any] = {}
    for f in files:
        try:
            given.update(load_file(str(f)))
        except Exception as exc:  # safetensors raises its own errors for a corrupt file
            raise WeightsError(f"cannot read {f}: {exc}") from None
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    unknown = sorted(set(given) - set(targets))
    if unknown:
        raise WeightsError(f"{len(unknown)} tensors name no parameter of the model, e.g. {unknown[:3]}")
    for name, tensor in given.items():
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise WeightsError(
                f"{name}: shape {tuple(tensor.shape)} in the files, {tuple(targets[name].shape)} in the model"
            )
    covered = {targets[n].data_ptr() for n in given}
    params = dict(model.named_parameters(remove_duplicate=False))
    kept = sorted(n for n, p in params.items() if n not in given and p.data_ptr() not in covered)
    if kept and not partial:
        raise WeightsError(
            f"{len(kept)} parameters are missing from the files (e.g. {kept[:3]}); "
            "send every parameter, or ask for a partial reload"
        )
    with torch.no_grad():
        for name, tensor in given.items():
            targets[name].copy_(tensor)
    return {"tensors": len(given), "kept": len(kept), "files": [str(f) for f in files],
            "seconds": round(time.monotonic() - t0, 3)}


async def reload_backend(
    backend: Backend, path: str, *, partial: bool = False, version: int | None = None
) -> dict[str, Any]:
    """Load the weights at ``path`` into one backend (no pausing: see :func:`reload_in_pool`);
    a model-server is told ``version`` too (it reports it as ``weights_version``)."""
    own = getattr(backend, "reload_weights", None)
    if own is not None:
        result: dict[str, Any] = await own(path, partial=partial)
        return result
    kind = getattr(backend, "kind", None)
    url = getattr(backend, "url", None)
    if kind == "model-server" and url:
        try:
            async with httpx.AsyncClient(base_url=url, timeout=RELOAD_HTTP_TIMEOUT_S) as http:
                resp = await http.post("/v1/reload", json={"path": path, "partial": partial, "version": version})
        except httpx.TransportError as exc:
            raise BackendUnavailable(f"{backend.name}: reload: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 500:
            raise BackendUnavailable(f"{backend.name}: reload: {error_text(resp)}")
        if resp.status_code >= 400:
            raise WeightsError(f"{backend.name}: reload: {error_text(resp)}")
        return dict(resp.json())
    raise ReloadUnsupported(
        f"backend {backend.name} ({kind}) cannot load weights from a directory through rolloutd: "
        "sync its weights with the trainer's own transport between POST /v1/backends/pause and "
        "/resume, then PUT /v1/policy_version"
    )


async def reload_in_pool(
    pool: BackendPool, backend_id: str, path: str, *, version: int | None = None, partial: bool = False
) -> dict[str, Any]:
    """Pause -> load (the backend drops its cache) -> set the version -> resume.

    ``version`` defaults to the pool's current version + 1. Raises ``KeyError`` for an
    unknown backend and :class:`LLMError` subclasses when loading fails (the pool resumes on
    the old weights and version).
    """
    backend = pool.get(backend_id)
    new_version = pool.policy_version + 1 if version is None else int(version)
    t0 = time.monotonic()
    was_paused = pool.paused
    await pool.pause()
    paused_s = time.monotonic() - t0
    try:
        result = await reload_backend(backend, path, partial=partial, version=new_version)
        pool.set_policy_version(new_version)
    finally:
        if not was_paused:
            pool.resume()
    return {"id": backend_id, "version": new_version, "path": path, "partial": partial,
            "drain_s": round(paused_s, 3), "total_s": round(time.monotonic() - t0, 3),
            "backend": result}


__all__ = [
    "ReloadUnsupported",
    "WeightsError",
    "load_weights",
    "reload_backend",
    "reload_in_pool",
    "weight_files",
]
