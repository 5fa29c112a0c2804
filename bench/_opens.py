"""Timed sandbox opens, shared by bench/images.py and the rootless run it starts
(bench/_rootless_open.py, which imports only the sandbox package and this)."""

from __future__ import annotations

import time
from typing import Any

from rolloutd.sandbox import SandboxSpec


async def warm_opens(backend: Any, ref: str | None, n: int) -> list[float]:
    """ms from open start to the first command's return, ``n`` sequential opens (``ref``
    None: the host root, no image)."""
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with backend.open(SandboxSpec(image=ref)) as sb:
            r = await sb.run(["/bin/true"], timeout_s=30)
            samples.append((time.perf_counter() - t0) * 1000)
            if r.exit_code != 0:
                raise RuntimeError(f"/bin/true in the image exited {r.exit_code}: {r.stderr!r}")
    return samples
