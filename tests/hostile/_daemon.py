"""Real processes for the hostile daemon tests: a `rolloutd serve`, a scripted model-server,
and the observers every test ends with (sandbox processes, sandbox dirs, mounts, fds).

The policy is always the scripted backend, a labelled TEST DOUBLE: it replays the same
replies by turn number for every rollout, so tests steer a rollout through its *task* (the
files a ``code`` task writes into the workspace, e.g. ``run.sh``), not through the model.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from rolloutd.sandbox._backend import first_child
from rolloutd.sandbox._launcher import NAME as LAUNCHER
from rolloutd.sandbox._layout import SOCKET_NAME
from rolloutd.sandbox._limits import _own_cgroups
from tests.sandbox.conftest import marked_pids as sandbox_pids

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tool_call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


#: The script every test rollout follows: run the task's run.sh, then finish.
RUN_SCRIPT = [tool_call("bash", command="sh run.sh"), tool_call("finish", answer="done")]


def code_task(script: str, **extra: Any) -> dict[str, Any]:
    """A ``code`` task whose workspace holds ``run.sh`` = ``script`` (what the bash turn runs).

    The default script writes a correct solution, so an undisturbed rollout earns reward 1.
    """
    return {"kind": "code", "prompt": "Add two integers read from stdin.",
            "tests": [{"stdin": "1 2\n", "stdout": "3\n"}],
            "files": {"run.sh": script}, "tools": ["bash", "finish"], **extra}


GOOD = "printf 'print(sum(map(int, input().split())))\\n' > solution.py; echo wrote"


# ---- observers -----------------------------------------------------------------------

def sandbox_dirs(state_dir: Path, *, spares: bool = False) -> list[Path]:
    """Sandbox dirs (``<state>/sandboxes/sandboxes/<boot tag>/<id>``) of any boot; the
    dirs reserved by parked spare launchers only with ``spares``."""
    root = state_dir / "sandboxes" / "sandboxes"
    found = sorted(p for p in root.glob("*/*")) if root.exists() else []
    return found if spares else [p for p in found if not is_spare(p)]


def is_spare(sandbox_dir: Path) -> bool:
    """Whether a sandbox dir belongs to a live parked launcher, or a parked image sandbox
    whose helper waits for its ``go`` (its argv ends in ``wait``): not yet a sandbox."""
    try:
        pid = int((sandbox_dir / "pid").read_text().split()[0])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f"\0{LAUNCHER}\0".encode() in f.read():
                return True
        helper = first_child(pid)
        if helper is None:
            return False
        with open(f"/proc/{helper}/cmdline", "rb") as f:
            return f.read().endswith(b"\0wait\0") \
                and not (sandbox_dir / "c" / SOCKET_NAME).exists()
    except (OSError, ValueError, IndexError):
        return False


def mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(path))]


def cgroup_dirs(tag: str, *, ignore: Collection[str] = ()) -> list[Path]:
    """Sandbox cgroups of boot ``tag`` left in any hierarchy (v1 or v2) below our cgroup,
    but those of the sandbox ids in ``ignore``."""
    own = _own_cgroups()
    found = []
    fs = Path("/sys/fs/cgroup")
    candidates = [fs / own.get("", "/").lstrip("/")]
    if fs.is_dir():
        for hier in fs.iterdir():
            names = hier.name.split(",")
            path = next((own[n] for n in names if n in own), None)
            if path is not None:
                candidates.append(hier / path.lstrip("/"))
    for base in candidates:
        d = base / "rolloutd" / tag
        if d.is_dir():
            found += [c for c in d.iterdir() if c.is_dir() and c.name not in ignore]
    return found


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def boot_tag(boot_id: str) -> str:
    from rolloutd.sandbox._layout import boot_tag as tag

    return tag(boot_id)


# ---- processes -----------------------------------------------------------------------

class Daemon:
    """A `rolloutd serve` child process (bwrap sandboxes unless told otherwise).

    Blocking methods (``*_sync``) so a module-scoped fixture can share one daemon; the
    async ones run them in a thread.
    """

    def __init__(self, state_dir: Path, *, port: int | None = None, token: str | None = None,
                 **settings: Any) -> None:
        self.state_dir = state_dir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        self.log_path = state_dir.parent / f"daemon-{self.port}.log"
        self.settings = {"sandbox_backend": "bwrap", "log_level": "info", "n_init": 4, "n_run": 4,
                         "n_eval": 4, **settings}
        self.proc: subprocess.Popen[bytes] | None = None
        self.boot_id = ""

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def tag(self) -> str:
        return boot_tag(self.boot_id)

    def client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers,
                                 timeout=kw.pop("timeout", 60.0), **kw)

    def start_sync(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTD_")}
        env["ROLLOUTD_STATE_DIR"] = str(self.state_dir)
        env["ROLLOUTD_CACHE_DIR"] = str(self.state_dir.parent / "cache")
        if self.token:
            env["ROLLOUTD_TOKEN"] = self.token
        for key, value in self.settings.items():
            env[f"ROLLOUTD_{key.upper()}"] = json.dumps(value) if isinstance(value, list | dict) else str(value)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rolloutd.daemon.cli", "serve", "--port", str(self.port)],
                env=env, cwd=str(REPO), stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 90
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=2) as h:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"rolloutd serve exited with {self.proc.returncode}: "
                                       f"{self.log_text()[-3000:]}")
                try:
                    if h.get("/readyz").status_code == 200:
                        self.boot_id = h.get("/v1/status").json()["boot_id"]
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        self.kill_sync()
        raise RuntimeError("rolloutd serve did not become ready")

    def stop_sync(self, timeout_s: float = 40.0) -> int:
        """SIGTERM (the drain), then wait; SIGKILL if it hangs."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def kill_sync(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    async def start(self) -> None:
        await trio.to_thread.run_sync(self.start_sync)

    async def stop(self) -> int:
        return await trio.to_thread.run_sync(self.stop_sync)

    async def kill(self) -> None:
        await trio.to_thread.run_sync(self.kill_sync)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


