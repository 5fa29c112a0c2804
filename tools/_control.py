"""Files the daemon writes into a sandbox's control dir.

The control dir is bind-mounted writable inside the sandbox, so anything there may have
been planted by the sandbox: a symlink at a name the daemon is about to write would lead
the daemon (root in production) into a host file. Every file the tools create there gets a
new random name and is created with ``O_EXCL | O_NOFOLLOW``, so it is never written
through something the sandbox put there.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_private"]


def write_private(path: Path, data: bytes) -> None:
    """Create ``path`` (mode 0600) and write ``data``; fails if anything is already there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with open(fd, "wb") as f:
        f.write(data)
