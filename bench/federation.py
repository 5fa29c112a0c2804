"""Federation scaling on the real agent path, each daemon on its own CPU budget.

Every daemon is a separate `rolloutd serve` process with bwrap sandboxes. As root with
`ip netns`, each one runs in its own network namespace with its own address (10.231.0.<i+1>
on a veth pair to a bridge that holds the benchmark client's 10.231.0.254; entered with
`nsenter --net`, so the daemon still sees /sys/fs/cgroup), like one daemon per node;
otherwise all of them listen on loopback ports (`--net loopback` forces that). They federate
through their seeds. Every rollout is submitted to one daemon, the front, which runs it or
forwards it, and every result is streamed back through the front. The daemons run with
their default settings (gossip, placement; work stealing, on by default since 2026-11-29) but for the
slots, the backend and the sandboxes; ``--stealing on|off`` writes ``work_stealing`` (only
where the daemon has that setting), ``--gossip-udp on|off`` writes ``gossip_udp`` (gossip in
datagrams, on by default) and ``--gossip-interval-s`` sets the gossip interval.

Workload: each rollout is a ``code`` task on the real agent path. INIT starts a bwrap
sandbox. RUN is the agent loop: the LLM backend is the *scripted* backend, a TEST DOUBLE,
not a model; it answers every turn after a fixed latency (``--latency-s``, 0.4 s), and its
replies make the agent call the bash tool twice (write ``solution.py``, then run it on a
sample input) and then call ``finish``. Every reply is tokenized and rendered as with a
model. EVAL copies the solution into a fresh bwrap sandbox and runs it against the task's
three stdin/stdout tests. Every rollout must end ``completed`` with reward 1; one that does
not, or whose result has not arrived ``--burst-timeout-s`` after the burst began, is counted
and shown in red, and the numbers include it (it is never left out).

CPU budgets: each daemon runs in its own cgroup (v1: the cpu and cpuacct hierarchies,
``cpu.cfs_quota_us``; v2: ``cpu.max``), ``rolloutd-bench/d<i>`` below the benchmark's own.
Its sandboxes and tool processes are its children, so their CPU counts against its budget.
Daemons start without a limit (Python start-up under 0.2 core is slow) and warm up (one
rollout per RUN slot); the quota goes on for the measured burst only. The budget is
``--budget`` cores per daemon (0.2: 8 daemons take 1.6 of the 2 cores; the rest is left to
the benchmark client and the kernel). Per-daemon CPU is the cgroup's usage over the burst
(``cpuacct.usage`` or ``cpu.stat``), sandboxes and tools included. Before each burst every
daemon sits idle under its budget for 3 s: what membership alone (gossip, health checks)
costs it, with the gossip exchanges it started and answered meanwhile. Each burst also records the CPU the rest of the machine used meanwhile ("other
load": this VM is shared) and the hypervisor's steal.

1. Saturation: ONE daemon with one budget, for each RUN slot count in ``--sweep`` (n_init
   and n_eval = ceil(n_run / 2)), on a burst of ``--per-daemon`` rollouts. These daemons
   start together (a daemon's start-up costs ~18 CPU-seconds) and are measured one after
   another. The chosen slot count is the smallest whose throughput is within ``--knee``
   (5%) of the sweep's best: where throughput stops rising.
2. Scaling: N = 1, 2, 4, 8 daemons (``--sizes``), each with one budget and the chosen
   slots. The sweep's daemon with the chosen slots is the federation of one; each larger
   size is a federation of its own, started after the sweep (its daemons seeded with each
   other). N = 1 is measured in bursts of its own on that daemon, not by its sweep run: that
   run won the choice, and the best of a few noisy runs overstates the rate every eff_N
   divides by (both are printed). The front of size N gets N x ``--per-daemon`` rollouts in
   one burst (16 concurrent submitters, streamed back in chunks of 64).
3. Control: ONE daemon with 8 budgets (8 x ``--budget`` cores) and 8 x the slots of each
   stage gets the same burst as N = 8.

Every federation and the control are up together (an idle daemon uses a few tenths of a
percent of a core, a federation's member 1-2% of its budget) and are measured in
``--repeats`` rounds (3): each round is one burst of each, sizes growing then the control,
and the next round goes in the reverse order. Each burst has its own warm-up and idle spell.
The ratios are taken within a round, eff_N = rps_N / (N x rps_1) and vs_control_8 = rps_8 /
rps_control, and the RESULT line gives each one's median over the rounds. Until 2026-11-28
each size and then the control were measured in blocks of three bursts, minutes apart, and
each ratio divided the blocks' median bursts; the control measured 10.07 and 9.02 rollouts/s
in two runs 8 minutes apart with the same code (work stealing, on in one of them, does
nothing for a daemon alone), so a block's place in time weighed on the
ratios as much as anything measured. Both are printed. The tables show the median burst of
each (its latencies, work and CPU; every burst's rollouts/s is printed too).

``--load batch`` sends the same rollouts as ONE dynamic-sampling batch instead (``POST
/v1/batches`` on the front: ``N x --per-daemon / --group-size`` prompts of the same task,
groups of ``--group-size``, every group in flight at once and kept), and streams its groups
back; the front places each group (docs/federation.md, "Batches across a federation"). The
warm-ups stay single rollouts. Latency then runs from the batch's creation to its group's
arrival.

``--load direct`` takes the front out, to measure the ceiling that the budgets alone set: the
client submits the i-th rollout of a burst to daemon ``i mod N`` itself, marked as forwarded
(``X-Rolloutd-Forwarded``, so that daemon runs it: no placement, no forwarding, no relay),
and streams its result from that daemon. N daemons then run N independent equal shares,
what a perfect and free front would give them; their RESULT line is that ceiling, not the
federation's (docs/federation.md, "Runs of 2026-11-28, seventh session"). The warm-ups still
go through the front.

rollouts/s: rollouts / (first submit to last result), what a trainer waiting for its batch
sees. Latency: from the client's submit to the result's arrival in its stream (p50, p99).
Per-daemon work: the rollouts each daemon ran, from each trajectory's ``node_id`` (the
daemon that ran it), else (a result without it) from the daemons' GET /v1/status eval
counts; the table says which. tail_ratio_8 = busiest / mean of the 8 daemons' work. Each
burst's line also gives when each daemon's last result arrived and when the client sent its
last submit (seconds since the first): which daemon ended the burst, and how long the front
took to take the burst in.
Targets: eff_8 >= 0.9, vs_control_8 >= 0.95, tail_ratio_8 <= 1.15.

    sudo .venv/bin/python bench/federation.py      # about 10 minutes on this 2-core VM
    sudo .venv/bin/python bench/federation.py --sizes 1,2 --sweep 1,2 --per-daemon 6  # 3 min
    sudo .venv/bin/python bench/federation.py --keep-logs /tmp/fedlogs  # daemons log at info
    sudo .venv/bin/python bench/federation.py --load batch --sizes 1,8 --sweep '' --no-control

Needs root (cgroups; network namespaces). Removes its cgroups, namespaces and processes at
the end, also on Ctrl-C or SIGTERM (daemon logs are kept when a daemon did not exit 0).
Ends with: RESULT eff_2=F eff_4=F eff_8=F vs_control_8=F tail_ratio_8=F (nan: not measured)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import math
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio
from rich.console import Console
from rich.table import Table

from rolloutd.federation import FORWARDED_HEADER, FORWARDED_VALUE
from rolloutd.sandbox._limits import _own_cgroups  # this process's cgroup per controller

ROLLOUTD = Path(sys.executable).with_name("rolloutd")
SUBMITTERS = 16
STREAM_CHUNK = 64
NS_PREFIX = "rolloutd-bench-"
BRIDGE = "rdbench0"
SUBNET = "10.231.0"
CLIENT_ADDR = f"{SUBNET}.254"
PORT = 8400
CGROUP_FS = Path("/sys/fs/cgroup")
CGROUP_NAME = "rolloutd-bench"
#: The CFS period of the budgets' quotas (--cfs-period-us; the kernel's default, 100 ms).
CFS_PERIOD_US = 100_000

console = Console(width=220)


# ---- the workload -------------------------------------------------------------------------


def tool_call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


SOLUTION = "print(sum(map(int, input().split())))"
#: The scripted backend's replies (TEST DOUBLE), one per turn: write the solution with bash,
#: run it with bash, then finish.
REPLIES = [
    "I will write the program.\n" + tool_call("bash", command=f"printf '%s\\n' '{SOLUTION}' > solution.py && cat solution.py"),
    "Let me test it.\n" + tool_call("bash", command="echo '2 40' | python3 solution.py"),
    "It prints 42.\n" + tool_call("finish", answer="solution.py reads two integers and prints their sum."),
]
TASK: dict[str, Any] = {
    "kind": "code", "prompt": "Read two integers from one line of stdin and print their sum.",
    "tests": [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "-5 5\n", "stdout": "0\n"},
              {"stdin": "100 23\n", "stdout": "123\n"}],
    "tools": ["bash", "finish"],
}


def stage_slots(n_run: int, scale: int = 1) -> tuple[int, int, int]:
    """(n_init, n_run, n_eval) of a daemon with ``n_run`` RUN slots, times ``scale``."""
    side = max(1, math.ceil(n_run / 2))
    return side * scale, n_run * scale, side * scale


def daemon_config(slots: tuple[int, int, int], latency_s: float, stealing: bool | None,
                  gossip_interval_s: float | None, log_level: str = "warning",
                  gossip_udp: bool | None = None) -> str:
    """The daemons' TOML; settings not named here keep the daemon's defaults."""
    n_init, n_run, n_eval = slots
    lines = [
        "# rolloutd settings for bench/federation.py",
        'sandbox_backend = "bwrap"',
        f"n_init = {n_init}",
        f"n_run = {n_run}",
        f"n_eval = {n_eval}",
        "queue_size = 8192",
        f"log_level = {json.dumps(log_level)}",
    ]
    if gossip_interval_s is not None:
        lines.append(f"gossip_interval_s = {gossip_interval_s}")
    if stealing is not None:
        lines.append(f"work_stealing = {'true' if stealing else 'false'}")
    if gossip_udp is not None:
        lines.append(f"gossip_udp = {'true' if gossip_udp else 'false'}")
    lines += [
        "",
        "[[backends]]",
        'kind = "scripted"          # TEST DOUBLE: replays REPLIES, not a model',
        f"replies = [{', '.join(json.dumps(r) for r in REPLIES)}]",
        f"latency_s = {latency_s}",
        "",
    ]
    return "\n".join(lines)


def gossip_interval() -> float:
    """The daemons' gossip interval: --gossip-interval-s, else the daemon's default."""
    from rolloutd.federation import GossipSettings

    return GOSSIP_INTERVAL_S or GossipSettings().gossip_interval_s


#: --gossip-interval-s (None: the daemon's default)
GOSSIP_INTERVAL_S: float | None = None
IDLE_S = 3.0


STEALING_TEXT = {None: "the daemons' default", True: "on", False: "off"}


def stealing_setting_exists() -> bool:
    from rolloutd.daemon.config import Settings

    return "work_stealing" in Settings.model_fields


# ---- CPU budgets: one cgroup per daemon ----------------------------------------------------


def _write(path: Path, value: str) -> None:
    path.write_text(value)




class Budgets:
    """``<hierarchy>/<own cgroup>/rolloutd-bench/d<i>``: a CPU quota and CPU usage per daemon.

    cgroup v1: the cpu hierarchy (cfs quota) and the cpuacct one (usage), the same dir when
    they are mounted together. cgroup v2: one dir (cpu.max, cpu.stat).
    """

    def __init__(self) -> None:
        own = _own_cgroups()
        self.version = 0
        self.roots: list[Path] = []  # every rolloutd-bench dir (one per hierarchy)
        self.cpu_root = self.acct_root = Path()
        if (CGROUP_FS / "cgroup.controllers").exists():  # unified: v2 only
            base = CGROUP_FS / own.get("", "/").lstrip("/")
            if "cpu" not in (base / "cgroup.controllers").read_text().split():
                raise SystemExit(f"cgroup v2: the cpu controller is not available in {base}")
            self.version = 2
            self.cpu_root = self.acct_root = base / CGROUP_NAME
            self.roots = [self.cpu_root]
            return
        hiers = [h for h in CGROUP_FS.iterdir() if h.is_dir()] if CGROUP_FS.is_dir() else []
        cpu = next((h for h in hiers if "cpu" in h.name.split(",")), None)
        acct = next((h for h in hiers if "cpuacct" in h.name.split(",")), None)
        if cpu is None or acct is None or not (cpu / "cpu.cfs_quota_us").exists():
            raise SystemExit("no cgroup v1 cpu and cpuacct hierarchies nor a cgroup v2 cpu "
                             "controller under /sys/fs/cgroup: this benchmark needs CPU quotas")
        self.version = 1
        self.cpu_root = cpu / own.get("cpu", "/").lstrip("/") / CGROUP_NAME
        self.acct_root = acct / own.get("cpuacct", "/").lstrip("/") / CGROUP_NAME
        self.roots = list(dict.fromkeys([self.cpu_root, self.acct_root]))

    def describe(self) -> str:
        if self.version == 2:
            return f"cgroup v2, cpu.max in {self.cpu_root}/d<i>"
        return f"cgroup v1, cpu.cfs_quota_us in {self.cpu_root}/d<i>, cpuacct.usage in {self.acct_root}/d<i>"

    def dirs(self, i: int) -> list[Path]:
        return [root / f"d{i}" for root in self.roots]

    def make(self, n: int) -> None:
        """Fresh cgroups d0..d<n-1>, without a limit."""
        self.cleanup()
        try:
            for root in self.roots:
                root.mkdir(exist_ok=True)
            if self.version == 2:
                _write(self.cpu_root.parent / "cgroup.subtree_control", "+cpu")
                _write(self.cpu_root / "cgroup.subtree_control", "+cpu")
            for i in range(n):
                for d in self.dirs(i):
                    d.mkdir()
        except OSError as exc:
            raise SystemExit(f"cannot create the benchmark's cgroups ({exc}); run it as root") from None
        for i in range(n):
            self.set_cores(i, None)

    def enter_argv(self, i: int) -> list[str]:
        """argv prefix: move the process into daemon i's cgroups, then exec the rest."""
        script = " && ".join(f"echo $$ > {d / 'cgroup.procs'}" for d in self.dirs(i))
        return ["/bin/sh", "-c", script + ' && exec "$@"', "sh"]

    def set_cores(self, i: int, cores: float | None) -> None:
        d = self.cpu_root / f"d{i}"
        if self.version == 2:
            quota = "max" if cores is None else str(int(cores * CFS_PERIOD_US))
            _write(d / "cpu.max", f"{quota} {CFS_PERIOD_US}")
            return
        _write(d / "cpu.cfs_period_us", str(CFS_PERIOD_US))
        _write(d / "cpu.cfs_quota_us", "-1" if cores is None else str(int(cores * CFS_PERIOD_US)))

    def usage_s(self, i: int) -> float:
        """CPU seconds used by daemon i's cgroup (its sandboxes and tools included)."""
        if self.version == 2:
            return _stat(self.cpu_root / f"d{i}" / "cpu.stat").get("usage_usec", 0) / 1e6
        return int((self.acct_root / f"d{i}" / "cpuacct.usage").read_text()) / 1e9

    def total_usage_s(self) -> float:
        """CPU seconds used by every daemon of the benchmark (all cgroups below the root)."""
        if self.version == 2:
            return _stat(self.cpu_root / "cpu.stat").get("usage_usec", 0) / 1e6
        return int((self.acct_root / "cpuacct.usage").read_text()) / 1e9

    def throttled_s(self, i: int) -> float:
        """Time daemon i's cgroup spent throttled (its quota used up), summed over CPUs."""
        st = _stat(self.cpu_root / f"d{i}" / "cpu.stat")
        return st.get("throttled_usec", 0) / 1e6 if self.version == 2 else st.get("throttled_time", 0) / 1e9

    def cleanup(self) -> None:
        """SIGKILL whatever is left in our cgroups (only our own children can be there), then
        remove them, deepest first (the daemons make sandbox cgroups below theirs)."""
        for root in self.roots:
            kill_cgroup_tree(root)
            remove_cgroup_tree(root, keep_root=True)

    def remove(self) -> None:
        for root in self.roots:
            kill_cgroup_tree(root)
            remove_cgroup_tree(root, keep_root=False)


def machine_cpu_s() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, all CPUs (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    steal = v[7] if len(v) > 7 else 0
    return (sum(v[:8]) - v[3] - v[4] - steal) / tick, steal / tick


def client_cpu_s() -> float:
    """CPU seconds of this process (the benchmark client)."""
    t = os.times()
    return t.user + t.system


def _stat(path: Path) -> dict[str, int]:
    try:
        return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}
    except (OSError, ValueError):
        return {}


def _tree(root: Path) -> list[Path]:
    """root and every cgroup below it, deepest first."""
    if not root.is_dir():
        return []
    found = [Path(dirpath) for dirpath, _, _ in os.walk(root)]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def kill_cgroup_tree(root: Path) -> None:
    for _ in range(100):
        pids: set[int] = set()
        for d in _tree(root):
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(x) for x in (d / "cgroup.procs").read_text().split())
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    console.print(f"[red]processes are left in {root}")


def remove_cgroup_tree(root: Path, *, keep_root: bool) -> None:
    for d in _tree(root):
        if keep_root and d == root:
            continue
        for _ in range(50):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    console.print(f"[red]cannot remove cgroup {d}: {exc}")
                    break
                time.sleep(0.05)


def remove_sandbox_cgroups(tags: list[str]) -> None:
    """The daemons' sandbox cgroups (``<own>/rolloutd/<boot tag>``) in the other hierarchies,
    if a daemon left any (only after a kill: a drained daemon removes them)."""
    own = _own_cgroups()
    bases: list[Path] = []
    if (CGROUP_FS / "cgroup.controllers").exists():
        bases.append(CGROUP_FS / own.get("", "/").lstrip("/"))
    else:
        for hier in CGROUP_FS.iterdir() if CGROUP_FS.is_dir() else []:
            path = next((own[n] for n in hier.name.split(",") if n in own), None)
            if path is not None:
                bases.append(hier / path.lstrip("/"))
    for base in bases:
        for tag in tags:
            d = base / "rolloutd" / tag
            if d.is_dir():
                kill_cgroup_tree(d)
                remove_cgroup_tree(d, keep_root=False)


