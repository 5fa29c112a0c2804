"""The sandboxes' CPU weight (``cpu_weight``, the daemon's ``sandbox_cpu_weight``): all
sandboxes of a daemon sit in one cgroup, which competes for CPU with the daemon's own process
as one entity. A small weight keeps the daemon (API, gossip, agent loop) ahead of its
sandboxes when the CPU is contended. Real cgroups, a real CPU hog in a real bwrap sandbox."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from rolloutd.sandbox import SandboxSpec, SandboxStartError, open_backend

#: Spin for SECONDS of wall time on the CPU this process is pinned to; print the CPU seconds got.
HOG = ("import os, time\n"
       "os.sched_setaffinity(0, {cpu})\n"
       "end = time.monotonic() + {seconds}\n"
       "while time.monotonic() < end: pass\n"
       "t = os.times(); print(t.user + t.system)\n")
SECONDS = 1.5


def _weight_file(backend) -> Path:
    limits = backend.limits
    if limits.kind == "cgroup-v2":
        return limits.v2_root / "cpu.weight"
    if limits.kind == "cgroup-v1" and "cpu" in limits.v1_roots:
        return limits.v1_roots["cpu"] / "cpu.shares"
    pytest.skip(f"no cgroup cpu controller here (limits: {limits.kind})")


@contextlib.contextmanager
def _kept_weight(state_dir: Path, boot_id: str) -> Iterator[Path]:
    """The sandboxes' common weight file, put back as it was when the block exits (found
    through a backend that writes no weight)."""
    path = _weight_file(open_backend("bwrap", state_dir=state_dir, boot_id=boot_id + "w"))
    before = path.read_text().strip()
    try:
        yield path
    finally:
        path.write_text(before)


def test_a_bad_weight_is_refused(state_dir, boot_id):
    with pytest.raises(SandboxStartError, match="cpu_weight"):
        open_backend("bwrap", state_dir=state_dir, boot_id=boot_id, cpu_weight=0)


def test_the_sandboxes_common_cgroup_gets_the_weight(state_dir, boot_id):
    with _kept_weight(state_dir, boot_id) as path:
        backend = open_backend("bwrap", state_dir=state_dir, boot_id=boot_id, cpu_weight=0.25)
        assert _weight_file(backend) == path
        expected = "25" if path.name == "cpu.weight" else "256"
        assert path.read_text().strip() == expected
        assert backend.statistics()["cpu_weight"] == f"{path.name}={expected}"
        untouched = open_backend("bwrap", state_dir=state_dir, boot_id=boot_id + "b")
        assert untouched.statistics()["cpu_weight"] is None  # None leaves the cgroup alone
        assert path.read_text().strip() == expected


async def _daemon_share(state_dir: Path, boot_id: str, weight: float | None) -> float:
    """A CPU hog in a sandbox and one in this process's cgroup (where the daemon would be),
    both pinned to one CPU for SECONDS: the share of that CPU the host hog got."""
    cpu = min(os.sched_getaffinity(0))
    hog = HOG.format(cpu={cpu}, seconds=SECONDS)
    with _kept_weight(state_dir, boot_id):
        backend = open_backend("bwrap", state_dir=state_dir, boot_id=boot_id, cpu_weight=weight)
        try:
            return await _share(backend, hog)
        finally:
            await backend.aclose()


async def _share(backend: Any, hog: str) -> float:
    async with backend.open(SandboxSpec()) as sb:
        results: dict[str, float] = {}

        async def in_sandbox() -> None:
            r = await sb.run([sb.python, "-c", hog], timeout_s=30)
            results["sandbox"] = float(r.stdout)

        async def on_host() -> None:
            r = await trio.run_process([sys.executable, "-c", hog], capture_stdout=True,
                                       stdin=subprocess.DEVNULL)
            results["host"] = float(r.stdout)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_sandbox)
            nursery.start_soon(on_host)
    return results["host"] / (results["host"] + results["sandbox"])


@pytest.mark.slow
async def test_under_contention_the_daemon_gets_its_share_first(state_dir, boot_id, leak_check):
    """Weight 0.125: the host side should get 1024/(1024+128) = 0.89 of the contended CPU;
    at weight 1 (a process's own), half. Wide margins: this VM has neighbours."""
    weighted = await _daemon_share(state_dir, boot_id, 0.125)
    equal = await _daemon_share(state_dir, boot_id + "e", 1.0)
    assert weighted > 0.75, f"the host hog got {weighted:.2f} of the CPU against a 0.125 weight"
    assert equal < 0.65, f"the host hog got {equal:.2f} of the CPU against an equal weight"
