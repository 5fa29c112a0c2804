"""Supervised inference servers: ``rolloutd serve --spawn-vllm`` runs ``vllm serve`` children.

:func:`supervise_server` starts one server process, waits until ``GET /health`` answers,
registers it in the pool (once, under a fixed id), and restarts it whenever it dies (the pool
marks it unhealthy meanwhile; the health loop brings it back). On cancel it stops the process
group: SIGTERM, a grace period, SIGKILL, and waits for it (shielded, bounded).

The command is a template (``{port}``, ``{host}`` and ``{uds}`` are filled in), so the same
supervisor runs ``vllm serve`` on GPU nodes, the embedded model's vLLM CPU server
(:mod:`rolloutd.daemon.llm.cpu_engine`, on a Unix socket) and ``rolloutd model-server``.

While a server is starting or restarting, the pool knows it is expected
(:meth:`BackendPool.expect`), so turns wait for it (bounded by the pool's ``backend_wait_s``)
instead of failing with ``NoBackend``.

Each start of a server gets a temp dir of its own (``TMPDIR``, mode 0700), removed once the
process group has stopped: vLLM leaves files in its temp dir at every start (its ZMQ sockets,
``vllm_dist_*``), which would otherwise pile up in the node's ``/tmp``. Torch puts its
inductor cache there too (``torchinductor_<user>``, with its precompiled headers: about 150 MB
and seconds of a C++ build, always under the temp dir), so that name in the private dir is a
link to a lasting cache (``ServerSpec.compile_cache``), kept from one start to the next.
"""

from __future__ import annotations

import getpass
import hashlib
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import trio

from rolloutd.daemon.llm.base import LLMError, SamplingParams
from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.llm.vllm import VLLMBackend, build_request, http_backend

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
#: The warm-up (``ServerSpec.warm_up``): the batch it sends after one request alone, and its bound.
WARM_UP_BATCH = 3
WARM_UP_TIMEOUT_S = 120.0


#: The flags token-in/token-out RL needs from any vLLM server (shared/research/llm_backends.md):
#: logprobs of the distribution sampled from, no sampling defaults from the model's
#: generation_config, prefix caching (the sticky path) reported in ``usage``, ids as ``token_id:N``.
RL_FLAGS = (
    "--logprobs-mode", "processed_logprobs",
    "--generation-config", "vllm",
    "--enable-prefix-caching",
    "--enable-prompt-tokens-details",
    "--return-tokens-as-token-ids",
)


def vllm_serve_argv(model: str, *, served_name: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """``vllm serve`` with :data:`RL_FLAGS`."""
    argv = ["vllm", "serve", model, "--host", "{host}", "--port", "{port}", *RL_FLAGS]
    if served_name:
        argv += ["--served-model-name", served_name]
    return argv + list(extra)


@dataclass
class ServerSpec:
    """One supervised server: ``argv`` template, where it listens (``host``:``port``, or the
    Unix socket ``uds``), its pool id and label. ``log_path``: the server's stdout and stderr
    go there (appended) instead of the daemon's. ``start_attempts``: failed starts before the
    first healthy one after which :func:`supervise_server` gives up (raises)."""

    backend_id: str
    argv: list[str]
    port: int = 0
    host: str = "127.0.0.1"
    uds: str | None = None
    kind: str = "vllm"
    name: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)  # e.g. {"CUDA_VISIBLE_DEVICES": "0"}
    log_path: Path | None = None
    checkpoint: str | None = None  # the model directory it serves (reloads are checked against it)
    startup_timeout_s: float = 900.0
    restart_backoff_s: float = 5.0
    max_restarts: float = math.inf
    start_attempts: float = math.inf
    warm_up: bool = False  # sample a few tokens before it serves (see ``_warm_up``)
    nice: int = 0  # run it at this niceness (see ``_nice_session``)
    #: Where torch's inductor cache lasts between starts (see the module's docs), one dir in it
    #: per Python environment (see PROGRAM_FILE); None: where torch would put it for this
    #: process, ``<temp dir>/torchinductor_<user>``.
    compile_cache: Path | None = None

    @property
    def url(self) -> str:
        return "http://localhost" if self.uds else f"http://{self.host}:{self.port}"

    def client(self, **kw: Any) -> httpx.AsyncClient:
        """An HTTP client for the server (over its Unix socket where it has one)."""
        transport = httpx.AsyncHTTPTransport(uds=self.uds) if self.uds else None
        return httpx.AsyncClient(base_url=self.url, transport=transport, **kw)


def log_tail(path: Path | None, n: int = 2000) -> str:
    """The last ``n`` characters of a server's log (empty without one)."""
    if path is None:
        return ""
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


