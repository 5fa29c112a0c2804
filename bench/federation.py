"""Federation scaling: rollouts per second with 1, 2, 4 and 8 rolloutd daemons, one front.

Each daemon is a separate `rolloutd serve` process. As root with `ip netns`, each one runs in
its own network namespace with its own address (10.231.0.<i+1> on a veth pair to a bridge
that holds the benchmark client's 10.231.0.254), like one daemon per node; otherwise all of
them listen on loopback ports (`--net loopback` forces that). They federate through their
seeds; every submit goes to daemon 0, the front, which runs the rollout or forwards it.

Workload (I/O-bound): the labelled `sleep` test task. INIT sleeps 50 ms (standing in for a
sandbox start), RUN sleeps 0.5-1.5 s (uniform, seeded; standing in for the agent loop: LLM
turns at a fixed latency and sleep tools), EVAL sleeps 50 ms. We use this task instead of
the agent loop with the scripted backend and a real tool. The agent path costs CPU for each
rollout: tokenizing and rendering, and a tool process in a local sandbox. On a 2-core
machine, that cost would cap throughput before federation matters. Each daemon has
n_init=2, n_run=8 and n_eval=2 workers, so the 8 RUN slots limit it to about 8 rollouts/s.
Each daemon also has a scripted LLM backend (a test double the sleep task never calls),
because placement only forwards to peers that report a healthy backend.

For each size N, the front gets N x --per-daemon rollouts in one burst, from 16 concurrent
submitters, and more than all daemons can hold, so every daemon's queue stays full. Each
chunk of 64 results is streamed back through the front as soon as the chunk is submitted.
rps_N is the number of rollouts divided by the time from the first submit to the last
result (what a trainer waiting for its batch sees). eff_N = rps_N / (N * rps_1). The table
also shows the steady rate: the middle half of the results over their time span, which
leaves out the ramp and the tail. Targets: eff_4 >= 0.9, eff_8 >= 0.85.

    sudo .venv/bin/python bench/federation.py            # about 2.5 minutes on 2 cores

Ends with: RESULT rps_1=F rps_2=F rps_4=F rps_8=F eff_2=F eff_4=F eff_8=F
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
from rich.console import Console
from rich.table import Table

ROLLOUTD = Path(sys.executable).with_name("rolloutd")
N_INIT, N_RUN, N_EVAL = 2, 8, 2
INIT_S, EVAL_S = 0.05, 0.05
RUN_S = (0.5, 1.5)
SUBMITTERS = 16
STREAM_CHUNK = 64
GOSSIP_INTERVAL_S = 0.5
NS_PREFIX = "rolloutd-bench-"
BRIDGE = "rdbench0"
SUBNET = "10.231.0"
CLIENT_ADDR = f"{SUBNET}.254"
PORT = 8400

CONFIG = f"""\
# rolloutd settings for bench/federation.py
sandbox_backend = "local"
n_init = {N_INIT}
n_run = {N_RUN}
n_eval = {N_EVAL}
queue_size = 8192
gossip_interval_s = {GOSSIP_INTERVAL_S}
log_level = "warning"

