"""Resource limits: cgroup v2 (delegated subtree), cgroup v1 hierarchies, or rlimits.

The mechanism is detected once per backend. Each sandbox then gets a cgroup named
``<parent>/rolloutd/<boot tag>/<sandbox id>`` below the daemon's own cgroup in every
hierarchy used, so limits set above the daemon keep applying. A cgroup also gives a
fork-race-free kill of the whole sandbox (``cgroup.kill`` on v2, a kill loop on v1).
Without a writable cgroup, the helper sets rlimits on itself (inherited by everything it
spawns): RLIMIT_AS for memory, RLIMIT_NPROC for pids (per user, and ignored for root),
nothing for cpu. Every sandbox also gets RLIMIT_CORE 0 and RLIMIT_NOFILE 4096
(``LimitPlan.inherited``), set on its first process. ``LimitPlan.mechanisms`` says which is in force for each resource.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shlex
import signal
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ._exceptions import SandboxStartError
from ._models import SandboxSpec

log = logging.getLogger(__name__)

CGROUP_FS = Path("/sys/fs/cgroup")
V1_CONTROLLERS = {"memory": "memory.limit_in_bytes", "pids": "pids.max",
                  "cpu": "cpu.cfs_quota_us"}
GROUP_NAME = "rolloutd"
_CPU_PERIOD_US = 100_000
#: Open files per sandbox process (RLIMIT_NOFILE): bounds the kernel memory an fd flood can
#: pin, which no memory cgroup v1 counts (tests/hostile/test_containment.py).
NOFILE_MAX = 4096
INHERITED = {"RLIMIT_CORE": 0, "RLIMIT_NOFILE": NOFILE_MAX}
#: Size of each of /tmp and /dev/shm (bwrap) when the spec sets neither tmpfs_mb nor memory_mb.
TMPFS_DEFAULT_MB = 1024
#: Size of /run (bwrap): small, nothing much lives there.
RUN_MAX_MB = 16


def tmpfs_mb(spec: SandboxSpec) -> int:
    """Size cap of each of a sandbox's memory-backed scratch mounts, /tmp and /dev/shm: the
    spec's ``tmpfs_mb``, else a quarter of its memory limit (their pages count against it,
    and with both full half of it is left to the processes, so a full /tmp is ENOSPC, never
    an OOM kill), else TMPFS_DEFAULT_MB."""
    if spec.tmpfs_mb:
        return spec.tmpfs_mb
    if spec.memory_mb:
        return max(1, spec.memory_mb // 4)
    return TMPFS_DEFAULT_MB


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _own_cgroups() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path."""
    found: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                found[name] = path
    return found


def _unified_mount() -> Path | None:
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and parts[2] == "cgroup2":
                return Path(parts[1])
    return None