async def _accepts(uds: str) -> bool:
    """Something listens on the Unix socket ``uds`` (checked before httpx tries: its failed
    connects to a Unix socket leave the socket object unclosed)."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with sock:
        try:
            await sock.connect(uds)
        except OSError:
            return False
    return True


async def _wait_healthy(spec: ServerSpec, proc: trio.Process) -> None:
    with trio.fail_after(spec.startup_timeout_s):
        async with spec.client(timeout=2.0) as client:
            while proc.returncode is None:
                if spec.uds and not await _accepts(spec.uds):
                    await trio.sleep(0.2)
                    continue
                try:
                    if (await client.get("/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.2)
    raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")


async def _warm_up(spec: ServerSpec) -> None:
    """Sample a few tokens with logprobs, once alone and then WARM_UP_BATCH requests together,
    before the server joins the pool. vLLM compiles some of its sampling kernels at their first
    use (``torch.compile``: the logprob ranks, top-p/top-k), and again for the first batch of
    another size; on the CPU build that is a C++ build, about 1.5 s here, which otherwise
    lands in the first rollouts' turns. A failed warm-up is logged, not fatal: the server is
    healthy, and a real turn's error is reported with that turn."""
    params = SamplingParams(temperature=0.7, top_p=0.95, top_k=50, seed=0)
    started = trio.current_time()
    try:
        with trio.fail_after(WARM_UP_TIMEOUT_S):
            async with spec.client(timeout=WARM_UP_TIMEOUT_S) as client:
                resp = await client.get("/v1/models")
                resp.raise_for_status()
                model = resp.json()["data"][0]["id"]

                async def sample(i: int) -> None:
                    body = build_request(model, list(range(1, 17 + i)), params, max_tokens=4)
                    (await client.post("/v1/completions", json=body)).raise_for_status()

                await sample(0)
                async with trio.open_nursery() as nursery:
                    for i in range(WARM_UP_BATCH):
                        nursery.start_soon(sample, i)
    except (httpx.HTTPError, trio.TooSlowError, KeyError, IndexError, TypeError, ValueError) as exc:
        log.warning("%s: the warm-up failed (%s); serving anyway", spec.backend_id,
                    exc or type(exc).__name__)
        return
    log.info("%s: warmed up in %.1f s", spec.backend_id, trio.current_time() - started)


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
    ``spec.backend_id``. ``started(url)`` after the first successful health check. Raises
    :class:`ServerFailed` (with the log's tail) after ``start_attempts`` failed first starts
    or ``max_restarts`` restarts."""
    argv = [a.format(port=spec.port, host=spec.host, uds=spec.uds or "") for a in spec.argv]
    if spec.nice:
        argv = [shutil.which("nice") or "nice", "-n", str(spec.nice), *argv]
    env = dict(os.environ)  # with each start's TMPDIR, then spec.env (which may set its own)
    started = False
    restarts = failed_starts = 0
    backend = http_backend(spec.url, kind=spec.kind, name=spec.name, uds=spec.uds, checkpoint=spec.checkpoint)
    with pool.expect(spec.backend_id):
        while True:
            if spec.uds:  # a killed server leaves its socket file: the next one could not bind
                await trio.Path(spec.uds).unlink(missing_ok=True)
            scratch = await trio.to_thread.run_sync(_make_scratch, spec.backend_id,
                                                    spec.compile_cache, spec.argv[0])
            try:
                proc = await _open(argv, {**env, "TMPDIR": str(scratch), **spec.env}, spec.log_path)
            except BaseException:
                await _remove_scratch(scratch)
                raise
            if spec.nice:
                _nice_session(proc.pid, spec.nice)
            try:
                await _wait_healthy(spec, proc)
                if spec.warm_up:
                    await _warm_up(spec)
                if not started:
                    pool.add(backend, backend_id=spec.backend_id)
                    started = True
                    task_status.started(spec.url)
                else:
                    await _restore_weights(backend)
                    await pool.probe_all()
                log.info("%s serving at %s (pid %d)", spec.backend_id, spec.uds or spec.url, proc.pid)
                code = await proc.wait()
                log.warning("%s exited with %s; restarting", spec.backend_id, code)
                backend.restoring = backend.weights_path is not None  # not healthy before its weights are back
                pool.mark_unhealthy(spec.backend_id, f"process exited with {code}")
            except (RuntimeError, trio.TooSlowError) as exc:
                failed_starts += 1
                log.warning("%s failed to start: %s", spec.backend_id, exc or "timed out")
                if not started and failed_starts >= spec.start_attempts:
                    raise await _failed(spec, f"did not become healthy ({exc or 'timed out'})") from None
            finally:
                await _stop(proc)
                await _remove_scratch(scratch)
            restarts += 1
            if restarts > spec.max_restarts:
                raise await _failed(spec, f"gave up after {restarts} restarts")
            await trio.sleep(spec.restart_backoff_s)


def _inductor_dir_name() -> str:
    """The name torch gives its inductor cache under the temp dir (its ``default_cache_dir``)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)


