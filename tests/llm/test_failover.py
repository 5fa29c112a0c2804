"""Failover with real model-server processes (serving the scripted TEST DOUBLE for speed):
one is killed mid-rollout; the supervisor restarts a dead ``--spawn-vllm`` style child, each
start in a temp dir of its own."""

import os
import signal
import socket
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio

from rolloutd.daemon.agent import AgentLimits, run_agent
from rolloutd.daemon.llm.base import SamplingParams
from rolloutd.daemon.llm.pool import BackendPool
from rolloutd.daemon.llm.spawn import ServerSpec, supervise_server, vllm_serve_argv
from rolloutd.daemon.llm.vllm import ModelServerBackend
from rolloutd.daemon.tasks.base import Prompt
from rolloutd.daemon.trajectory import Trajectory
from tests._procs import environ

from .conftest import open_model_server
from .test_agent import FakeToolbox, call

REPLIES = [call("bash", cmd=f"step {i}") for i in range(3)] + ["done: 42"]


async def test_rollout_survives_its_backend_being_killed(renderer):
    args = ["--backend", "scripted", "--latency-s", "0.5"] + [a for r in REPLIES for a in ("--reply", r)]
    async with open_model_server(*args) as s0, open_model_server(*args) as s1:
        servers = {"ms0": s0, "ms1": s1}
        pool = BackendPool(health_interval_s=0.5)
        for bid, s in servers.items():
            pool.add(ModelServerBackend(s.url), backend_id=bid)
        tr = Trajectory(id="r")
        killed = []
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)

            async def killer():
                # wait until turn 2 is in flight on the rollout's backend, then SIGKILL it
                while True:
                    home = pool._sticky.get("r")
                    if home and len(tr.turns) == 1 and any(d["id"] == home and d["in_flight"] for d in pool.describe()):
                        servers[home].kill()
                        killed.append(home)
                        return
                    await trio.sleep(0.02)

            nursery.start_soon(killer)
            answer = await run_agent(trajectory=tr, prompt=Prompt(messages=[{"role": "user", "content": "go"}]),
                                     pool=pool, renderer=renderer, toolbox=FakeToolbox(), params=SamplingParams(),
                                     limits=AgentLimits(), sticky_key="r", group_key=None)
            nursery.cancel_scope.cancel()
        home = killed[0]
        other = "ms1" if home == "ms0" else "ms0"
        assert answer == "done: 42" and tr.finish_reason == "stop" and len(tr.turns) == 4
        assert [t.backend for t in tr.turns] == [home, other, other, other]
        assert tr.turns[1].retries == 1 and tr.turns[1].backend_switches == [other]
        assert all(t.retries == 0 for t in tr.turns[2:])
        # the script continued where it was: the failed turn was re-sampled, not skipped
        assert [tc.arguments["cmd"] for t in tr.turns[:3] for tc in t.tool_calls] == ["step 0", "step 1", "step 2"]
        assert len(tr.token_ids) == len(tr.loss_mask) == len(tr.logprobs)
        d = {x["id"]: x for x in pool.describe()}
        assert not d[home]["healthy"] and d[home]["failures"] == 1


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scripted_server(backend_id: str, port: int, **options: Any) -> ServerSpec:
    """A supervised ``rolloutd model-server`` with scripted replies (a TEST DOUBLE, not a model)."""
    return ServerSpec(
        backend_id=backend_id, port=port, kind="model-server", startup_timeout_s=60,
        argv=[sys.executable, "-m", "rolloutd.daemon.llm.model_server", "--backend", "scripted", "--port", "{port}"],
        **options,
    )


async def test_supervisor_restarts_a_dead_server():
    port = _free_port()
    spec = _scripted_server("spawned-0", port, restart_backoff_s=0.1)
    pool = BackendPool(health_interval_s=0.5)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(supervise_server, spec, pool)
        assert url == f"http://127.0.0.1:{port}"
        c = await pool.complete([1, 2], SamplingParams(), max_tokens=4, sticky_key="a")
        assert c.extra["backend_id"] == "spawned-0"
        pid = _listener_pid(port)
        os.kill(pid, signal.SIGKILL)
        with trio.fail_after(60):
            while pool.describe()[0]["healthy"]:
                await trio.sleep(0.05)
            while not pool.describe()[0]["healthy"]:
                await trio.sleep(0.1)
        assert _listener_pid(port) != pid
        c = await pool.complete([1, 2], SamplingParams(), max_tokens=4, sticky_key="a")
        assert c.finish_reason in ("stop", "length")
        nursery.cancel_scope.cancel()
    await pool.aclose()