[[backends]]
kind = "scripted"          # TEST DOUBLE: sleep tasks never call it
replies = ["unused"]
latency_s = 0.3
"""

console = Console(width=200)


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
        return ["ip", "netns", "exec", f"{NS_PREFIX}{i}", *argv] if self.mode == "netns" else argv

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
    if requested in ("auto", "netns") and os.geteuid() == 0 and shutil.which("ip"):
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
        raise SystemExit("--net netns needs root and the ip command")
    return Network("loopback", n)


# ---- daemons ----------------------------------------------------------------------------------


@dataclass
class Cluster:
    net: Network
    n: int
    token: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [self.net.url(i) for i in range(self.n)]

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def start_daemons(net: Network, n: int, workdir: Path) -> Cluster:
    token = secrets.token_hex(32)
    token_file = workdir / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    config = workdir / "rolloutd.toml"
    config.write_text(CONFIG)
    cluster = Cluster(net, n, token)
    base = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTD_")}
    for i in range(n):
        env = dict(
            base,
            ROLLOUTD_NODE_ID=f"bench{i}",
            ROLLOUTD_URL=net.url(i),
            ROLLOUTD_SEEDS=",".join(cluster.urls),
            ROLLOUTD_TOKEN_FILE=str(token_file),
            ROLLOUTD_STATE_DIR=str(workdir / f"state{i}"),
            ROLLOUTD_DRAIN_TIMEOUT_S="10",
        )
        argv = [str(ROLLOUTD), "serve", "--config", str(config), "--host", net.addr(i),
                "--port", str(net.ports[i])]
        log = (workdir / f"daemon{i}.log").open("wb")
        cluster.procs.append(subprocess.Popen(net.wrap(i, argv), env=env, stdout=log, stderr=log,
                                              stdin=subprocess.DEVNULL))
        log.close()
    return cluster


def stop_daemons(cluster: Cluster, workdir: Path) -> list[int | None]:
    """SIGTERM (the daemons drain, nothing is running), then SIGKILL what is left."""
    for p in cluster.procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes: list[int | None] = []
    for i, p in enumerate(cluster.procs):
        try:
            codes.append(p.wait(timeout=30))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
            console.print(f"[red]daemon {i} did not stop; killed. Log: {workdir / f'daemon{i}.log'}")
    return codes


async def wait_converged(cluster: Cluster, http: httpx.AsyncClient, timeout_s: float) -> float:
    """Until the front sees every daemon alive with a healthy backend; returns seconds taken."""
    start = time.perf_counter()
    with trio.fail_after(timeout_s):
        while True:
            for i, p in enumerate(cluster.procs):
                if p.poll() is not None:
                    raise RuntimeError(f"daemon {i} exited with {p.returncode} during start")
            try:
                resp = await http.get(cluster.urls[0] + "/v1/federation/members")
                members = resp.json()["members"] if resp.status_code == 200 else []
            except httpx.HTTPError:
                members = []
            if len(members) == cluster.n and all(
                m["state"] == "alive" and m["capacity"]["healthy_backends"] > 0 for m in members
            ):
                break
            await trio.sleep(0.2)
    await trio.sleep(2 * GOSSIP_INTERVAL_S)  # fresh capacity reports everywhere
    return time.perf_counter() - start


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def finished_counts(cluster: Cluster, http: httpx.AsyncClient) -> list[int]:
    out = []
    for url in cluster.urls:
        st = (await http.get(url + "/v1/status")).json()
        out.append(int(st["pipeline"]["stages"]["eval"]["finished"]))
    return out


async def forwarded_total(cluster: Cluster, http: httpx.AsyncClient) -> int:
    st = (await http.get(cluster.urls[0] + "/v1/status")).json()
    return int((st.get("federation") or {}).get("forwarded_total", 0))


# ---- load -------------------------------------------------------------------------------------


def workload(count: int, seed: int = 7) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"kind": "sleep", "init_s": INIT_S, "run_s": round(rng.uniform(*RUN_S), 3), "eval_s": EVAL_S}
            for _ in range(count)]


async def submit_all(http: httpx.AsyncClient, front: str, tasks: list[dict[str, Any]]) -> list[str]:
    ids: list[str | None] = [None] * len(tasks)
    todo = iter(enumerate(tasks))

    async def submitter() -> None:
        for i, task in todo:
            resp = await http.post(front + "/v1/rollouts", json={"task": task})
            if resp.status_code != 202:
                raise RuntimeError(f"submit answered {resp.status_code}: {resp.text[:300]}")
            ids[i] = resp.json()["ids"][0]

    async with trio.open_nursery() as nursery:
        for _ in range(SUBMITTERS):
            nursery.start_soon(submitter)
    return [i for i in ids if i is not None]


async def run_load(
    http: httpx.AsyncClient, front: str, tasks: list[dict[str, Any]]
) -> tuple[dict[str, int], list[float]]:
    """Submit in chunks; stream each chunk's results through the front as soon as it is in.

    Returns the status counts and each result's arrival time (seconds since the first submit).
    """
    statuses: dict[str, int] = {}
    arrivals: list[float] = []
    t0 = time.perf_counter()

    async def stream(chunk: list[str]) -> None:
        params = {"ids": ",".join(chunk)}
        async with http.stream("GET", front + "/v1/rollouts/stream", params=params) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.strip():
                    status = json.loads(line)["status"]
                    statuses[status] = statuses.get(status, 0) + 1
                    arrivals.append(time.perf_counter() - t0)

    async with trio.open_nursery() as nursery:
        for k in range(0, len(tasks), STREAM_CHUNK):
            ids = await submit_all(http, front, tasks[k : k + STREAM_CHUNK])
            nursery.start_soon(stream, ids)
    return statuses, sorted(arrivals)


@dataclass
class Result:
    n: int
    rollouts: int
    seconds: float
    steady_rps: float
    converge_s: float
    statuses: dict[str, int]
    shares: list[int]
    forwarded: int
    front_cpu_ms: float
    all_cpu_s: float
    exit_codes: list[int | None]

    @property
    def rps(self) -> float:
        return self.rollouts / self.seconds


async def run_size(net: Network, n: int, per_daemon: int) -> Result:
    with tempfile.TemporaryDirectory(prefix="rolloutd-bench-") as tmp:
        workdir = Path(tmp)
        cluster = start_daemons(net, n, workdir)
        codes: list[int | None] = []
        try:
            timeout = httpx.Timeout(30.0, read=None)
            limits = httpx.Limits(max_connections=SUBMITTERS + 16)
            async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=cluster.auth) as http:
                converge_s = await wait_converged(cluster, http, timeout_s=90)
                front = cluster.urls[0]
                # Warm-up: connections between the front and each peer, code paths.
                await run_load(http, front, workload(n * N_RUN, seed=1))
                await trio.sleep(2 * GOSSIP_INTERVAL_S)
                before = await finished_counts(cluster, http)
                fwd0 = await forwarded_total(cluster, http)
                cpu0 = [cpu_s(p.pid) for p in cluster.procs]

                tasks = workload(n * per_daemon)
                statuses, arrivals = await run_load(http, front, tasks)

                cpu1 = [cpu_s(p.pid) for p in cluster.procs]
                after = await finished_counts(cluster, http)
                fwd1 = await forwarded_total(cluster, http)
        finally:
            codes = stop_daemons(cluster, workdir)
        if any(c != 0 for c in codes):
            console.print(f"[red]daemon exit codes {codes}; logs were in {workdir}")
    # Steady state: the middle half of the results, while every daemon has a full queue.
    q1, q3 = len(arrivals) // 4, 3 * len(arrivals) // 4
    return Result(
        n=n,
        rollouts=len(arrivals),
        seconds=arrivals[-1],
        steady_rps=(q3 - q1) / (arrivals[q3] - arrivals[q1]),
        converge_s=converge_s,
        statuses=statuses,
        shares=[a - b for a, b in zip(after, before, strict=True)],
        forwarded=fwd1 - fwd0,
        front_cpu_ms=(cpu1[0] - cpu0[0]) * 1000 / max(1, len(arrivals)),
        all_cpu_s=sum(cpu1) - sum(cpu0),
        exit_codes=codes,
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="1,2,4,8", help="daemon counts (the first is the baseline: 1)")
    parser.add_argument("--per-daemon", type=int, default=64, help="rollouts per daemon in each run")
    parser.add_argument("--net", choices=["auto", "netns", "loopback"], default="auto")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if not ROLLOUTD.exists():
        raise SystemExit(f"{ROLLOUTD} not found: run this with the venv's python")

    net = choose_network(args.net, max(sizes))
    results: list[Result] = []
    try:
        for n in sizes:
            r = await run_size(net, n, args.per_daemon)
            console.print(f"{n} daemon(s): {r.rps:.2f} rollouts/s ({r.rollouts} in {r.seconds:.2f} s), "
                          f"steady {r.steady_rps:.2f}/s, shares {r.shares}, converged in {r.converge_s:.1f} s")
            results.append(r)
    finally:
        net.teardown()

    base = next((r.rps for r in results if r.n == 1), None)
    mean_run = sum(RUN_S) / 2
    table = Table(title=f"federation scaling: one front, {args.per_daemon} sleep rollouts per daemon "
                        f"(RUN {RUN_S[0]}-{RUN_S[1]} s, {N_RUN} RUN slots per daemon), network: {net.mode}, "
                        f"{os.cpu_count()} CPUs")
    steady_base = next((r.steady_rps for r in results if r.n == 1), None)
    for col in ("daemons", "rollouts", "seconds", "rollouts/s", "eff vs 1", "ideal/s", "steady/s",
                "steady eff", "forwarded", "per daemon (min-max)", "front CPU ms/rollout",
                "all daemons CPU", "completed"):
        table.add_column(col, justify="right")
    for r in results:
        eff = r.rps / (r.n * base) if base else float("nan")
        steady_eff = r.steady_rps / (r.n * steady_base) if steady_base else float("nan")
        table.add_row(
            str(r.n), str(r.rollouts), f"{r.seconds:.2f}", f"{r.rps:.2f}", f"{eff:.3f}",
            f"{r.n * N_RUN / mean_run:.1f}", f"{r.steady_rps:.2f}", f"{steady_eff:.3f}",
            f"{100 * r.forwarded / r.rollouts:.0f}%", f"{min(r.shares)}-{max(r.shares)}",
            f"{r.front_cpu_ms:.1f}", f"{100 * r.all_cpu_s / r.seconds / (os.cpu_count() or 1):.0f}%",
            f"{r.statuses.get('completed', 0)}/{r.rollouts}",
        )
    console.print(table)
    console.print("rollouts/s: rollouts / (first submit to last result); eff = rps_N / (N * rps_1). "
                  "ideal/s: RUN slots / mean RUN time, times N. steady/s: the middle half of the "
                  "results over their time span (every queue full). all daemons CPU: their CPU time "
                  "over the run, as a share of every core.")
    by_n = {r.n: r for r in results}

    def rps_of(n: int) -> str:
        return f"{by_n[n].rps:.3f}" if n in by_n else "nan"

    def eff_of(n: int) -> str:
        return f"{by_n[n].rps / (n * base):.3f}" if n in by_n and base else "nan"

    print(f"RESULT rps_1={rps_of(1)} rps_2={rps_of(2)} rps_4={rps_of(4)} rps_8={rps_of(8)} "
          f"eff_2={eff_of(2)} eff_4={eff_of(4)} eff_8={eff_of(8)}")


if __name__ == "__main__":
    trio.run(main)