@asynccontextmanager
async def running(daemon: Daemon) -> AsyncIterator[Daemon]:
    await daemon.start()
    try:
        yield daemon
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            await daemon.stop()


class ModelServer:
    """`rolloutd model-server --backend scripted` (a TEST DOUBLE) in its own process."""

    def __init__(self, replies: Sequence[str], *, latency_s: float = 0.0, port: int | None = None) -> None:
        self.replies = list(replies)
        self.latency_s = latency_s
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start_sync(self) -> None:
        argv = [sys.executable, "-m", "rolloutd.daemon.llm.model_server", "--backend", "scripted",
                "--port", str(self.port), "--latency-s", str(self.latency_s)]
        for reply in self.replies:
            argv += ["--reply", reply]
        self.proc = subprocess.Popen(argv, cwd=str(REPO), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 90
        with httpx.Client(timeout=2) as h:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"model-server exited with {self.proc.returncode}")
                try:
                    if h.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        self.kill_sync()
        raise RuntimeError("model-server did not become healthy")

    def kill_sync(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    async def start(self) -> None:
        await trio.to_thread.run_sync(self.start_sync)

    async def kill(self) -> None:
        await trio.to_thread.run_sync(self.kill_sync)


def short_dir(prefix: str = "rlh") -> Path:
    """A short temp dir: sandbox socket paths must fit in 107 bytes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


async def assert_clean(daemon: Daemon, *, tag: str | None = None) -> None:
    """No sandbox process, sandbox dir or mount of this daemon is left (after a grace)."""
    tag = tag or daemon.tag

    def spares() -> set[str]:  # a running daemon's parked launchers are not leaks
        return {p.name for p in sandbox_dirs(daemon.state_dir, spares=True) if is_spare(p)}

    with trio.move_on_after(10):
        while (sandbox_pids(tag) or sandbox_dirs(daemon.state_dir) or mounts_under(daemon.state_dir)
               or cgroup_dirs(tag, ignore=spares())):
            await trio.sleep(0.1)
    assert sandbox_pids(tag) == [], "sandbox processes leaked"
    assert cgroup_dirs(tag, ignore=spares()) == [], "sandbox cgroups leaked"
    assert sandbox_dirs(daemon.state_dir) == [], "sandbox dirs leaked"
    assert mounts_under(daemon.state_dir) == [], "mounts leaked"
