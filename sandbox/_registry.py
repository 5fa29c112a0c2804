"""Backend names -> classes, and ``open_backend``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._apptainer import ApptainerBackend
from ._backend import Backend
from ._bwrap import BwrapBackend
from ._exceptions import SandboxStartError
from ._local import LocalBackend

BACKENDS: dict[str, type[Backend]] = {
    "bwrap": BwrapBackend,
    "apptainer": ApptainerBackend,
    "local": LocalBackend,
}


def open_backend(name: str, *, state_dir: Path | str, boot_id: str, check: bool = False,
                 **options: Any) -> Backend:
    """Make the backend called ``name``. With ``check=True`` it is probed first and a
    missing binary or missing kernel support raises SandboxStartError (never a silent
    fallback to another backend). The probe blocks briefly: call it before the event
    loop's hot path, or from a thread."""
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise SandboxStartError(f"unknown sandbox backend {name!r} "
                                f"(choose from {', '.join(BACKENDS)})") from None
    backend = cls(state_dir=state_dir, boot_id=boot_id, **options)
    if check:
        backend.check()
    return backend
