"""The real `rolloutd serve`, launched by contrib/slurm/rolloutd.sbatch under a real Slurm.

One job, 3 tasks on one node (`sbatch -N1 -n3 --overcommit`): 3 daemons on 3 ports. The job
publishes a 0600 token, the seeds and the front's env file; the daemons refuse requests
without the token and converge; 30 sleep rollouts (the labelled test task) submitted to the front all complete,
and the front spreads them over more than one daemon; more rollouts still running when
`scancel` arrives finish during the drain, among them `code` rollouts in bwrap sandboxes
(Slurm signals every process of the step, the sandboxes' bwrap and helper included: they
must survive it and keep working); every daemon exits 0 and no process is left.

Each daemon gets a scripted LLM backend (a labelled test double; sleep tasks never call it,
code rollouts follow its script): placement forwards only to peers that report a healthy
backend.

Needs a Slurm controller: `contrib/slurm/ci-setup.sh` starts one (.ci/run does). Skipped
when none answers, except under CI (CI=true), where a missing Slurm is a failure.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import sqlite3
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from rolloutd.federation import MEMBERS_PATH

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "contrib" / "slurm" / "rolloutd.sbatch"
ROLLOUTD = Path(sys.executable).with_name("rolloutd")
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def slurm_up() -> bool:
    if shutil.which("sbatch") is None or os.geteuid() != 0:
        return False
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not IN_CI and not slurm_up(), reason="no Slurm controller"),
]


def tool_call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


#: The code rollouts' script: run the task's run.sh in the sandbox, then finish. Each reply
#: takes 1 s, so a rollout submitted just before scancel has its sandbox open and uses it
#: after.
SCRIPT = [tool_call("bash", command="sh run.sh"), tool_call("finish", answer="done")]

CONFIG = f"""\
# rolloutd settings for the Slurm end-to-end test.
sandbox_backend = "bwrap"
n_init = 2
n_run = 2
n_eval = 2
gossip_interval_s = 0.5
health_interval_s = 1.0

[[backends]]
kind = "scripted"          # TEST DOUBLE: sleep tasks never call it; code tasks follow it
replies = [{", ".join(json.dumps(r) for r in SCRIPT)}]
latency_s = 1.0
"""

SLEEP = {"kind": "sleep", "run_s": 0.5}
#: A code task whose run.sh writes a correct solution: reward 1 when its sandbox worked.
CODE = {"kind": "code", "prompt": "Add two integers read from stdin.",
        "tests": [{"stdin": "1 2\n", "stdout": "3\n"}], "tools": ["bash", "finish"],
        "files": {"run.sh": "printf 'print(sum(map(int, input().split())))\\n' > solution.py"}}


def free_port_block(n: int) -> int:
    """A base port such that base..base+n-1 are free (the daemons bind 0.0.0.0)."""
    for _ in range(50):
        base = random.randrange(20000, 30000)
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port block")


async def sh(*argv: str) -> str:
    with trio.fail_after(30):
        done = await trio.run_process(list(argv), capture_stdout=True, stdin=subprocess.DEVNULL)
    return done.stdout.decode().strip()


def daemon_pids(ports: set[int]) -> list[int]:
    """Live `rolloutd serve --port P` processes for any P in ports."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "serve" in argv and "--port" in argv and any(a.endswith("rolloutd") for a in argv[:2]):
            port = argv[argv.index("--port") + 1]
            if port.isdigit() and int(port) in ports:
                pids.append(int(entry))
    return pids


def sandbox_dirs(local_dir: Path, *, busy: bool = False) -> list[Path]:
    """The sandbox dirs of every daemon of the job (parked spare launchers' included), or
    only those whose workspace holds files (a code rollout's, once set up)."""
    found = []
    for path in local_dir.glob("rolloutd-*/sandboxes/sandboxes/*/*"):
        try:
            if not busy or any((path / "ws").iterdir()):
                found.append(path)
        except OSError:  # removed meanwhile
            pass
    return found


