"""Sandboxes for agent rollouts: one interface, three backends (bwrap, apptainer, local).

    backend = open_backend("bwrap", state_dir=..., boot_id=...)
    async with backend.open(SandboxSpec(memory_mb=512)) as sb:
        result = await sb.run(["python3", "-c", "print(1)"], timeout_s=10)

Every process of a sandbox is spawned by its in-sandbox helper; see docs/sandbox.md.
"""

from ._apptainer import ApptainerBackend
from ._backend import Backend
from ._bwrap import BwrapBackend
from ._exceptions import (
    ImageError,
    ImageNotFound,
    PathEscapeError,
    SandboxClosed,
    SandboxError,
    SandboxStartError,
)
from ._local import LocalBackend
from ._models import Bind, DirEntry, FileStat, RunResult, SandboxSpec
from ._registry import BACKENDS, open_backend
from ._sandbox import Sandbox, SandboxProcess
from ._supervisor import SandboxSupervisor

__all__ = [
    "BACKENDS",
    "ApptainerBackend",
    "Backend",
    "Bind",
    "BwrapBackend",
    "DirEntry",
    "FileStat",
    "ImageError",
    "ImageNotFound",
    "LocalBackend",
    "PathEscapeError",
    "RunResult",
    "Sandbox",
    "SandboxClosed",
    "SandboxError",
    "SandboxProcess",
    "SandboxSpec",
    "SandboxStartError",
    "SandboxSupervisor",
    "open_backend",
]