async def test_supervisor_warms_a_server_up_before_it_serves():
    """``warm_up``: 1 + WARM_UP_BATCH completions with logprobs reach the server before the
    supervisor reports it started (so before the pool routes any turn to it)."""
    from rolloutd.daemon.llm.spawn import WARM_UP_BATCH

    port = _free_port()
    spec = _scripted_server("warm-0", port, warm_up=True)
    pool = BackendPool(health_interval_s=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervise_server, spec, pool)
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        outcomes = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("rolloutd_model_server_requests_total{")}
        assert sum(outcomes.values()) == 1 + WARM_UP_BATCH, text
        assert not {"bad_request", "error"} & set(outcomes), text  # answered, not refused
        nursery.cancel_scope.cancel()
    await pool.aclose()


async def test_supervised_server_runs_niced_with_its_session():
    """``nice``: every thread of the server at that niceness, and its session's autogroup too
    (where the kernel has autogroups), so that it weighs no more than the sandboxes."""
    port = _free_port()
    spec = _scripted_server("nice-0", port, nice=7)
    pool = BackendPool(health_interval_s=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervise_server, spec, pool)
        pid = _listener_pid(port)
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                assert int(f.read().rsplit(")", 1)[1].split()[16]) == 7  # field 19: nice
        if os.path.exists(f"/proc/{pid}/autogroup"):
            with open(f"/proc/{pid}/autogroup") as f:
                assert f.read().split()[-1] == "7"
        nursery.cancel_scope.cancel()
    await pool.aclose()


def test_engine_nice_matches_the_sandboxes_weight():
    from rolloutd.daemon.llm.cpu_engine import nice_for_weight

    assert nice_for_weight(0.125) == 9  # 1024 / 1.25**9 = 110, against the sandboxes' 128
    assert nice_for_weight(None) == 0 and nice_for_weight(1.0) == 0 and nice_for_weight(4) == 0
    assert nice_for_weight(0.001) == 19


async def test_each_start_of_a_server_gets_a_temp_dir_of_its_own(tmp_path):
    """Each start runs with a TMPDIR of its own (mode 0700, in this process's temp dir) that
    links torch's inductor cache name to the lasting ``compile_cache``: its dir for the
    server's Python environment, where the dir of an environment that is gone no longer is.
    The TMPDIR goes once that start's server has stopped, after a crash and at the end; the
    cache stays."""
    port = _free_port()
    cache = tmp_path / "compile"
    gone = cache / "0123456789abcdef"  # a deleted venv's cache
    gone.mkdir(parents=True)
    (gone / "program").write_text(str(tmp_path / "deleted-venv" / "bin" / "python"))
    other = cache / "not-ours"  # no record of a program: left alone
    other.mkdir()
    spec = _scripted_server("tmp-0", port, restart_backoff_s=0.1, compile_cache=cache)
    pool = BackendPool(health_interval_s=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervise_server, spec, pool)
        pid = _listener_pid(port)
        first = Path(environ(pid)["TMPDIR"])
        assert first.parent == Path(tempfile.gettempdir()) and first.name.startswith("rolloutd-tmp-0-")
        info = first.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
        (link,) = first.glob("torchinductor_*")
        mine = link.resolve()
        assert link.is_symlink() and mine.parent == cache.resolve()
        assert (link / "program").read_text() == os.path.abspath(sys.executable)
        assert not gone.exists() and other.is_dir()
        os.kill(pid, signal.SIGKILL)
        with trio.fail_after(60):
            while True:
                try:
                    if (new_pid := _listener_pid(port)) != pid:
                        break
                except AssertionError:  # between the two servers
                    pass
                await trio.sleep(0.05)
        second = Path(environ(new_pid)["TMPDIR"])
        assert second != first and second.is_dir() and not first.exists()
        nursery.cancel_scope.cancel()
    assert not second.exists() and (mine / "program").is_file()
    await pool.aclose()



def _listener_pid(port):
    """The pid of the process whose command line names the port (our child)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            if b"rolloutd.daemon.llm.model_server" in cmd and str(port).encode() in cmd:
                return int(entry)
    raise AssertionError("no server process")


def test_vllm_serve_argv_has_the_rl_flags():
    argv = vllm_serve_argv("Qwen/Qwen2.5-0.5B-Instruct", served_name="policy")
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen2.5-0.5B-Instruct"]
    s = " ".join(argv)
    for flag in ("--logprobs-mode processed_logprobs", "--generation-config vllm", "--enable-prefix-caching",
                 "--port {port}", "--served-model-name policy"):
        assert flag in s
