"""contrib/slurm under a real Slurm: 3 daemons as 3 tasks of one job converge; scancel drains.

The daemon is tests/federation/fake_rolloutd.py (a labelled stand-in for `rolloutd serve`
that runs the real Federation); the end-to-end test with the real daemon is the lead's.
Skipped unless a Slurm controller answers (contrib/slurm/ci-setup.sh starts one).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from federation import MEMBERS_PATH

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "contrib" / "slurm" / "rolloutd.sbatch"
FAKE = Path(__file__).with_name("fake_rolloutd.py")


def slurm_up() -> bool:
    if shutil.which("sbatch") is None or os.geteuid() != 0:
        return False
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = [pytest.mark.slow, pytest.mark.skipif(not slurm_up(), reason="no Slurm controller")]


def free_port_block(n: int) -> int:
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


def daemons_alive(port: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(FAKE).encode() in cmd and any(
                c.decode(errors="replace") in {str(port), str(port + 1), str(port + 2)} for c in cmd
            ):
                pids.append(int(entry))
    return pids


async def sh(*argv: str) -> str:
    with trio.fail_after(30):
        done = await trio.run_process(list(argv), capture_stdout=True, stdin=subprocess.DEVNULL)
    return done.stdout.decode().strip()


async def test_three_daemons_in_one_job_converge_and_drain_on_scancel(tmp_path):
    port = free_port_block(3)
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "ROLLOUTD_BIN": f"{sys.executable} {FAKE}",
        "PYTHONPATH": str(REPO),
        "ROLLOUTD_PORT": str(port),
        "ROLLOUTD_RUN_DIR": str(run_dir),
        "ROLLOUTD_DRAIN_TIMEOUT_S": "5",
        "ROLLOUTD_LOCAL_DIR": str(tmp_path / "local"),
    }
    out = tmp_path / "job.out"
    with trio.fail_after(30):
        done = await trio.run_process(
            [
                "sbatch",
                "--parsable",
                "-N1",
                "-n3",
                "--overcommit",
                "-t",
                "5",
                f"--output={out}",
                str(SBATCH),
            ],
            capture_stdout=True,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    job = done.stdout.decode().strip().split(";")[0]
    try:
        with trio.fail_after(60):
            while not (run_dir / "env").exists():
                await trio.sleep(0.2)
        lines = (run_dir / "env").read_text().splitlines()
        url = lines[0].split("=", 1)[1]
        assert url.endswith(f":{port}")
        token_file = run_dir / "token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) == 64
        assert (run_dir / "seeds").read_text().split() == [
            url.rsplit(":", 1)[0] + f":{port + i}" for i in range(3)
        ]

        async with httpx.AsyncClient(timeout=5) as client:
            assert (await client.get(url + MEMBERS_PATH)).status_code == 401
            with trio.fail_after(30):
                while True:
                    resp = await client.get(
                        url + MEMBERS_PATH, headers={"Authorization": f"Bearer {token}"}
                    )
                    states = [m["state"] for m in resp.json()["members"]]
                    if states == ["alive"] * 3:
                        break
                    await trio.sleep(0.2)
        assert len(daemons_alive(port)) == 3

        await sh("scancel", job)
        with trio.fail_after(60):
            while await sh("squeue", "-h", "-j", job):
                await trio.sleep(0.2)
    finally:
        with trio.move_on_after(30, shield=True):
            await trio.run_process(["scancel", job], check=False, stdin=subprocess.DEVNULL)
    log = out.read_text()
    assert log.count("drained, exit 0") == 3, log
    assert not daemons_alive(port)
    assert not (run_dir / "env").exists()  # the trainer no longer sees a front
