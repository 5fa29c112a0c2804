"""Pipeline benchmark: stage overlap and per-rollout overhead of the daemon.

1. overlap: jobs of the labelled sleep task (init 1, run 2, eval 3 units) through the real
   pipeline with equal worker counts per stage. Throughput is compared with the bound set by
   the bottleneck stage (EVAL: workers / 3 units) and with a coupled baseline in which the
   same total number of workers each run init+run+eval of one job in turn.
2. overhead: no-op sleep rollouts submitted over HTTP to a real `rolloutd serve` process by
   the async client in batches; completed rollouts per second and the daemon's CPU time per
   rollout (from /proc/<pid>/stat).

Ends with: RESULT overlap_efficiency=F coupled_ratio=F rollouts_per_s=F cpu_ms_per_rollout=F
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rolloutd.daemon.client import AsyncClient  # noqa: E402
from rolloutd.daemon.config import Settings  # noqa: E402
from rolloutd.daemon.node import Node  # noqa: E402
from rolloutd.daemon.pipeline import Services  # noqa: E402
from rolloutd.daemon.service import RolloutRequest  # noqa: E402

UNIT_S = 0.05
WORKERS = 4
JOBS = 400
BATCH = 200
BATCHES = 25
CONCURRENT_SUBMITTERS = 4


async def overlap() -> tuple[float, float, float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(state_dir=Path(tmp), n_init=WORKERS, n_run=WORKERS, n_eval=WORKERS,
                            queue_size=JOBS * 2)
        node = Node(settings, services=Services())
        async with trio.open_nursery() as nursery:
            await nursery.start(node.pipeline.run)
            task = {"kind": "sleep", "init_s": 1 * UNIT_S, "run_s": 2 * UNIT_S, "eval_s": 3 * UNIT_S}
            start = trio.current_time()
            sub = node.submit(RolloutRequest(task=task, n=JOBS))
            await node.service.wait(sub.jobs)
            pipelined = JOBS / (trio.current_time() - start)
            nursery.cancel_scope.cancel()
    bound = WORKERS / (3 * UNIT_S)

    # Coupled baseline: 3 * WORKERS workers, each doing a whole job at a time.
    remaining = JOBS

    async def coupled_worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            for units in (1, 2, 3):
                await trio.sleep(units * UNIT_S)

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(3 * WORKERS):
            nursery.start_soon(coupled_worker)
    coupled = JOBS / (trio.current_time() - start)
    return pipelined, bound, coupled, pipelined / bound


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def overhead() -> tuple[float, float, int]:
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, ROLLOUTD_STATE_DIR=tmp, ROLLOUTD_QUEUE_SIZE="100000",
                   ROLLOUTD_N_INIT="64", ROLLOUTD_N_RUN="64", ROLLOUTD_N_EVAL="64",
                   ROLLOUTD_LOG_LEVEL="warning", ROLLOUTD_SANDBOX_BACKEND="local")
        proc = subprocess.Popen([sys.executable, "-m", "rolloutd.daemon.cli", "serve", "--port", str(port)], env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            async with AsyncClient(url) as c:
                for _ in range(200):
                    try:
                        await c.status()
                        break
                    except Exception:
                        await trio.sleep(0.1)
                # warm-up
                await c.wait((await c.submit({"kind": "sleep"}, n=BATCH)).ids)
                cpu0, t0 = _cpu_s(proc.pid), time.perf_counter()
                done = 0
                todo = list(range(BATCHES))

                async def submitter() -> None:
                    nonlocal done
                    while todo:
                        todo.pop()
                        sub = await c.submit({"kind": "sleep"}, n=BATCH)
                        trajs = await c.wait(sub.ids)
                        done += sum(t.status.value == "completed" for t in trajs)

                async with trio.open_nursery() as nursery:
                    for _ in range(CONCURRENT_SUBMITTERS):
                        nursery.start_soon(submitter)
                elapsed = time.perf_counter() - t0
                cpu = _cpu_s(proc.pid) - cpu0
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return done / elapsed, cpu * 1000 / max(1, done), done


async def main() -> None:
    pipelined, bound, coupled, efficiency = await overlap()
    rps, cpu_ms, done = await overhead()
    table = Table(title=f"pipeline benchmark (unit {UNIT_S * 1000:.0f} ms, {WORKERS} workers per stage)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("note")
    table.add_row("pipelined jobs/s", f"{pipelined:.1f}", f"{JOBS} jobs, init 1 / run 2 / eval 3 units")
    table.add_row("bottleneck bound jobs/s", f"{bound:.1f}", "EVAL workers / 3 units")
    table.add_row("overlap efficiency", f"{efficiency:.3f}", "target >= 0.95")
    table.add_row("coupled baseline jobs/s", f"{coupled:.1f}", f"{3 * WORKERS} workers, whole jobs")
    table.add_row("pipelined / coupled", f"{pipelined / coupled:.3f}", "equal total workers")
    table.add_row("HTTP no-op rollouts/s", f"{rps:.0f}", f"{done} rollouts, batches of {BATCH}; target >= 500")
    table.add_row("daemon CPU ms/rollout", f"{cpu_ms:.3f}", "utime+stime of the serve process")
    Console().print(table)
    print(
        f"RESULT overlap_efficiency={efficiency:.3f} coupled_ratio={pipelined / coupled:.3f} "
        f"rollouts_per_s={rps:.1f} cpu_ms_per_rollout={cpu_ms:.3f}"
    )


if __name__ == "__main__":
    trio.run(main)