def _make_scratch(backend_id: str, compile_cache: Path | None, program: str) -> Path:
    """A new private temp dir for one start of server ``backend_id``, holding a link to the
    lasting inductor cache: in ``compile_cache``, the dir of the Python environment of the
    server's ``program`` (its argv[0]; see ``_environment_cache``; None: the cache under this
    process's temp dir). Blocking."""
    name = _inductor_dir_name()
    if compile_cache is None:
        cache = Path(tempfile.gettempdir()) / name
        cache.mkdir(parents=True, exist_ok=True)
    else:  # the program as found on PATH (a venv's bin/python, links not followed)
        cache = _environment_cache(compile_cache, os.path.abspath(shutil.which(program) or program))
    scratch = Path(tempfile.mkdtemp(prefix=f"rolloutd-{re.sub(r'[^A-Za-z0-9_.-]', '_', backend_id)}-"))
    (scratch / name).symlink_to(cache.resolve(), target_is_directory=True)
    return scratch


#: A lasting compile cache holds one dir per Python environment that ran a server: torch
#: builds its precompiled header with that environment's include paths (about 150 MB each),
#: so every new virtualenv (every fresh clone of a CI run) would add one. Each dir is named by
#: a hash of the server's program path (``argv[0]`` as found on PATH, links not followed: a
#: venv's ``bin/python``) and records it in this file; a dir whose program is gone (the venv
#: was deleted) is removed when a server starts.
PROGRAM_FILE = "program"


def _environment_cache(base: Path, program: str) -> Path:
    """``base``'s dir for the environment of ``program``, made if missing; the dirs of
    environments whose program no longer exists removed. Blocking."""
    base.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(program.encode()).hexdigest()[:16]
    for entry in base.iterdir():
        if entry.name == key or not entry.is_dir():
            continue
        try:
            recorded = (entry / PROGRAM_FILE).read_text()
        except OSError:  # not one of these dirs: left alone
            continue
        if not os.path.lexists(recorded):
            log.info("removing the compile cache of %s (it no longer exists)", recorded)
            shutil.rmtree(entry, ignore_errors=True)
    mine = base / key
    mine.mkdir(exist_ok=True)
    marker = mine / PROGRAM_FILE
    if not marker.exists():
        marker.write_text(program)
    return mine


async def _remove_scratch(scratch: Path) -> None:
    """Remove a stopped server's temp dir (its link, not the cache it points to); shielded, and
    abandoned to its thread after a few seconds."""
    with trio.move_on_after(5, shield=True):
        await trio.to_thread.run_sync(shutil.rmtree, scratch, True, abandon_on_cancel=True)


async def _restore_weights(backend: VLLMBackend) -> None:
    """A restarted server starts from its model directory: load the checkpoint the pool last
    synced into it again before it serves, so no turn is sampled from stale weights. If that
    fails the server stays out of routing (its health is false) and the supervisor starts it
    again, and again tries (never serving the weights it started with instead)."""
    if backend.weights_path is None:
        return
    try:
        await backend.reload_weights(backend.weights_path)
    except LLMError as exc:
        raise RuntimeError(f"could not load its weights ({backend.weights_path}) again: {exc}") from None
    backend.restoring = False
    log.info("%s: weights %s loaded again after the restart", backend.name, backend.weights_path)


class ServerFailed(LLMError):
    """A supervised server could not be kept running; the message ends with its log's tail."""


async def _failed(spec: ServerSpec, what: str) -> ServerFailed:
    tail = await trio.to_thread.run_sync(log_tail, spec.log_path)
    where = f" (log {spec.log_path})" if spec.log_path else ""
    return ServerFailed(f"{spec.backend_id}: {what}{where}" + (f"\n{tail}" if tail else ""))


def _nice_session(pid: int, nice: int) -> None:
    """Give the server's session the niceness its threads have (``nice -n`` in its argv).

    The server runs in a session of its own (``start_new_session``, so that it can be stopped
    as a group), and where the kernel groups sessions for scheduling (autogroup,
    ``kernel.sched_autogroup_enabled``, for processes in the root CPU cgroup) a session
    competes with others as one whole, at its autogroup's nice, whatever its threads' own:
    without this, a niced server would still weigh as much as any other session."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError as exc:  # no autogroup here (or the process already ended): nothing to set
        log.debug("cannot set the autogroup nice of %d: %s", pid, exc)


def _open_log(path: Path) -> BinaryIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("ab")


async def _open(argv: list[str], env: dict[str, str], log_path: Path | None) -> trio.Process:
    if log_path is None:
        return await trio.lowlevel.open_process(argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    out = await trio.to_thread.run_sync(_open_log, log_path)
    with out:  # the child keeps its own copy of the descriptor
        return await trio.lowlevel.open_process(
            argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )
