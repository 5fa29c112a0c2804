"""Real `rolloutd serve` processes, each in its own network namespace on a bridge (for chaos tests).

    Netns      a bridge in the root namespace holding the test's address (.254), and one namespace
               per daemon with a veth pair to the bridge (address .<i+1>). ``cut(i)`` takes the
               host end of daemon i's veth down (its packets are dropped both ways: a partition,
               not a crash); ``restore(i)`` brings it back.
    Daemon     one daemon: its argv, environment and state dir; every incarnation (start,
               restart) writes its stdout and stderr to its own log file.

Daemons enter their namespace with ``nsenter --net`` (not ``ip netns exec``, which also
remounts /sys in a new mount namespace, hiding the cgroup mounts the sandboxes' limits use),
so each pid we hold is the daemon itself. Needs root, ``ip`` and ``nsenter``.

Names carry a random tag, so parallel runs on one host do not collide; ``teardown`` removes
everything ``setup`` made, and is safe to call twice or after a partial setup.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLLOUTD = Path(sys.executable).with_name("rolloutd")


def netns_unavailable() -> str | None:
    """Why daemons cannot get their own network namespaces here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and a bridge)"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


class Netns:
    """A bridge and ``n`` network namespaces, one per daemon (see the module docstring)."""

    def __init__(self, n: int, *, prefix: str = "rdc") -> None:
        self.n = n
        self.tag = secrets.token_hex(2)
        self.bridge = f"{prefix}{self.tag}"  # interface names: at most 15 characters
        self.host_ends = [f"{prefix}{self.tag}h{i}" for i in range(n)]
        self.namespaces = [f"rolloutd-{prefix}-{self.tag}-{i}" for i in range(n)]
        self.subnet = self._free_subnet()
        self.host_addr = f"{self.subnet}.254"
        self.made = False

    @staticmethod
    def _free_subnet() -> str:
        used = _ip("-4", "addr").stdout + _ip("-4", "route").stdout
        for _ in range(100):
            subnet = f"10.{random.randrange(200, 250)}.{random.randrange(0, 256)}"
            if f"{subnet}." not in used:
                return subnet
        raise RuntimeError("no free 10.x.y.0/24 subnet for the test bridge")

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def wrap(self, i: int, argv: list[str]) -> list[str]:
        """argv run inside daemon i's namespace (nsenter execs it: the pid is the command's)."""
        return ["nsenter", f"--net=/run/netns/{self.namespaces[i]}", "--", *argv]

    def setup(self) -> None:
        self.made = True
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, (ns, host_end) in enumerate(zip(self.namespaces, self.host_ends, strict=True)):
                _ip("netns", "add", ns)
                _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", host_end, "master", self.bridge)
                _ip("link", "set", host_end, "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.teardown()
            raise

    def cut(self, i: int) -> None:
        """Partition daemon i: its veth's host end goes down (the process keeps running)."""
        _ip("link", "set", self.host_ends[i], "down")

    def restore(self, i: int) -> None:
        _ip("link", "set", self.host_ends[i], "up")

    def teardown(self) -> list[str]:
        """Remove the namespaces (their veth pairs go with them) and the bridge; returns what
        is still there afterwards (empty when all is gone)."""
        if not self.made:
            return []
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)
        for host_end in self.host_ends:
            _ip("link", "del", host_end, check=False)
        _ip("link", "del", self.bridge, check=False)
        left = [ns for ns in self.namespaces if ns in _ip("netns", "list", check=False).stdout.split()]
        links = _ip("-o", "link", check=False).stdout
        left += [name for name in (self.bridge, *self.host_ends) if re.search(rf"\b{name}[@:]", links)]
        return left


@dataclass
class Daemon:
    """One `rolloutd serve`, started (and restarted) by the test; see the module docstring."""

    name: str
    node_id: str
    url: str
    argv: list[str]
    env: dict[str, str]
    state_dir: Path
    log_dir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.procs[-1]

    def start(self) -> None:
        """Start a new incarnation, logging to <log_dir>/<name>.<incarnation>.log."""
        path = self.log_dir / f"{self.name}.{len(self.procs)}.log"
        with path.open("wb") as out:
            proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=out,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        self.logs.append(path)

    def alive(self) -> bool:
        return bool(self.procs) and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the current incarnation and reap it."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        if self.procs:
            self.proc.wait(timeout=30)

    def log_tail(self, lines: int = 30) -> str:
        out = []
        for path in self.logs:
            try:
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"--- {path} (last {len(text)} lines)\n" + "\n".join(text))
        return "\n".join(out)

    def records(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(incarnation, record) for every JSON log line of every incarnation."""
        for incarnation, path in enumerate(self.logs):
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("{"):
                    try:
                        yield incarnation, json.loads(line)
                    except ValueError:
                        continue


def stop_all(daemons: list[Daemon], *, timeout_s: float) -> dict[str, int | None]:
    """SIGTERM every live daemon at once, wait up to ``timeout_s`` in all, SIGKILL the rest.
    Returns name -> exit code of the current incarnation (None: it had to be killed)."""
    for d in daemons:
        if d.alive():
            d.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    codes: dict[str, int | None] = {}
    for d in daemons:
        if not d.procs:
            continue
        try:
            codes[d.name] = d.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait(timeout=30)
            codes[d.name] = None
    return codes


def kill_all(daemons: list[Daemon]) -> None:
    """SIGKILL every incarnation still running (the last resort of a test's finally)."""
    for d in daemons:
        for proc in d.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def processes_mentioning(text: str) -> dict[int, str]:
    """pid -> cmdline of every live process whose command line contains ``text``."""
    found: dict[int, str] = {}
    needle = text.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if needle in raw:
            found[int(entry)] = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def kill_pids(pids: list[int]) -> None:
    """SIGKILL each pid (processes the test's daemons left behind), ignoring those gone."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def mounts_under(root: Path) -> list[str]:
    """Mount points (in the test's mount namespace) at or below ``root``."""
    prefix = str(root.resolve())
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                points.append(point)
    return points


def cgroups_named(names: set[str]) -> list[str]:
    """cgroup directories (v1 or v2) named like one of ``names`` (a sandbox's boot tag)."""
    found: list[str] = []
    if not names:
        return found
    for dirpath, dirnames, _ in os.walk("/sys/fs/cgroup"):
        for d in dirnames:
            if d in names:
                found.append(os.path.join(dirpath, d))
    return found