@dataclass
class Cgroup:
    """One sandbox's cgroup (v2: one dir; v1: one dir per hierarchy)."""

    version: int
    dirs: list[Path]

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for procs in self.procs_files:
            try:
                found.update(int(x) for x in procs.read_text().split())
            except OSError:
                pass
        return found

    def kill(self) -> None:
        """SIGKILL everything in the cgroup (v2: cgroup.kill; v1: a kill loop)."""
        if self.version == 2 and (self.dirs[0] / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                _write(self.dirs[0] / "cgroup.kill", "1")
            return
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def remove(self) -> bool:
        """rmdir the cgroup dirs; False while processes are still dying."""
        done = True
        for d in self.dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    log.warning("cannot remove cgroup %s: %s", d, exc)
                done = False
        if done:
            for d in self.dirs:  # the boot's dir, once its last sandbox is gone
                with contextlib.suppress(OSError):
                    d.parent.rmdir()
        return done


@dataclass
class LimitPlan:
    """What one sandbox gets: a cgroup (or None), rlimits for the helper, mechanisms."""

    mechanisms: dict[str, str]
    cgroup: Cgroup | None = None
    rlimits: dict[str, int] = field(default_factory=dict)  # the helper sets these on itself
    #: for every process of the sandbox; set on its first process (any ancestor will do)
    inherited: dict[str, int] = field(default_factory=lambda: dict(INHERITED))

    def exec_prefix(self) -> list[str]:
        """argv prefix that moves the started process into the cgroup before exec."""
        if self.cgroup is None:
            return []
        script = " && ".join(f"echo $$ > {shlex.quote(str(p))}" for p in self.cgroup.procs_files)
        return ["/bin/sh", "-c", script + ' && exec "$@"', "sh"]



class Limits:
    """Detects the limit mechanism and creates per-sandbox cgroups.

    mode: "auto" (v2 subtree, else v1 hierarchies, else rlimits), "cgroup-v2",
    "cgroup-v1", or "rlimit". ``v2_root`` names a delegated v2 subtree explicitly.
    """

    def __init__(self, mode: str = "auto", v2_root: str | Path | None = None,
                 cpu_weight: float | None = None) -> None:
        if mode not in ("auto", "cgroup-v2", "cgroup-v1", "rlimit"):
            raise SandboxStartError(f"unknown limits mode {mode!r}")
        if cpu_weight is not None and not 0 < cpu_weight <= 100:
            raise SandboxStartError(f"cpu_weight must be in (0, 100], not {cpu_weight!r}")
        self.mode = mode
        #: what the sandboxes' common cgroup got (``cpu.shares=128``), None where nothing was set
        self.cpu_weight_setting: str | None = None
        self.v2_root: Path | None = None
        self.v1_roots: dict[str, Path] = {}
        self.kind = "rlimit"
        if mode in ("auto", "cgroup-v2"):
            self.v2_root = self._detect_v2(Path(v2_root) if v2_root else None)
            if self.v2_root is not None:
                self.kind = "cgroup-v2"
        if self.kind == "rlimit" and mode in ("auto", "cgroup-v1"):
            self.v1_roots = self._detect_v1()
            if self.v1_roots:
                self.kind = "cgroup-v1"
        if mode != "auto" and self.kind != mode:
            raise SandboxStartError(f"limits mode {mode!r} requested but not available here "
                                    f"(no writable {mode} hierarchy)")
        if cpu_weight is not None:
            self._weigh(cpu_weight)

    def _weigh(self, cpu_weight: float) -> None:
        """Give all sandboxes together ``cpu_weight`` times a process's default CPU weight:
        their common cgroup competes with the daemon's own process as one entity, so under
        contention the daemon (API, gossip, agent loop) gets its share first."""
        if self.kind == "cgroup-v2" and self.v2_root is not None:
            path, value = self.v2_root / "cpu.weight", f"{min(10000, max(1, round(100 * cpu_weight)))}"
        elif self.kind == "cgroup-v1" and "cpu" in self.v1_roots:
            path, value = self.v1_roots["cpu"] / "cpu.shares", f"{max(2, round(1024 * cpu_weight))}"
        else:
            return
        try:
            _write(path, value)
        except OSError as exc:
            log.info("cannot set the sandboxes' CPU weight (%s): %s", path, exc)
            return
        self.cpu_weight_setting = f"{path.name}={value}"

    def _detect_v2(self, explicit: Path | None) -> Path | None:
        if explicit is not None:
            base = explicit
        else:
            mount = _unified_mount()
            if mount is None:
                return None
            base = mount / _own_cgroups().get("", "/").lstrip("/")
        try:
            controllers = (base / "cgroup.controllers").read_text().split()
        except OSError:
            return None
        if not {"memory", "pids"} <= set(controllers) or not os.access(base, os.W_OK):
            return None
        root = base / GROUP_NAME
        try:
            root.mkdir(exist_ok=True)
            enable = " ".join(f"+{c}" for c in ("memory", "pids", "cpu") if c in controllers)
            _write(base / "cgroup.subtree_control", enable)
            _write(root / "cgroup.subtree_control", enable)
        except OSError as exc:
            log.info("cgroup v2 subtree %s not usable: %s", base, exc)
            return None
        return root

    def _detect_v1(self) -> dict[str, Path]:
        own = _own_cgroups()
        roots: dict[str, Path] = {}
        for controller, probe in V1_CONTROLLERS.items():
            for hier in CGROUP_FS.iterdir() if CGROUP_FS.is_dir() else []:
                if controller not in hier.name.split(","):
                    continue
                base = hier / own.get(controller, "/").lstrip("/")
                if not os.access(base, os.W_OK):
                    continue
                root = base / GROUP_NAME
                try:
                    root.mkdir(exist_ok=True)
                except OSError:
                    continue
                if controller == "pids" or (root / probe).exists() or (base / probe).exists():
                    roots[controller] = root
                    break
        if "pids" not in roots:  # the kill loop needs the pids hierarchy at least
            return {}
        return roots

    def cgroup_for(self, boot_tag: str, sandbox_id: str) -> Cgroup | None:
        """The cgroup a sandbox has (or had): used for teardown and the orphan sweep."""
        if self.kind == "cgroup-v2" and self.v2_root is not None:
            return Cgroup(2, [self.v2_root / boot_tag / sandbox_id])
        if self.kind == "cgroup-v1":
            return Cgroup(1, [root / boot_tag / sandbox_id for root in self.v1_roots.values()])
        return None

    def reserve(self, boot_tag: str, sandbox_id: str) -> Cgroup | None:
        """Make a sandbox's cgroup (no limits yet); None when limits are rlimits."""
        cgroup = self.cgroup_for(boot_tag, sandbox_id)
        if cgroup is None:
            return None
        try:
            for d in cgroup.dirs:
                for attempt in range(5):  # a closing sandbox may remove the empty parent
                    d.parent.mkdir(exist_ok=True)
                    try:
                        d.mkdir()
                        break
                    except FileNotFoundError:
                        if attempt == 4:
                            raise
        except OSError as exc:
            cgroup.remove()
            raise SandboxStartError(f"cannot set up cgroup for sandbox {sandbox_id}: {exc}") from exc
        return cgroup

    def create(self, cgroup: Cgroup | None, spec: SandboxSpec) -> LimitPlan:
        """The sandbox's plan: the spec's limits written to its ``reserve``d cgroup, or
        (no cgroup) the rlimits the helper sets on itself."""
        mech = {"memory": "off", "pids": "off", "cpu": "off"}
        if cgroup is None:
            rlimits = {}
            if spec.memory_mb:
                rlimits["RLIMIT_AS"] = spec.memory_mb << 20
                mech["memory"] = "rlimit-as"
            if spec.pids_max:
                rlimits["RLIMIT_NPROC"] = spec.pids_max
                mech["pids"] = "rlimit-nproc" if os.geteuid() != 0 else "unenforced (root)"
            if spec.cpu_cores:
                mech["cpu"] = "unenforced"
            return LimitPlan(mech, None, rlimits)
        try:
            self._apply(cgroup, spec, mech)
        except OSError as exc:
            raise SandboxStartError(f"cannot set the sandbox's limits in {cgroup.dirs[0]}: "
                                    f"{exc}") from exc
        return LimitPlan(mech, cgroup)

    def _apply(self, cgroup: Cgroup, spec: SandboxSpec, mech: dict[str, str]) -> None:
        if cgroup.version == 2:
            d = cgroup.dirs[0]
            if spec.memory_mb:
                # no memory.oom.group: an OOM kill takes the process the kernel picks (a
                # command before the helper: see _helper.Helper.protect), not the sandbox
                _write(d / "memory.max", str(spec.memory_mb << 20))
                with contextlib.suppress(FileNotFoundError):
                    _write(d / "memory.swap.max", "0")
                mech["memory"] = "cgroup-v2"
            if spec.pids_max:
                _write(d / "pids.max", str(spec.pids_max))
                mech["pids"] = "cgroup-v2"
            if spec.cpu_cores and (d / "cpu.max").exists():
                _write(d / "cpu.max", f"{int(spec.cpu_cores * _CPU_PERIOD_US)} {_CPU_PERIOD_US}")
                mech["cpu"] = "cgroup-v2"
            return
        by_ctrl = dict(zip(self.v1_roots, cgroup.dirs, strict=True))
        if spec.memory_mb and "memory" in by_ctrl:
            d = by_ctrl["memory"]
            limit = str(spec.memory_mb << 20)
            _write(d / "memory.limit_in_bytes", limit)
            if (d / "memory.memsw.limit_in_bytes").exists():
                _write(d / "memory.memsw.limit_in_bytes", limit)  # swap included
            with contextlib.suppress(OSError):
                _write(d / "memory.swappiness", "0")
            mech["memory"] = "cgroup-v1"
        if spec.pids_max and "pids" in by_ctrl:
            _write(by_ctrl["pids"] / "pids.max", str(spec.pids_max))
            mech["pids"] = "cgroup-v1"
        if spec.cpu_cores and "cpu" in by_ctrl:
            d = by_ctrl["cpu"]
            _write(d / "cpu.cfs_period_us", str(_CPU_PERIOD_US))
            _write(d / "cpu.cfs_quota_us", str(int(spec.cpu_cores * _CPU_PERIOD_US)))
            mech["cpu"] = "cgroup-v1"

    @staticmethod
    async def release(cgroup: Cgroup | None, timeout_s: float = 2.0) -> bool:
        """Kill what is left in a cgroup and remove it; False if it stayed busy."""
        if cgroup is None:
            return True
        with trio.move_on_after(timeout_s):
            while True:
                cgroup.kill()
                if cgroup.remove():
                    return True
                await trio.sleep(0.005)
        log.warning("cgroup %s still busy after %.1f s", cgroup.dirs, timeout_s)
        return False

    def boot_dirs(self) -> list[Path]:
        """Every ``<root>/rolloutd`` dir in use (for the sweep)."""
        if self.kind == "cgroup-v2" and self.v2_root is not None:
            return [self.v2_root]
        return list(self.v1_roots.values())