# ---- network: namespaces on a bridge, or loopback ------------------------------------------


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True)


class Network:
    """Addresses for daemon i; with namespaces, the commands that enter them."""

    def __init__(self, mode: str, n: int) -> None:
        self.mode = mode
        self.n = n
        self.ports = [PORT] * n if mode == "netns" else _free_ports(n)

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}" if self.mode == "netns" else "127.0.0.1"

    def url(self, i: int) -> str:
        return f"http://{self.addr(i)}:{self.ports[i]}"

    def wrap(self, i: int, argv: list[str]) -> list[str]:
        if self.mode != "netns":
            return argv
        # nsenter switches only the network namespace; `ip netns exec` would also remount
        # /sys, hiding /sys/fs/cgroup (the daemon's sandbox cgroups) from the daemon.
        return ["nsenter", f"--net=/var/run/netns/{NS_PREFIX}{i}", "--", *argv]

    def setup(self) -> None:
        if self.mode != "netns":
            return
        self.teardown()
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{CLIENT_ADDR}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for i in range(self.n):
            ns, host_end = f"{NS_PREFIX}{i}", f"rdb{i}h"
            _ip("netns", "add", ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", host_end, "master", BRIDGE)
            _ip("link", "set", host_end, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def teardown(self) -> None:
        if self.mode != "netns":
            return
        for i in range(self.n):
            _ip("netns", "del", f"{NS_PREFIX}{i}", check=False)  # takes its veth pair along
        _ip("link", "del", BRIDGE, check=False)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


def choose_network(requested: str, n: int) -> Network:
    if requested in ("auto", "netns") and os.geteuid() == 0 and shutil.which("ip") and shutil.which("nsenter"):
        net = Network("netns", n)
        try:
            net.setup()
            return net
        except subprocess.CalledProcessError as exc:
            net.teardown()
            if requested == "netns":
                raise
            console.print(f"[yellow]network namespaces unavailable ({exc.stderr.decode().strip()}); "
                          "using loopback ports")
    elif requested == "netns":
        raise SystemExit("--net netns needs root and the ip and nsenter commands")
    return Network("loopback", n)


# ---- daemons ----------------------------------------------------------------------------------

#: Every daemon process this benchmark started and has not reaped (for the final cleanup).
LIVE: list[subprocess.Popen[bytes]] = []


class Fleet:
    """Every daemon of the benchmark: daemon i has namespace i, cgroup d<i>, name bench<i>.

    Daemons join a federation through their seeds (the federation's members) and stay until
    stopped, so a federation grows by starting daemons seeded with it.
    """

    def __init__(self, net: Network, budgets: Budgets, keep_logs: Path | None = None) -> None:
        self.net = net
        self.budgets = budgets
        self.keep_logs = keep_logs  # where every daemon's log is copied when they stop
        self.workdir = Path(tempfile.mkdtemp(prefix="rdf", dir="/tmp"))  # short: sandbox sockets
        self.token = secrets.token_hex(32)
        self.token_file = self.workdir / "token"
        self.token_file.write_text(self.token)
        self.token_file.chmod(0o600)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.codes: dict[int, int | None] = {}
        self.tags: dict[int, str] = {}
        self.next_index = 0

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def start(self, config: str, seeds: list[int], count: int) -> list[int]:
        """Start ``count`` daemons with ``config``, seeded with daemons ``seeds`` and each other."""
        indices = list(range(self.next_index, self.next_index + count))
        self.next_index += count
        config_path = self.workdir / f"rolloutd{indices[0]}.toml"
        config_path.write_text(config)
        base = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTD_")}
        seed_urls = ",".join(self.net.url(i) for i in [*seeds, *indices])
        for i in indices:
            env = dict(
                base,
                ROLLOUTD_NODE_ID=f"bench{i}",
                ROLLOUTD_URL=self.net.url(i),
                ROLLOUTD_SEEDS=seed_urls,
                ROLLOUTD_TOKEN_FILE=str(self.token_file),
                ROLLOUTD_STATE_DIR=str(self.workdir / f"s{i}"),
                ROLLOUTD_CACHE_DIR=str(self.workdir / "cache"),
                ROLLOUTD_DRAIN_TIMEOUT_S="10",
            )
            argv = [str(ROLLOUTD), "serve", "--config", str(config_path), "--host", self.net.addr(i),
                    "--port", str(self.net.ports[i])]
            with (self.workdir / f"daemon{i}.log").open("wb") as log:
                proc = subprocess.Popen(self.budgets.enter_argv(i) + self.net.wrap(i, argv), env=env,
                                        stdout=log, stderr=log, stdin=subprocess.DEVNULL)
            self.procs[i] = proc
            LIVE.append(proc)
        return indices

    def stop(self, indices: list[int]) -> None:
        procs = [self.procs.pop(i) for i in indices if i in self.procs]
        for i, code in zip(indices, stop_daemons(procs), strict=True):
            self.codes[i] = code
        remove_sandbox_cgroups([self.tags[i] for i in indices if i in self.tags])

    def stop_all(self) -> bool:
        """Stop every daemon; True when all of them ever started exited 0."""
        self.stop(sorted(self.procs))
        if self.keep_logs is not None:
            self.keep_logs.mkdir(parents=True, exist_ok=True)
            for log in sorted(self.workdir.glob("daemon*.log")):
                shutil.copy2(log, self.keep_logs / log.name)
            console.print(f"daemon logs copied to {self.keep_logs}")
        ok = all(c == 0 for c in self.codes.values())
        if ok:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            bad = {f"bench{i}": c for i, c in self.codes.items() if c != 0}
            console.print(f"[red]daemons that did not exit 0 after SIGTERM: {bad}; logs kept in {self.workdir}")
        return ok

    def log_tail(self, i: int) -> str:
        return (self.workdir / f"daemon{i}.log").read_text(errors="replace")[-2000:]


@dataclasses.dataclass
class Cluster:
    """The daemons ``indices`` of ``fleet`` as one federation; the first is the front."""

    fleet: Fleet
    indices: list[int]

    @property
    def n(self) -> int:
        return len(self.indices)

    @property
    def urls(self) -> list[str]:
        return [self.fleet.net.url(i) for i in self.indices]

    @property
    def names(self) -> list[str]:
        return [f"bench{i}" for i in self.indices]

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        return [self.fleet.procs[i] for i in self.indices]


def stop_daemons(procs: list[subprocess.Popen[bytes]]) -> list[int | None]:
    """SIGTERM (the daemons drain; nothing is running), then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes: list[int | None] = []
    for i, p in enumerate(procs):
        try:
            codes.append(p.wait(timeout=30))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
            console.print(f"[red]daemon {i} did not stop; killed")
        with contextlib.suppress(ValueError):
            LIVE.remove(p)
    return codes


class Cleanup:
    """Kills every daemon still running, removes the cgroups and the namespaces; idempotent."""

    budgets: Budgets | None = None
    net: Network | None = None

    def __call__(self) -> None:
        for p in list(LIVE):
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
            LIVE.remove(p)
        if self.budgets is not None:
            self.budgets.remove()
            self.budgets = None
        if self.net is not None:
            self.net.teardown()
            self.net = None


CLEANUP = Cleanup()


async def wait_converged(cluster: Cluster, http: httpx.AsyncClient, timeout_s: float) -> float:
    """Until the front sees every daemon of the cluster alive with a healthy backend, and
    nothing else alive; returns the seconds it waited."""
    fleet = cluster.fleet
    wanted = set(cluster.names)
    start = time.perf_counter()
    with trio.fail_after(timeout_s):
        while True:
            for i, p in zip(cluster.indices, cluster.procs, strict=True):
                if p.poll() is not None:
                    raise RuntimeError(f"daemon {i} exited with {p.returncode} during start:\n"
                                       f"{fleet.log_tail(i)}")
            try:
                resp = await http.get(cluster.urls[0] + "/v1/federation/members")
                members = resp.json()["members"] if resp.status_code == 200 else []
            except httpx.HTTPError:
                members = []
            alive = {m["node_id"] for m in members if m["state"] == "alive"
                     and m["capacity"]["healthy_backends"] > 0}
            if alive == wanted:
                break
            await trio.sleep(0.2)
    for i, url in zip(cluster.indices, cluster.urls, strict=True):
        if i not in fleet.tags:
            st = (await http.get(url + "/v1/status")).json()
            fleet.tags[i] = boot_tag(st["boot_id"])
    ready = time.perf_counter() - start
    await trio.sleep(2 * gossip_interval())  # fresh capacity reports everywhere
    return ready


def boot_tag(boot_id: str) -> str:
    from rolloutd.sandbox._layout import boot_tag as tag

    return tag(boot_id)


def proc_cpu_s(pid: int) -> float:
    """CPU seconds of the daemon process itself (not its sandboxes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def finished_counts(cluster: Cluster, http: httpx.AsyncClient) -> list[int]:
    out = []
    for url in cluster.urls:
        st = (await http.get(url + "/v1/status")).json()
        out.append(int(st["pipeline"]["stages"]["eval"]["finished"]))
    return out


async def gossip_counts(cluster: Cluster, http: httpx.AsyncClient) -> list[int | None]:
    """Each daemon's gossip exchanges so far, those it started and those peers started with
    it (None: a daemon that does not report them, or one without federation)."""
    out: list[int | None] = []
    for url in cluster.urls:
        gossip = ((await http.get(url + "/v1/status")).json().get("federation") or {}).get("gossip")
        out.append(gossip["exchanges"] + gossip["answered"] if gossip else None)
    return out


FRONT_COUNTS = ("forwarded_total", "relay_probes", "relay_lookups", "batch_placed", "submit_requests")


async def front_counts(cluster: Cluster, http: httpx.AsyncClient) -> list[int]:
    """The front's forwarder counters (FRONT_COUNTS; 0 where a daemon lacks one)."""
    st = (await http.get(cluster.urls[0] + "/v1/status")).json()
    fed = st.get("federation") or {}
    return [int(fed.get(key, 0)) for key in FRONT_COUNTS]


# ---- load -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """One rollout as the client saw it."""

    submitted: float  # seconds since the first submit
    arrived: float
    status: str
    reward: float | None
    node: str | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.status == "completed" and self.reward == 1.0


async def submit_all(http: httpx.AsyncClient, urls: list[str], count: int, t0: float,
                     sent: dict[str, float], where: dict[str, str]) -> list[str]:
    """Submit ``count`` rollouts: to ``urls[0]`` (the front), or with more ``urls`` (``--load
    direct``) the i-th to ``urls[i % len(urls)]`` marked as forwarded, so that it runs there."""
    ids: list[str | None] = [None] * count
    todo = iter(range(count))
    direct = {FORWARDED_HEADER: FORWARDED_VALUE} if len(urls) > 1 else {}

    async def submitter() -> None:
        for i in todo:
            t = time.perf_counter() - t0
            url = urls[i % len(urls)]
            resp = await http.post(url + "/v1/rollouts", json={"task": TASK}, headers=direct)
            if resp.status_code != 202:
                raise RuntimeError(f"submit answered {resp.status_code}: {resp.text[:300]}")
            ids[i] = job_id = resp.json()["ids"][0]
            sent[job_id] = t
            where[job_id] = url

    async with trio.open_nursery() as nursery:
        for _ in range(SUBMITTERS):
            nursery.start_soon(submitter)
    return [i for i in ids if i is not None]


async def run_load(http: httpx.AsyncClient, urls: list[str], count: int, timeout_s: float) -> list[Outcome]:
    """Submit ``count`` rollouts in chunks (to the front ``urls[0]``, or spread over every one
    of ``urls``: see ``submit_all``); stream each chunk's results from where it was submitted
    as soon as the chunk is in. Returns the outcomes in order of arrival; a rollout whose
    result has not arrived after ``timeout_s`` is an outcome with status "no result"."""
    sent: dict[str, float] = {}
    where: dict[str, str] = {}
    seen: set[str] = set()
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()

    async def stream(chunk: list[str]) -> None:
        async with trio.open_nursery() as nursery:
            for url in urls:
                if part := [job_id for job_id in chunk if where[job_id] == url]:
                    nursery.start_soon(stream_from, url, part)

    async def stream_from(url: str, chunk: list[str]) -> None:
        params = {"ids": ",".join(chunk)}
        async with http.stream("GET", url + "/v1/rollouts/stream", params=params) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                arrived = time.perf_counter() - t0
                traj = json.loads(line)
                seen.add(traj["id"])
                err = traj.get("error") or {}
                outcomes.append(Outcome(
                    submitted=sent.get(traj["id"], 0.0), arrived=arrived, status=traj["status"],
                    reward=traj.get("reward"), node=traj.get("node_id"),
                    error=f"{err.get('stage')}/{err.get('type')}: {err.get('message', '')[:200]}" if err else None,
                ))

    with trio.move_on_after(timeout_s):
        async with trio.open_nursery() as nursery:
            for k in range(0, count, STREAM_CHUNK):
                ids = await submit_all(http, urls, min(STREAM_CHUNK, count - k), t0, sent, where)
                nursery.start_soon(stream, ids)
    now = time.perf_counter() - t0
    for job_id, t in sent.items():
        if job_id not in seen:
            outcomes.append(Outcome(submitted=t, arrived=now, status="no result", reward=None,
                                    node=None, error=f"{job_id}: no result within {timeout_s:g} s"))
    if len(sent) < count:
        console.print(f"[red]only {len(sent)} of {count} rollouts were submitted within {timeout_s:g} s")
    return sorted(outcomes, key=lambda o: o.arrived)


async def run_batch_load(http: httpx.AsyncClient, front: str, count: int, timeout_s: float,
                         group_size: int) -> list[Outcome]:
    """``--load batch``: one dynamic-sampling batch on the front, of ``count / group_size``
    prompts (the code task), every group in flight at once and every group kept (filter
    ``keep_all``); its kept groups streamed back as they are kept. A rollout's ``submitted``
    is the batch's creation, its ``arrived`` its group's line. A rollout of a group that
    never came (filtered: a sample not usable; or past ``timeout_s``) is an outcome with
    status "no result"."""
    groups = max(1, count // group_size)
    body = {"prompts": [TASK] * groups, "group_size": group_size, "keep": groups,
            "max_in_flight_groups": groups, "filter": {"rule": "keep_all"}}
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()
    resp = await http.post(front + "/v1/batches", json=body)
    if resp.status_code != 202:
        raise RuntimeError(f"the batch was answered {resp.status_code}: {resp.text[:300]}")
    batch_id = resp.json()["id"]
    with trio.move_on_after(timeout_s):
        async with http.stream("GET", f"{front}/v1/batches/{batch_id}/groups") as lines:
            lines.raise_for_status()
            async for line in lines.aiter_lines():
                if not line.strip():
                    continue
                arrived = time.perf_counter() - t0
                for traj in json.loads(line)["rollouts"]:
                    err = traj.get("error") or {}
                    outcomes.append(Outcome(
                        submitted=0.0, arrived=arrived, status=traj["status"],
                        reward=traj.get("reward"), node=traj.get("node_id"),
                        error=f"{err.get('stage')}/{err.get('type')}: {err.get('message', '')[:200]}"
                        if err else None))
    status = (await http.get(f"{front}/v1/batches/{batch_id}")).json()
    now = time.perf_counter() - t0
    why = (f"batch {batch_id} {status.get('state')} ({status.get('stop_reason')}), "
           f"filtered {status.get('filtered_reasons')}")
    for _ in range(groups * group_size - len(outcomes)):
        outcomes.append(Outcome(submitted=0.0, arrived=now, status="no result", reward=None,
                                node=None, error=f"not in a kept group: {why}"))
    return outcomes


@dataclasses.dataclass
class Result:
    label: str
    n: int
    slots: tuple[int, int, int]
    cores_each: float
    outcomes: list[Outcome]
    converge_s: float
    work: list[int]
    work_source: str
    forwarded: int
    sweeps: tuple[int, int]  # the front's relays' safety net: (status listings, trajectory lookups)
    forward_requests: int  # the requests that carried the forwarded submits (0: a front without outboxes)
    cpu_s: list[float]  # per daemon, cgroup (sandboxes included)
    proc_cpu_s: list[float]  # per daemon, the daemon process alone
    throttled_s: list[float]
    warmup_failures: int
    warm_s: float
    client_cpu_s: float  # the benchmark client, over the burst
    other_cpu_s: float  # everything else on the machine (not our daemons, not the client)
    steal_s: float  # taken by the hypervisor
    idle_share: list[float]  # per daemon: CPU used while idle, as a share of its budget
    idle_gossip: list[float]  # per daemon: gossip exchanges a second while idle (started + answered)
    last_s: list[float] = dataclasses.field(default_factory=list)  # per daemon: its last result's arrival
    indices: list[int] = dataclasses.field(default_factory=list)
    exit_codes: list[int | None] = dataclasses.field(default_factory=list)
    repeats: list[float] = dataclasses.field(default_factory=list)  # rollouts/s of each repeat
    other_failures: list[Outcome] = dataclasses.field(default_factory=list)  # of the other repeats

    @property
    def rollouts(self) -> int:
        return len(self.outcomes)

    @property
    def seconds(self) -> float:
        return max(o.arrived for o in self.outcomes) - min(o.submitted for o in self.outcomes)

    @property
    def rps(self) -> float:
        return self.rollouts / self.seconds

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def latency(self, q: float) -> float:
        lat = sorted(o.arrived - o.submitted for o in self.outcomes)
        return lat[min(len(lat) - 1, int(q * len(lat)))]

    @property
    def tail_ratio(self) -> float:
        return max(self.work) / statistics.mean(self.work) if self.work and sum(self.work) else float("nan")


@dataclasses.dataclass
class Run:
    """One measured burst: ``label``, on a cluster of one or more daemons."""

    label: str
    n: int
    slots: tuple[int, int, int]
    cores_each: float
    rollouts: int
    timeout_s: float = 600.0
    group_size: int | None = None  # --load batch: the batch's G (None: rollouts one by one)
    direct: bool = False  # --load direct: each rollout submitted to a daemon in turn, no front


async def measure(run: Run, cluster: Cluster, http: httpx.AsyncClient, converge_s: float) -> Result:
    """Warm up without a limit, put the budget on, run the burst, take the limit off."""
    budgets = cluster.fleet.budgets
    front = cluster.urls[0]
    # Warm-up: connections between the front and each peer, spare sandbox launchers, code paths.
    t_warm = time.perf_counter()
    warm = await run_load(http, [front], cluster.n * run.slots[1], timeout_s=120)
    warm_s = time.perf_counter() - t_warm
    idx = cluster.indices
    for i in idx:
        budgets.set_cores(i, run.cores_each)
    await trio.sleep(2 * gossip_interval())
    # Idle, under the budget: what membership (gossip, health checks) costs each daemon.
    gossip0 = await gossip_counts(cluster, http)
    idle0 = [budgets.usage_s(i) for i in idx]
    await trio.sleep(IDLE_S)
    idle = [(budgets.usage_s(i) - a) / (IDLE_S * run.cores_each) for i, a in zip(idx, idle0, strict=True)]
    gossip1 = await gossip_counts(cluster, http)
    gossip_rate = [(b - a) / IDLE_S if a is not None and b is not None else float("nan")
                   for a, b in zip(gossip0, gossip1, strict=True)]
    before = await finished_counts(cluster, http)
    fwd0 = await front_counts(cluster, http)
    cpu0 = [budgets.usage_s(i) for i in idx]
    pcpu0 = [proc_cpu_s(p.pid) for p in cluster.procs]
    thr0 = [budgets.throttled_s(i) for i in idx]
    machine0, ours0, client0 = machine_cpu_s(), budgets.total_usage_s(), client_cpu_s()

    if run.group_size is None:
        outcomes = await run_load(http, cluster.urls if run.direct else [front], run.rollouts,
                                  run.timeout_s)
    else:
        outcomes = await run_batch_load(http, front, run.rollouts, run.timeout_s, run.group_size)

    machine1, ours1, client1 = machine_cpu_s(), budgets.total_usage_s(), client_cpu_s()
    cpu1 = [budgets.usage_s(i) for i in idx]
    pcpu1 = [proc_cpu_s(p.pid) for p in cluster.procs]
    thr1 = [budgets.throttled_s(i) for i in idx]
    for i in idx:  # a quick drain
        budgets.set_cores(i, None)
    after = await finished_counts(cluster, http)
    fwd1 = await front_counts(cluster, http)
    if all(o.node is not None for o in outcomes):
        work = [sum(1 for o in outcomes if o.node == name) for name in cluster.names]
        source = "trajectory node_id"
    else:
        work = [a - b for a, b in zip(after, before, strict=True)]
        source = "GET /v1/status eval counts (a result carried no node_id)"
    return Result(
        label=run.label, n=cluster.n, slots=run.slots, cores_each=run.cores_each,
        outcomes=outcomes, converge_s=converge_s, work=work, work_source=source,
        forwarded=fwd1[0] - fwd0[0] + fwd1[3] - fwd0[3],  # submits forwarded, batch samples placed
        sweeps=(fwd1[1] - fwd0[1], fwd1[2] - fwd0[2]),
        forward_requests=fwd1[4] - fwd0[4],
        cpu_s=[b - a for a, b in zip(cpu0, cpu1, strict=True)],
        proc_cpu_s=[b - a for a, b in zip(pcpu0, pcpu1, strict=True)],
        throttled_s=[b - a for a, b in zip(thr0, thr1, strict=True)],
        warmup_failures=sum(1 for o in warm if not o.ok), warm_s=warm_s,
        client_cpu_s=client1 - client0,
        other_cpu_s=(machine1[0] - machine0[0]) - (ours1 - ours0) - (client1 - client0),
        steal_s=machine1[1] - machine0[1], idle_share=idle, idle_gossip=gossip_rate,
        last_s=[max((o.arrived for o in outcomes if o.node == name), default=math.nan)
                for name in cluster.names],
    )


# ---- report -----------------------------------------------------------------------------------


def describe(r: Result) -> str:
    fails = f", [red]{len(r.failures)} NOT completed with reward 1[/red]" if r.failures else ""
    return (f"{r.label}: {r.rps:.2f} rollouts/s ({r.rollouts} in {r.seconds:.1f} s), "
            f"p50 {r.latency(0.5):.1f} s, p99 {r.latency(0.99):.1f} s, work {r.work}, "
            f"CPU s {[round(c, 1) for c in r.cpu_s]}, last result s {[round(t, 1) for t in r.last_s]}, "
            f"last submit sent at {max(o.submitted for o in r.outcomes):.1f} s{fails} (waited {r.converge_s:.0f} s for "
            f"start-up, warm-up {r.warm_s:.0f} s; the front forwarded {r.forwarded} rollouts, its "
            f"outboxes sent {r.forward_requests} requests, its relays swept with "
            f"{r.sweeps[0]} listings and {r.sweeps[1]} lookups)")


def results_table(title: str, results: list[Result], base: Result | None) -> Table:
    """``base``: the one-budget daemon; eff = rps / (budgets x its rps), where a run's budgets
    are its total cores over the base's (N for N federated daemons, N for the control)."""
    table = Table(title=title)
    cols = ["run", "daemons", "cores each", "slots each init/run/eval", "rollouts", "ok", "seconds",
            "rollouts/s", "eff vs budgets x 1", "p50 s", "p99 s", "forwarded", "work per daemon",
            "busiest/mean", "rollouts/s of each repeat"]
    for col in cols if base else [c for c in cols if c not in ("eff vs budgets x 1", "forwarded")]:
        table.add_column(col, justify="right")
    for r in results:
        budgets = r.n * r.cores_each / base.cores_each if base else float("nan")
        eff = r.rps / (budgets * base.rps) if base else float("nan")
        ok = f"{r.rollouts - len(r.failures)}/{r.rollouts}"
        row = [r.label, str(r.n), f"{r.cores_each:g}", "/".join(map(str, r.slots)), str(r.rollouts),
               ok if not r.failures else f"[red]{ok}", f"{r.seconds:.1f}", f"{r.rps:.2f}"]
        if base:
            row.append(f"{eff:.3f}")
        row += [f"{r.latency(0.5):.1f}", f"{r.latency(0.99):.1f}"]
        if base:
            row.append(f"{100 * r.forwarded / max(1, r.rollouts):.0f}%")
        row += [" ".join(str(w) for w in r.work), f"{r.tail_ratio:.2f}",
                " ".join(f"{x:.2f}" for x in r.repeats) or "-"]
        table.add_row(*row)
    return table


def cpu_table(title: str, results: list[Result]) -> Table:
    table = Table(title=title)
    for col in ("run", "CPU s per daemon (cgroup: daemon, sandboxes, tools)", "CPU s/rollout",
                "% of budget busiest / mean", "idle % of budget mean / max", "idle gossip exchanges/s mean",
                "throttled s (sum)", "daemon process CPU s front / peers mean",
                "client CPU s", "other load cores", "steal cores"):
        table.add_column(col, justify="right")
    for r in results:
        use = [c / (r.cores_each * r.seconds) for c in r.cpu_s]
        peers = r.proc_cpu_s[1:]
        table.add_row(
            r.label, " ".join(f"{c:.1f}" for c in r.cpu_s), f"{sum(r.cpu_s) / max(1, r.rollouts):.2f}",
            f"{100 * max(use):.0f}% / {100 * statistics.mean(use):.0f}%",
            f"{100 * statistics.mean(r.idle_share):.1f}% / {100 * max(r.idle_share):.1f}%",
            f"{statistics.mean(r.idle_gossip):.1f}",
            f"{sum(r.throttled_s):.1f}",
            f"{r.proc_cpu_s[0]:.1f} / " + (f"{statistics.mean(peers):.1f}" if peers else "-"),
            f"{r.client_cpu_s:.1f}", f"{r.other_cpu_s / r.seconds:.2f}", f"{r.steal_s / r.seconds:.2f}",
        )
    return table


def pick_knee(sweep: list[Result], tolerance: float) -> Result:
    best = max(r.rps for r in sweep)
    return min((r for r in sweep if r.rps >= (1 - tolerance) * best), key=lambda r: r.slots[1])


async def main(args: argparse.Namespace) -> None:
    """The benchmark; SIGTERM and SIGHUP stop it like Ctrl-C (everything is cleaned up)."""

    async def on_signal() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
            async for signum in signals:
                raise KeyboardInterrupt(f"signal {signum}")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(on_signal)
        await bench(args)
        nursery.cancel_scope.cancel()


async def bench(args: argparse.Namespace) -> None:
    global GOSSIP_INTERVAL_S, CFS_PERIOD_US
    GOSSIP_INTERVAL_S = args.gossip_interval_s
    CFS_PERIOD_US = args.cfs_period_us
    sizes = [int(s) for s in args.sizes.split(",")]
    sweep_runs = [int(s) for s in args.sweep.split(",")] if args.sweep else []
    if args.load == "batch" and (args.group_size < 1 or args.per_daemon % args.group_size):
        raise SystemExit(f"--per-daemon {args.per_daemon} is not a multiple of --group-size {args.group_size}")
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if sizes[0] != 1 or sizes != sorted(set(sizes)):
        raise SystemExit("--sizes must start with 1 (the one-budget baseline) and grow")
    if not ROLLOUTD.exists():
        raise SystemExit(f"{ROLLOUTD} not found: run this with the venv's python")
    if os.geteuid() != 0:
        raise SystemExit("this benchmark needs root: it gives each daemon a cgroup with a CPU quota")
    if args.stealing == "default":
        args.stealing = None
    elif stealing_setting_exists():
        args.stealing = args.stealing == "on"
    else:
        console.print(f"[yellow]--stealing {args.stealing}: this rolloutd has no work_stealing "
                      "setting; the daemons run as they are")
        args.stealing = None
    top = max(sizes)
    total = top * args.budget
    cpus = os.cpu_count() or 1
    if total > cpus:
        raise SystemExit(f"{top} daemons x {args.budget} cores = {total:g} cores > the {cpus} CPUs")
    first = len(sweep_runs) or 1
    n_daemons = first + sum(sizes[1:]) + (0 if args.no_control else 1)
    budgets = CLEANUP.budgets = Budgets()
    net = CLEANUP.net = choose_network(args.net, n_daemons)
    results: list[Result] = []
    rounds: list[dict[str, Result]] = []  # each: label -> that round's burst
    started = time.perf_counter()
    console.print(
        f"budget: {args.budget:g} core per daemon ({budgets.describe()}, period {CFS_PERIOD_US} us); "
        f"{top} daemons take {total:g} of {cpus} CPUs, the rest is the client's. Network: {net.mode}. "
        f"Workload: code tasks, scripted backend (TEST DOUBLE) at {args.latency_s:g} s a turn, "
        f"3 turns (2 bash tool calls, then finish), bwrap sandboxes. "
        + (f"Load: one batch of groups of {args.group_size} (POST /v1/batches). "
           if args.load == "batch" else "")
        + ("[yellow]Load: direct, NO FRONT: each daemon is given its equal share (marked "
           "forwarded: no placement, no forwarding, no relay); the RESULT line is the ceiling "
           "of these budgets on this machine, not the federation's.[/yellow] "
           if args.load == "direct" else "") + "Gossip every "
        f"{gossip_interval():g} s. Work stealing: {STEALING_TEXT[args.stealing]}.")
    # A rough plan from runs on this 2-core VM: a daemon takes ~18 CPU-seconds to start
    # (imports, tokenizer), so k daemons ~20 + 10 (k - 1) s; a rollout ~0.2 CPU-seconds on
    # one daemon (~5 rollouts/s per core), and a federation reached ~70% of that.
    burst_s = args.per_daemon / (5 * args.budget)
    later = sum(sizes[1:]) + (0 if args.no_control else 1)  # started together after the sweep
    est = (20 + 10 * (first - 1) + len(sweep_runs) * (burst_s + 10) + 10 + 10 * later
           + args.repeats * (len(sizes) * (burst_s / 0.7 + 10)
                             + (0 if args.no_control else burst_s + 10)) + 10)
    console.print(f"expected time: about {est / 60:.0f} min ({len(sweep_runs)} sweep points, sizes {sizes}, "
                  f"{'no' if args.no_control else 'one'} control, {args.repeats} bursts each; "
                  f"{args.per_daemon} rollouts per daemon)")

    def config(slots: tuple[int, int, int]) -> str:
        return daemon_config(slots, args.latency_s, args.stealing, args.gossip_interval_s,
                             "info" if args.keep_logs else "warning",
                             None if args.gossip_udp == "default" else args.gossip_udp == "on")

    fleet = Fleet(net, budgets, args.keep_logs)
    budgets.make(n_daemons)
    timeout = httpx.Timeout(30.0, read=None)
    limits = httpx.Limits(max_connections=SUBMITTERS + 16)
    try:
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=fleet.auth) as http:

            async def measured(label: str, cluster: Cluster, slots: tuple[int, int, int], cores: float,
                               rollouts: int) -> Result:
                ready_s = await wait_converged(cluster, http, timeout_s=300)
                group = args.group_size if args.load == "batch" else None
                r = await measure(Run(label, cluster.n, slots, cores, rollouts, args.burst_timeout_s,
                                      group, args.load == "direct"), cluster, http, ready_s)
                r.indices = list(cluster.indices)
                console.print(describe(r))
                return r

            def median_of(label: str, runs: list[Result]) -> Result:
                """The burst with the median rollouts/s stands for ``runs`` (its latencies,
                work and CPU); every burst's rate is kept."""
                mid = sorted(runs, key=lambda r: r.rps)[(len(runs) - 1) // 2]
                return dataclasses.replace(mid, label=label, repeats=[r.rps for r in runs],
                                           other_failures=[o for r in runs if r is not mid
                                                           for o in r.failures],
                                           warmup_failures=sum(r.warmup_failures for r in runs))

            # 1. saturation of one daemon under one budget; the daemons start together
            # (start-up is CPU-bound and slow), each on its own, and are measured in turn.
            if sweep_runs:
                alone = [fleet.start(config(stage_slots(k)), [], 1)[0] for k in sweep_runs]
                for i in alone:  # all up first (see below)
                    await wait_converged(Cluster(fleet, [i]), http, timeout_s=300)
                sweep = [await measured(f"sweep n_run={k}", Cluster(fleet, [i]), stage_slots(k),
                                        args.budget, args.per_daemon)
                         for k, i in zip(sweep_runs, alone, strict=True)]
                title = f"saturation: ONE daemon, {args.budget:g} core, {args.per_daemon} rollouts"
                console.print(results_table(title, sweep, None))
                console.print(cpu_table(title + ": CPU over the burst", sweep))
                knee = pick_knee(sweep, args.knee)
                slots = knee.slots[1]
                console.print(f"saturation point: n_run={slots} (the fewest RUN slots within "
                              f"{100 * args.knee:.0f}% of the sweep's best {max(r.rps for r in sweep):.2f}/s)")
                members = [alone[sweep.index(knee)]]
                fleet.stop([i for i in alone if i not in members])
            else:
                slots = args.slots
                console.print(f"no sweep: n_run={slots} per daemon (--slots)")
                members = fleet.start(config(stage_slots(slots)), [], 1)
            per = stage_slots(slots)
            # 2. and 3. One federation of each size (the chosen daemon is the federation of
            # one, the others start now, seeded with each other) and the control, all up at
            # once, then measured in rounds: every round one burst of each, in one order and
            # the next round in the reverse one, so that each ratio compares bursts minutes
            # apart at most (this VM drifts by 10% between blocks measured 8 minutes apart).
            setups = [("federated 1", Cluster(fleet, members), per, args.budget, args.per_daemon)]
            for n in sizes[1:]:
                setups.append((f"federated {n}", Cluster(fleet, fleet.start(config(per), [], n)),
                               per, args.budget, n * args.per_daemon))
            if not args.no_control:
                setups.append((f"control (1 x {top} budgets)",
                               Cluster(fleet, fleet.start(config(stage_slots(slots, top)), [], 1)),
                               stage_slots(slots, top), top * args.budget, top * args.per_daemon))
            # Every daemon up before the first burst: one still starting (~18 CPU-s) would
            # take the CPU of the bursts measured meanwhile.
            for _, cluster, *_ in setups:
                await wait_converged(cluster, http, timeout_s=300)
            for k in range(args.repeats):
                got: dict[str, Result] = {}
                for label, cluster, stage, cores, count in setups if k % 2 == 0 else setups[::-1]:
                    tag = label if args.repeats == 1 else f"{label} (round {k + 1}/{args.repeats})"
                    got[label] = await measured(tag, cluster, stage, cores, count)
                rounds.append(got)
                if k == 0 and sweep_runs:
                    console.print(f"the sweep's run of the federation of one: {knee.rps:.2f} "
                                  "rollouts/s (its own bursts stand for it)")
            results.extend(median_of(label, [got[label] for got in rounds])
                           for label, *_ in setups)
    finally:
        fleet.stop_all()
        CLEANUP()
    for r in results:
        r.exit_codes = [fleet.codes.get(i) for i in r.indices]

    one = next(r for r in results if r.label == "federated 1")
    console.print(results_table(
        f"federation: one front, {args.per_daemon} code rollouts per daemon, {args.budget:g} core "
        f"and {'/'.join(map(str, per))} slots per budget; scripted backend (TEST DOUBLE, "
        f"{args.latency_s:g} s a turn); bwrap; network {net.mode}; {cpus} CPUs; "
        f"CFS period {CFS_PERIOD_US / 1000:g} ms", results, one))
    console.print(cpu_table("CPU over each burst", results))
    sources = {r.work_source for r in results}
    console.print(
        "rollouts/s: rollouts / (first submit to last result); eff = rps / (budgets x rps of one "
        "federated daemon), budgets = a run's cores / one daemon's (N, also for the control of N); ok: completed with reward 1. p50/p99: submit to result, as the client "
        f"sees it{' (submit: the batch creation)' if args.load == 'batch' else ''}; forwarded: "
        "rollouts the front forwarded or placed on a peer (a batch's). work per daemon: rollouts "
        f"each daemon ran, from {' and '.join(sorted(sources))}; "
        "busiest/mean of it. CPU s: each daemon's cgroup over the burst (its sandboxes and tools "
        "included); % of budget: that over (budget x burst time); idle: the same over "
        f"{IDLE_S:g} s before the burst, with nothing submitted (gossip, health checks), and the gossip "
        "exchanges a daemon started or answered a second meanwhile (GET /v1/status); throttled: time the quota held "
        "them back; daemon process: the rolloutd process alone. Other load: CPU the rest of the "
        "machine used meanwhile (not these daemons, not this client), in cores; steal: taken by "
        "the hypervisor.")
    for r in results:
        if r.warmup_failures:
            console.print(f"[red]{r.label}: {r.warmup_failures} warm-up rollouts did not complete with reward 1")
        for failed, which in ((r.failures, f"of {r.rollouts} rollouts"),
                              (r.other_failures, "rollouts of its other repeats")):
            if failed:
                console.print(f"[red]{r.label}: {len(failed)} {which} did not complete with "
                              "reward 1; first ones:")
                for o in failed[:5]:
                    console.print(f"  [red]{o.status} reward={o.reward} node={o.node} {o.error}")
        if any(c != 0 for c in r.exit_codes):
            console.print(f"[red]{r.label}: daemon exit codes {r.exit_codes}")
    console.print(f"total time: {(time.perf_counter() - started) / 60:.1f} min")

    def fmt(x: float | None) -> str:
        return "nan" if x is None or math.isnan(x) else f"{x:.3f}"

    control = next((label for label in rounds[0] if label.startswith("control")), None) if rounds else None

    def ratio(got: dict[str, Result], num: str, den: str | None, scale: float) -> float | None:
        if den is None or num not in got or den not in got:
            return None
        return got[num].rps / (scale * got[den].rps)

    def paired(num: str, den: str | None, scale: float) -> float | None:
        """The median over the rounds of ``num``'s rollouts/s over ``scale`` x ``den``'s in the
        same round."""
        ratios = [x for got in rounds if (x := ratio(got, num, den, scale)) is not None]
        return statistics.median(ratios) if ratios else None

    keys: list[tuple[str, str, str | None, float]] = [
        (f"eff_{n}", f"federated {n}", "federated 1", float(n)) for n in (2, 4, 8)]
    keys.append(("vs_control_8", "federated 8", control if top == 8 else None, 1.0))
    table = Table(title="rounds: rollouts/s of each burst, and each round's ratios (the RESULT "
                        "line is their median)")
    for col in ["round", *rounds[0], *(k for k, *_ in keys)] if rounds else []:
        table.add_column(col, justify="right")
    for k, got in enumerate(rounds):
        table.add_row(f"{k + 1} ({'forward' if k % 2 == 0 else 'reverse'})",
                      *(f"{got[label].rps:.2f}" for label in rounds[0]),
                      *(fmt(ratio(got, num, den, scale)) for _, num, den, scale in keys))
    console.print(table)
    by_label = {r.label: r for r in results}
    medians = {key: ratio(by_label, num, den, scale) for key, num, den, scale in keys
               if den is not None}
    console.print("the same ratios from each run's median burst (how they were computed until "
                  "2026-11-28): " + " ".join(f"{k}={fmt(v)}" for k, v in medians.items()))
    r8 = by_label.get("federated 8")
    print("RESULT " + " ".join(f"{key}={fmt(paired(num, den, scale))}" for key, num, den, scale in keys)
          + f" tail_ratio_8={fmt(r8.tail_ratio if r8 else None)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--sizes", default="1,2,4,8", help="federation sizes, growing (the first must be 1)")
    p.add_argument("--budget", type=float, default=0.2, help="CPU cores per daemon (cgroup quota)")
    p.add_argument("--per-daemon", type=int, default=16, help="rollouts per daemon in each burst")
    p.add_argument("--sweep", default="1,2,3,4",
                   help="RUN slot counts for one daemon's saturation sweep ('' skips it: --slots)")
    p.add_argument("--slots", type=int, default=2, help="RUN slots per daemon when --sweep is ''")
    p.add_argument("--knee", type=float, default=0.05,
                   help="saturation: the fewest slots within this fraction of the sweep's best")
    p.add_argument("--latency-s", type=float, default=0.4, help="the scripted backend's latency per turn")
    p.add_argument("--no-control", action="store_true", help="skip the one-daemon control")
    p.add_argument("--load", choices=("rollouts", "batch", "direct"), default="rollouts",
                   help="rollouts: each submitted alone (POST /v1/rollouts) and streamed back; "
                   "batch: one dynamic-sampling batch on the front (POST /v1/batches) of "
                   "--group-size groups, all in flight, all kept, streamed back as groups; "
                   "direct: no front, each daemon given its equal share (a ceiling, see above)")
    p.add_argument("--group-size", type=int, default=4, help="G of --load batch")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds: one burst of each size and of the control per round; each ratio is "
                   "taken within a round and its median over the rounds is the RESULT")
    p.add_argument("--stealing", choices=("default", "on", "off"), default="default",
                   help="work_stealing in the daemons' config: the daemon's default (on), on or off")
    p.add_argument("--gossip-udp", choices=("default", "on", "off"), default="default",
                   help="gossip_udp in the daemons' config: the daemon's default (on), on or off")
    p.add_argument("--gossip-interval-s", type=float, default=None,
                   help="the daemons' gossip interval (default: the daemon's default)")
    p.add_argument("--burst-timeout-s", type=float, default=180,
                   help="a burst's results that have not arrived by then count as failures")
    p.add_argument("--net", choices=["auto", "netns", "loopback"], default="auto")
    p.add_argument("--cfs-period-us", type=int, default=100_000,
                   help="the CFS period of each budget's quota (default the kernel's, 100000: a "
                        "0.2-core daemon runs 20 ms, then waits 80 ms when it has used them)")
    p.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                   help="run the daemons at log level info and copy their logs (daemon<i>.log) "
                        "to DIR when they stop (default: warning, removed with the run)")
    return p.parse_args(argv)


def _interrupted(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(KeyboardInterrupt)[1] is None
    return isinstance(exc, KeyboardInterrupt)


if __name__ == "__main__":
    arguments = parse_args()
    try:
        trio.run(main, arguments)
    except BaseException as exc:
        if not _interrupted(exc):
            raise
        CLEANUP()
        console.print(f"[yellow]interrupted ({exc!r}); daemons, cgroups and namespaces removed")
        sys.exit(130)
    finally:  # also on a crash: nothing of ours is left
        CLEANUP()
