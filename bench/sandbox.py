"""Sandbox benchmark: open latency, density, and leaks over many cycles.

    python bench/sandbox.py [--cycles 500] [--concurrent 256] [--latency-n 60]

1. open + first command (``echo``) latency, p50/p95, per backend available here (cold:
   fresh namespaces, mounts and helper every time), with the daemon's default
   ``sandbox_spares`` (launchers parked in fresh cgroups; the RESULT line) and with none
   (the open pays the kernel's cgroup move), plus the supervisor's warm pool (a
   pre-opened bwrap sandbox handed out at once), and two floors measured alongside: bwrap
   with the same layout running /bin/true, and the helper's interpreter doing nothing.
2. N bwrap sandboxes open at once, each with a live bash on a pty: proportional set size
   (PSS, from /proc/PID/smaps_rollup) of every process they own, per sandbox.
3. M bwrap open/close cycles (4 at a time, each runs a command and leaves a background
   process behind): leaked processes, fds, mounts, sandbox dirs and cgroups afterwards.

Ends with: RESULT bwrap_open_p50_ms=F bwrap_open_p95_ms=F concurrent_sandboxes=N
rss_mb_per_sandbox=F leaks=N
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _leaks  # noqa: E402
from rolloutd.daemon.config import Settings  # noqa: E402
from rolloutd.sandbox import SandboxSpec, SandboxSupervisor, open_backend  # noqa: E402

SPARES = Settings.model_fields["sandbox_spares"].default  # the daemon's default


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def open_latency(backend, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with backend.open(SandboxSpec()) as sb:
            r = await sb.run(["echo", "hi"], timeout_s=10)
            samples.append((time.perf_counter() - t0) * 1000)
            assert r.stdout == b"hi\n"
    return samples


def floors(backend, n: int) -> dict[str, list[float]]:
    """What a cold open cannot go below on this machine today (run in a thread): bwrap
    with the sandbox's own layout running /bin/true, and the helper's interpreter doing
    nothing. Printed so a slow phase of a shared host shows as such."""
    from rolloutd.sandbox._backend import Handle
    from rolloutd.sandbox._bwrap import bwrap_options

    dirs = backend.layout.new()
    try:
        options = bwrap_options(SandboxSpec(), Handle(dirs), state_dir=str(backend.layout.state_dir),
                                lib_dir=str(backend.layout.lib_dir()))
        commands = {"floor: bwrap, this layout, /bin/true": [backend.bwrap, *options, "--", "/bin/true"],
                    "floor: helper's python -I -S -c pass": [backend.helper_python, "-I", "-S", "-c", "pass"]}
        out: dict[str, list[float]] = {label: [] for label in commands}
        for _ in range(n):
            for label, argv in commands.items():
                t0 = time.perf_counter()
                subprocess.run(argv, check=True, stdin=subprocess.DEVNULL)
                out[label].append((time.perf_counter() - t0) * 1000)
        return out
    finally:
        dirs.release()


async def pool_latency(state_dir: Path, n: int) -> list[float]:
    sup = SandboxSupervisor(default_backend="bwrap", state_dir=state_dir, boot_id="benchpool",
                            pool_size=4)
    samples = []
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        for _ in range(n):
            while sup.statistics()["pool_idle"] < 1:  # measure a warm hand-out, not a refill
                await trio.sleep(0.01)
            t0 = time.perf_counter()
            sb = await sup.open(SandboxSpec())
            await sb.run(["echo", "hi"], timeout_s=10)
            samples.append((time.perf_counter() - t0) * 1000)
            await sup.release(sb)
        nursery.cancel_scope.cancel()
    return samples


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def mem_available_kb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


async def density(backend, count: int) -> tuple[int, float, float, float]:
    """Open ``count`` sandboxes with a live shell each; (opened, pss MB/sb, avail MB/sb, s)."""
    opened: list = []
    fds: list[int] = []
    limiter = trio.CapacityLimiter(8)
    release = trio.Event()
    ready = trio.Event()
    avail_before = mem_available_kb()
    t0 = time.perf_counter()

    async def hold() -> None:
        async with limiter:
            cm = backend.open(SandboxSpec())
            sb = await cm.__aenter__()
        try:
            proc = await sb.spawn(["bash", "--norc", "--noprofile", "-i"], pty=True)
            fds.append(proc.pty_fd)
            opened.append(sb)
            if len(opened) == count:
                ready.set()
            await release.wait()
        finally:
            with trio.CancelScope(shield=True):
                await cm.__aexit__(None, None, None)

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(hold)
        with trio.move_on_after(600):
            await ready.wait()
        elapsed = time.perf_counter() - t0
        await trio.sleep(1.0)  # let the shells settle
        pids = descendants(os.getpid())
        pss = sum(pss_kb(p) for p in pids) / 1024
        avail = (avail_before - mem_available_kb()) / 1024
        n = len(opened)
        release.set()
    for fd in fds:
        os.close(fd)
    return n, pss / max(n, 1), avail / max(n, 1), elapsed


def snapshot(state_dir: Path, backend) -> dict[str, int]:
    tag = backend.layout.boot_tag
    procs = _leaks.marked_processes(tag)
    procs += len(descendants(os.getpid()))
    with open("/proc/self/mountinfo") as f:
        mounts = sum(1 for _ in f)
    boxes = state_dir / "sandboxes"
    dirs = sum(1 for _ in boxes.rglob("*")) if boxes.exists() else 0
    cgroups = _leaks.sandbox_cgroups(backend)
    return {"processes": procs, "fds": len(os.listdir("/proc/self/fd")), "mounts": mounts,
            "dirs": dirs, "cgroups": cgroups}


async def cycles(backend, n: int, workers: int = 4) -> None:
    async def worker(count: int) -> None:
        for _ in range(count):
            async with backend.open(SandboxSpec()) as sb:
                await sb.run(["sh", "-c", "echo x > f; setsid sleep 300 & echo ok"], timeout_s=10)
                proc = await sb.spawn(["sleep", "300"])
                await proc.aclose()

    async with trio.open_nursery() as nursery:
        for i in range(workers):
            nursery.start_soon(worker, n // workers + (i < n % workers))


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--concurrent", type=int, default=256)
    parser.add_argument("--latency-n", type=int, default=60)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    root = Path(tempfile.mkdtemp(prefix="rldb", dir="/tmp"))
    try:
        rows = []
        backends = {}
        for name in ("bwrap", "local", "apptainer"):
            try:
                backends[name] = open_backend(name, state_dir=root / name, boot_id="bench",
                                              check=True, spares=SPARES)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"{name}: not available here ({exc})")
        bare = open_backend("bwrap", state_dir=root / "bare", boot_id="bench", spares=0)
        import logging

        logging.getLogger("rolloutd.sandbox._local").setLevel(logging.ERROR)
        latency = {}
        for name, backend in backends.items():
            if name == "apptainer":
                print("apptainer: needs an image; latency not measured here")
                continue
            backend.warm_up()
            await open_latency(backend, 3)  # warm caches
            latency[name] = await open_latency(backend, args.latency_n)
            rows.append((f"{name} open+first command (cold, {SPARES} spares)", latency[name]))
        await open_latency(bare, 3)
        rows.append(("bwrap open+first command (cold, no spares)",
                     await open_latency(bare, args.latency_n)))
        pool = await pool_latency(root / "pool", args.latency_n)
        rows.append(("bwrap warm pool open+first command", pool))
        floor = await trio.to_thread.run_sync(floors, backends["bwrap"], args.latency_n)
        rows += list(floor.items())
        print(f"\n{'case':44} {'p50 ms':>8} {'p95 ms':>8} {'n':>5}")
        for label, samples in rows:
            print(f"{label:44} {statistics.median(samples):8.1f} {pct(samples, 0.95):8.1f} "
                  f"{len(samples):5d}")
        bwrap = backends["bwrap"]
        baseline = snapshot(root / "bwrap", bwrap)
        n, pss, avail, elapsed = await density(bwrap, args.concurrent)
        print(f"\n{n} bwrap sandboxes open at once, each with bash on a pty "
              f"(opened in {elapsed:.1f} s): PSS {pss:.2f} MB/sandbox, "
              f"MemAvailable drop {avail:.2f} MB/sandbox (incl. kernel)")
        t0 = time.perf_counter()
        await cycles(bwrap, args.cycles)
        await trio.sleep(0.5)
        after = snapshot(root / "bwrap", bwrap)
        leaks = {k: max(0, after[k] - baseline[k]) for k in baseline}
        print(f"\n{args.cycles} open/close cycles in {time.perf_counter() - t0:.1f} s; "
              f"baseline {baseline}; after {after}")
        print(f"leaked: {leaks} (parked spare launchers are in both snapshots)")
        p50, p95 = statistics.median(latency["bwrap"]), pct(latency["bwrap"], 0.95)
        target = "met" if p50 <= 20 else "MISSED"
        print(f"\ntarget bwrap open+first command p50 <= 20 ms: {target}")
        for backend in [*backends.values(), bare]:
            await backend.aclose()
        print(f"RESULT bwrap_open_p50_ms={p50:.1f} bwrap_open_p95_ms={p95:.1f} "
              f"concurrent_sandboxes={n} rss_mb_per_sandbox={pss:.2f} "
              f"leaks={sum(leaks.values())}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    trio.run(main)
