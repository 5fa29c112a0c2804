"""local: the helper as a plain child process in a new session. NO ISOLATION.

For development only: the sandbox's processes run as the daemon's user, see the host's
file system, network and processes, and can signal the daemon (``kill -9 -1`` kills it).
What it still does: a workspace and control dir, the helper (so the API is the same),
file operations confined to the workspace and the sandbox's TMPDIR, cgroup limits and a
cgroup kill when cgroups are writable (else rlimits), and a marker-based kill of
everything the sandbox started at teardown. Every open logs a warning.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from ._backend import Backend, Handle
from ._models import SandboxSpec

log = logging.getLogger(__name__)


class LocalBackend(Backend):
    name: ClassVar[str] = "local"
    isolated: ClassVar[bool] = False

    def _workdir(self, spec: SandboxSpec, handle: Handle) -> str:
        return str(handle.dirs.workspace)

    def _roots(self, spec: SandboxSpec, handle: Handle) -> list[str]:
        return [str(handle.dirs.workspace), str(handle.dirs.tmp)]

    def _parent_death(self) -> bool:
        return True

    def _command(self, spec: SandboxSpec | None, handle: Handle, helper: list[str]) -> list[str]:
        return helper

    def _command_input(self, spec: SandboxSpec, handle: Handle) -> bytes:
        log.warning("sandbox %s uses the LOCAL backend: no isolation (development only)",
                    handle.dirs.id)
        handle.dirs.tmp.mkdir(exist_ok=True)
        return b""
