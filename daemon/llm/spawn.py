"""Supervised inference servers: ``rolloutd serve --spawn-vllm`` runs ``vllm serve`` children.

:func:`supervise_server` starts one server process, waits until ``GET /health`` answers,
registers it in the pool (once, under a fixed id), and restarts it whenever it dies (the pool
marks it unhealthy meanwhile; the health loop brings it back). On cancel it stops the process
group: SIGTERM, a grace period, SIGKILL, and waits for it (shielded, bounded).

The command is a template (``{port}`` and ``{host}`` are filled in), so the same supervisor runs
``vllm serve`` on GPU nodes and ``rolloutd model-server`` anywhere (that is how it is tested).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx
import trio

from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.llm.vllm import http_backend

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0


def vllm_serve_argv(model: str, *, served_name: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """``vllm serve`` with the flags token-in/token-out RL needs (shared/research/llm_backends.md)."""
    argv = [
        "vllm", "serve", model, "--host", "{host}", "--port", "{port}",
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--return-tokens-as-token-ids",
    ]
    if served_name:
        argv += ["--served-model-name", served_name]
    return argv + list(extra)


@dataclass
class ServerSpec:
    """One supervised server: ``argv`` template, where it listens, its pool id."""

    backend_id: str
    argv: list[str]
    port: int
    host: str = "127.0.0.1"
    kind: str = "vllm"
    env: Mapping[str, str] = field(default_factory=dict)  # e.g. {"CUDA_VISIBLE_DEVICES": "0"}
    startup_timeout_s: float = 900.0
    restart_backoff_s: float = 5.0
    max_restarts: float = math.inf

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


async def _wait_healthy(url: str, proc: trio.Process, timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        async with httpx.AsyncClient(timeout=2.0) as client:
            while proc.returncode is None:
                try:
                    if (await client.get(url + "/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.2)
    raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")


async def _stop(proc: trio.Process) -> None:
    with trio.move_on_after(STOP_GRACE_S + 5, shield=True):
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            with trio.move_on_after(STOP_GRACE_S):
                await proc.wait()
            if proc.returncode is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await proc.wait()


async def supervise_server(
    spec: ServerSpec, pool: BackendPool, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run ``spec``'s server forever (restarting it), registered in ``pool`` as
    ``spec.backend_id``. ``started(url)`` after the first successful health check."""
    argv = [a.format(port=spec.port, host=spec.host) for a in spec.argv]
    env = {**os.environ, **spec.env}
    started = False
    restarts = 0
    while True:
        proc = await trio.lowlevel.open_process(
            argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL
        )
        try:
            await _wait_healthy(spec.url, proc, spec.startup_timeout_s)
            if not started:
                pool.add(http_backend(spec.url, kind=spec.kind), backend_id=spec.backend_id)
                started = True
                task_status.started(spec.url)
            else:
                await pool.probe_all()
            log.info("%s serving at %s (pid %d)", spec.backend_id, spec.url, proc.pid)
            code = await proc.wait()
            log.warning("%s exited with %s; restarting", spec.backend_id, code)
            pool.mark_unhealthy(spec.backend_id, f"process exited with {code}")
        except (RuntimeError, trio.TooSlowError) as exc:
            log.warning("%s failed to start: %s", spec.backend_id, exc)
            if not started and restarts >= spec.max_restarts:
                raise
        finally:
            await _stop(proc)
        restarts += 1
        if restarts > spec.max_restarts:
            raise RuntimeError(f"{spec.backend_id}: gave up after {restarts} restarts")
        await trio.sleep(spec.restart_backoff_s)
