"""Weight sync from a directory: the loader, its errors, the request and the ``Reloadable`` protocol.

A trainer that holds its own copy of the policy saves the updated tensors with
``safetensors.torch.save_file`` into a directory and asks rolloutd to load them::

    POST /v1/backends/{id}/reload   {"path": "/runs/x/step-12", "version": 12, "partial": true}

That body is :class:`ReloadRequest`, also the body of ``rolloutd model-server``'s own
``POST /v1/reload``. :meth:`rolloutd.daemon.llm.pool.BackendPool.reload` does the whole sync for one
pooled backend: pause the pool (no new turn starts; in-flight requests finish), load the
weights into the backend (which also drops its prefix/KV cache, since cached keys were
computed by the old weights), set the pool's policy version, resume. Turns sampled afterwards
carry the new version in ``policy_version_start``/``_end``; a turn that was waiting in the
pause starts on the new version. If loading fails the pool resumes on the old weights and
version, and the error is raised.

A backend that can load weights implements :class:`Reloadable` (``reload_weights``);
:func:`reload_backend` calls it, or raises :class:`ReloadUnsupported` for one that cannot:

- ``transformers`` (embedded): in process,
  :meth:`rolloutd.daemon.llm.transformers.TransformersBackend.reload_weights`;
- ``model-server``: ``POST {url}/v1/reload`` (``rolloutd model-server``'s own route),
  :meth:`rolloutd.daemon.llm.vllm.ModelServerBackend.reload_weights`;
- ``vllm``: vLLM's own in-place reload through its development routes (``POST /collective_rpc``
  ``reload_weights`` with ``weights_path``, then ``/reset_prefix_cache``),
  :meth:`rolloutd.daemon.llm.vllm.VLLMBackend.reload_weights`; whole checkpoints only. A server
  without ``VLLM_SERVER_DEV_MODE=1`` answers 404 there: :class:`ReloadUnsupported`, and the
  trainer's own transport (NCCL / CUDA IPC, see shared research) does the update between
  ``POST /v1/backends/pause`` and ``/resume`` and then ``PUT /v1/policy_version``.

:func:`load_weights` is the blocking loader the in-process paths use. Every tensor in the
directory's ``*.safetensors`` files must name a parameter (or buffer) of the model with the
same shape; with ``partial=False`` every parameter must be given (tied parameters, such as
SmolLM2's ``lm_head`` tied to the embeddings, count as given with their twin). Everything is
checked before the first tensor is copied, so a bad directory leaves the model unchanged.

This module imports only :mod:`rolloutd.daemon.llm.base` from the package (no pool, no factory, no
backend), so every backend and the pool can import it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from rolloutd.daemon.llm.base import Backend, BackendRejected

#: A reload over HTTP may read a few GB from disk; allow for it.
RELOAD_HTTP_TIMEOUT_S = 600.0


class WeightsError(BackendRejected):
    """The weights cannot be loaded (no such directory, unknown tensor, wrong shape, ...)."""


class ReloadUnsupported(WeightsError):
    """This backend kind cannot load weights from a directory through rolloutd."""


class ReloadRequest(BaseModel):
    """Weight sync from a directory of safetensors (see docs/training.md)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, description="A directory of *.safetensors (or one file), readable by the backend.")
    version: int | None = Field(None, ge=0, description="The new policy version (default: current + 1).")
    partial: bool = Field(False, description="The files hold only some parameters; the others are kept.")


@runtime_checkable
class Reloadable(Protocol):
    """A backend that loads new weights from a directory (and drops its prefix/KV cache).

    ``version`` is the policy version the weights are for; a backend may record it (the
    model-server reports it as ``weights_version``) or ignore it. Returns what the backend
    reports (for the in-process loader: :func:`load_weights`'s dict). Raises
    :class:`WeightsError` when the weights do not fit, :class:`BackendUnavailable
    <rolloutd.daemon.llm.base.BackendUnavailable>` when the backend cannot be reached.
    """

    async def reload_weights(self, path: str, *, partial: bool, version: int | None) -> dict[str, Any]: ...


def reload_unsupported(backend: Backend, why: str = "") -> ReloadUnsupported:
    """The error for a backend that cannot load weights from a directory."""
    kind = getattr(backend, "kind", None)
    return ReloadUnsupported(
        f"backend {backend.name} ({kind}) cannot load weights from a directory through rolloutd"
        + (f" ({why})" if why else "")
        + ": sync its weights with the trainer's own transport between POST /v1/backends/pause and "
        "/resume, then PUT /v1/policy_version"
    )


async def reload_backend(
    backend: Backend, path: str, *, partial: bool = False, version: int | None = None
) -> dict[str, Any]:
    """Load the weights at ``path`` into one backend (no pausing: see
    :meth:`rolloutd.daemon.llm.pool.BackendPool.reload`); :class:`ReloadUnsupported` unless it is
    :class:`Reloadable`."""
    if not isinstance(backend, Reloadable):
        raise reload_unsupported(backend)
    return await backend.reload_weights(path, partial=partial, version=version)


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


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Blocking: name -> shape of every tensor under ``path``, read from the safetensors headers
    only (8 bytes of length, then JSON), without loading a tensor."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in weight_files(path):
        try:
            with f.open("rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                if not 0 < size < 100_000_000:
                    raise ValueError(f"header length {size}")
                header = json.loads(fh.read(size))
            shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightsError(f"cannot read {f}: {exc}") from None
    return shapes


def check_checkpoint(path: str | Path, reference: str | Path) -> None:
    """Blocking: ``path`` holds a whole checkpoint of the model ``reference`` holds: every
    tensor of ``reference`` with the same shape, no other (a tied ``lm_head.weight`` that
    ``reference`` leaves out may be given). For servers that die on a bad checkpoint (vLLM's
    engine does), checked before they see it. Raises :class:`WeightsError`."""
    given, want = tensor_shapes(path), tensor_shapes(reference)
    unknown = sorted(set(given) - set(want) - {"lm_head.weight"})
    if unknown:
        raise WeightsError(f"{len(unknown)} tensors name no parameter of the model, e.g. {unknown[:3]}")
    missing = sorted(set(want) - set(given))
    if missing:
        raise WeightsError(f"{len(missing)} parameters are missing (a whole checkpoint is needed), e.g. {missing[:3]}")
    for name, shape in given.items():
        if name in want and shape != want[name]:
            raise WeightsError(f"{name}: shape {shape} in the files, {want[name]} in the model")


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


__all__ = [
    "RELOAD_HTTP_TIMEOUT_S",
    "ReloadRequest",
    "ReloadUnsupported",
    "Reloadable",
    "WeightsError",
    "load_weights",
    "reload_backend",
    "reload_unsupported",
    "weight_files",
]
