"""What a benchmark counts as left behind by sandboxes (imports nothing of rolloutd)."""

from __future__ import annotations

import os
from typing import Any


def marked_processes(tag: str) -> int:
    """Live processes whose environment carries a sandbox marker of boot ``tag``."""
    marker = f"ROLLOUTD_SANDBOX={tag}/".encode()
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    count += marker in f.read()
            except OSError:
                pass
    return count


def sandbox_cgroups(backend: Any) -> int:
    """Cgroup dirs of ``backend``'s boot still present."""
    tag = backend.layout.boot_tag
    return sum(1 for base in backend.limits.boot_dirs() for p in base.rglob(f"{tag}/*")
               if p.is_dir())