def journal_statuses(state_dir: Path) -> dict[str, tuple[str, float | None]]:
    """Job id -> (status, reward), from a stopped daemon's journal."""
    with sqlite3.connect(state_dir / "journal.sqlite3") as db:
        rows = db.execute("SELECT id, status, result FROM jobs").fetchall()
    return {i: (status, json.loads(result)["reward"] if result else None) for i, status, result in rows}


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory: a sandbox's socket path must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_real_daemons_under_slurm_converge_run_30_rollouts_and_drain(tmp_path: Path,
                                                                             short_dir: Path) -> None:
    assert slurm_up(), "CI must start Slurm first (bash contrib/slurm/ci-setup.sh)"
    assert ROLLOUTD.exists(), ROLLOUTD
    port = free_port_block(3)
    ports = {port, port + 1, port + 2}
    run_dir = tmp_path / "run"
    local_dir = short_dir
    config = tmp_path / "rolloutd.toml"
    config.write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTD_")}
    env.update(
        ROLLOUTD_BIN=str(ROLLOUTD),
        ROLLOUTD_CONFIG=str(config),
        ROLLOUTD_PORT=str(port),
        ROLLOUTD_RUN_DIR=str(run_dir),
        ROLLOUTD_LOCAL_DIR=str(local_dir),
        ROLLOUTD_DRAIN_TIMEOUT_S="15",
        ROLLOUTD_START_TIMEOUT_S="60",
    )
    out = tmp_path / "job.out"
    argv = ["sbatch", "--parsable", "-N1", "-n3", "--overcommit", "-t", "5", f"--output={out}", str(SBATCH)]
    with trio.fail_after(30):
        done = await trio.run_process(argv, capture_stdout=True, env=env, stdin=subprocess.DEVNULL)
    job = done.stdout.decode().strip().split(";")[0]
    draining_ids: list[str] = []
    code_ids: list[str] = []
    try:
        with trio.fail_after(60):
            while not (run_dir / "env").exists():
                await trio.sleep(0.2)
        front = (run_dir / "front_url").read_text().strip()
        assert f"export ROLLOUTD_URL={front}" in (run_dir / "env").read_text().splitlines()
        urls = (run_dir / "seeds").read_text().split()
        host = front.rsplit(":", 1)[0]
        assert urls == [f"{host}:{port + i}" for i in range(3)]
        token_file = run_dir / "token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) == 64
        auth = {"Authorization": f"Bearer {token}"}

        async with httpx.AsyncClient(timeout=10) as bare:
            # `env` appears once the front is ready; the other daemons may still be starting.
            for url in urls:
                with trio.fail_after(60):
                    while True:
                        try:
                            resp = await bare.get(url + MEMBERS_PATH)
                            break
                        except httpx.TransportError:
                            await trio.sleep(0.2)
                assert resp.status_code == 401
        async with httpx.AsyncClient(timeout=10, headers=auth) as http:
            # Converged: the front sees all three alive, each with a healthy backend.
            with trio.fail_after(30):
                while True:
                    members = (await http.get(front + MEMBERS_PATH)).json()["members"]
                    if len(members) == 3 and all(
                        m["state"] == "alive" and m["capacity"]["healthy_backends"] == 1 for m in members
                    ):
                        break
                    await trio.sleep(0.2)
            assert len(daemon_pids(ports)) == 3

            # 30 rollouts through the front: all complete, more than one daemon ran them.
            ids = []
            for _ in range(30):
                resp = await http.post(front + "/v1/rollouts", json={"task": SLEEP})
                assert resp.status_code == 202, resp.text
                ids += resp.json()["ids"]
            assert len(set(ids)) == 30
            with trio.fail_after(60):
                async with http.stream("GET", front + "/v1/rollouts/stream", params={"ids": ",".join(ids)}) as s:
                    trajs = [json.loads(line) async for line in s.aiter_lines() if line.strip()]
            assert sorted(t["id"] for t in trajs) == sorted(ids)
            assert {t["status"] for t in trajs} == {"completed"}
            finished = []
            for url in urls:
                st = (await http.get(url + "/v1/status")).json()
                finished.append(st["pipeline"]["stages"]["eval"]["finished"])
            assert sum(finished) == 30, finished
            assert sum(1 for f in finished if f > 0) >= 2, finished
            fed = (await http.get(front + "/v1/status")).json()["federation"]
            # what the front ran: what it kept, less what idle peers stole from it (work
            # stealing, on by default), plus what it stole from them
            ran_here = 30 - fed["forwarded_total"] - fed["handed_over"] + fed["taken_over"]
            assert ran_here == finished[0], (fed, finished)

            # Work that is running when scancel arrives: each daemon gets one 2 s rollout
            # and one code rollout, whose bwrap sandbox is open, waiting on the model.
            for url in urls:
                resp = await http.post(url + "/v1/rollouts", json={"task": {"kind": "sleep", "run_s": 2.0}})
                draining_ids += resp.json()["ids"]
                resp = await http.post(url + "/v1/rollouts", json={"task": CODE})
                assert resp.status_code == 202, resp.text
                code_ids += resp.json()["ids"]
            with trio.fail_after(20):
                while len(sandbox_dirs(local_dir, busy=True)) < 3:
                    await trio.sleep(0.05)

        await sh("scancel", job)
        with trio.fail_after(60):
            while await sh("squeue", "-h", "-j", job):
                await trio.sleep(0.2)
    finally:
        with trio.move_on_after(30, shield=True):
            await trio.run_process(["scancel", job], check=False, stdin=subprocess.DEVNULL)
    log = out.read_text()
    # Each daemon (a task, labelled by srun) drained and stopped on its own.
    for task in range(3):
        lines = [json.loads(s.split(": ", 1)[1]) for s in log.splitlines() if s.startswith(f"{task}: {{")]
        msgs = [rec["msg"] for rec in lines]
        assert any(m.startswith("draining: 2 jobs live") for m in msgs), (task, msgs)
        assert any(m.startswith("rolloutd ") and m.endswith(" stopped") for m in msgs), (task, msgs)
        assert not any(rec["level"] in {"error", "critical"} for rec in lines), (task, lines)
        assert not any("drain deadline" in m for m in msgs), (task, msgs)
    assert "exit code" not in log, log  # srun reports any task that exits non-zero
    assert "all steps ended (status 0)" in log, log
    assert not daemon_pids(ports)
    assert not (run_dir / "env").exists()
    # The rollouts running at scancel finished during the drain (from each daemon's journal);
    # the code rollouts' sandboxes worked after it (reward 1: run.sh wrote the solution).
    statuses: dict[str, tuple[str, float | None]] = {}
    for p in sorted(ports):
        statuses.update(journal_statuses(local_dir / f"rolloutd-{job}-{p}"))
    assert [statuses[i][0] for i in draining_ids] == ["completed"] * 3, statuses
    assert [statuses[i] for i in code_ids] == [("completed", 1.0)] * 3, statuses
    assert sandbox_dirs(local_dir) == []  # every daemon tore its sandboxes down
