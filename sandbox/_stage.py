"""An image sandbox's root, built by its helper before anything of the sandbox runs, and
then every capability dropped.

bwrap starts an image sandbox on a *staging* root: a tmpfs holding the sandbox's /dev and
/proc, the image store (read-only), the helper's lib dir and interpreter (read-only), the
control dir, the workspace, and the spec's binds at ``/.binds/<n>``. Every namespace is
new, as for any sandbox, and the helper keeps its capabilities *in its own user
namespace* (``--cap-add ALL``; none on the host). ``enter(stage)`` then does what bwrap's
``--overlay-src`` and mount options did before (2026-11-29): a mount namespace of the
helper's own, a size-capped tmpfs for the overlay's writable layer, the overlay of the
image's rootfs, the sandbox's /proc, /dev, /tmp, /dev/shm, /run, the state dir hidden under
a read-only tmpfs, the binds, ``pivot_root`` into the overlay and the staging root
detached. ``drop_capabilities()`` then empties every capability set (the bounding set
first, so that no exec can regain any, even as uid 0) and sets no_new_privs, and checks
``/proc/self/status`` says so; if anything fails the helper exits and the open fails:
nothing of the sandbox runs with a capability.

Why the helper and not bwrap: a sandbox whose helper is already running can be parked
before its image is known (sandbox/_bwrap.py), so an open no longer pays for bwrap and an
interpreter start (about 10 of an open's 12 ms here). The same code builds every image
sandbox, parked or not.

Stdlib C modules only (``posix``, ``_ctypes``), like the helper, which imports this only
for an image sandbox; Python >= 3.9.
"""

import posix
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
#: Where the staging root keeps the overlay's tmpfs (bwrap makes the dir).
STAGE_DIR = "/.stage"
#: Where the staging root shows the spec's binds, by index (bwrap binds them there).
BINDS_DIR = "/.binds"
CAP_LINES = ("CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:")


class StageError(Exception):
    """A step of building the root failed: the helper reports it and exits."""


class Calls:
    """The C library's functions staging needs, each raising StageError (with errno) when
    it returns -1; ``libc(name)`` is the helper's ``_ctypes`` lookup. Made once, before a
    parked helper waits."""

    def __init__(self, libc: "Callable[[str], Callable[..., int]]") -> None:
        self.unshare = _checked(libc, "unshare")
        self.mount = _checked(libc, "mount")
        self.umount2 = _checked(libc, "umount2")
        self.pivot_root = _checked(libc, "pivot_root")
        self.prctl = _checked(libc, "prctl")
        self.capset = _checked(libc, "capset")


def _checked(libc: "Callable[[str], Callable[..., int]]", name: str) -> "Callable[..., int]":
    import _ctypes

    function = libc(name)

    def call(*args: "Any") -> int:
        result = function(*args)
        if result == -1:
            shown = tuple(a.decode(errors="replace") if isinstance(a, bytes) else a for a in args)
            raise StageError(f"{name}{shown}: {posix.strerror(_ctypes.get_errno())}")
        return result

    return call


def _b(path: str) -> bytes:
    return path.encode("utf-8", "surrogateescape")


def _mkdirs(path: str) -> None:
    """``mkdir -p`` (0755)."""
    parts = [p for p in path.split("/") if p]
    current = ""
    for part in parts:
        current += "/" + part
        try:
            posix.mkdir(current, 0o755)
        except FileExistsError:
            pass


def _mount_point(src: str, dest: str) -> None:
    """An empty dir (for a dir) or file (for anything else) at ``dest`` to mount ``src`` on."""
    if posix.stat(src).st_mode & 0o170000 == 0o040000:
        _mkdirs(dest)
        return
    _mkdirs(dest.rsplit("/", 1)[0] or "/")
    try:
        posix.close(posix.open(dest, posix.O_WRONLY | posix.O_CREAT | posix.O_CLOEXEC, 0o644))
    except IsADirectoryError:
        pass


def _tmpfs(calls: Calls, path: str, size: int) -> None:
    calls.mount(b"tmpfs", _b(path), b"tmpfs", MS_NOSUID | MS_NODEV,
                f"size={int(size)},mode=0755".encode())


def _check_option_path(path: str) -> str:
    # overlayfs splits its options at ',' and its lowerdir at ':'
    if "," in path or ":" in path or "\\" in path:
        raise StageError(f"cannot use {path!r} in overlay options (',', ':' or '\\\\')")
    return path


def enter(stage: "dict[str, Any]", calls: Calls) -> None:
    """Build the root ``stage`` describes and ``pivot_root`` into it (see the module doc).
    ``stage``: ``lower`` (the image's rootfs), ``upper_bytes`` (the writable layer's
    cap), ``tmpfs`` ([path, bytes] fresh mounts, in order), ``hide`` (a dir hidden under a
    read-only tmpfs), ``binds`` ([source in the staging root, dest] recursive binds that
    keep their source's flags, in order)."""
    calls.unshare(CLONE_NEWNS)  # a mount namespace owned by our user namespace
    calls.mount(None, b"/", None, MS_REC | MS_PRIVATE, None)
    _tmpfs(calls, STAGE_DIR, stage["upper_bytes"])
    upper, work, root = (f"{STAGE_DIR}/{n}" for n in ("upper", "work", "root"))
    for path in (upper, work, root):
        posix.mkdir(path, 0o755)
    options = (f"lowerdir={_check_option_path(stage['lower'])},upperdir={upper},workdir={work},"
               "userxattr")
    calls.mount(b"overlay", _b(root), b"overlay", MS_NOSUID | MS_NODEV, options.encode())
    for path in ("/proc", "/dev"):
        _mkdirs(root + path)
        calls.mount(_b(path), _b(root + path), None, MS_BIND | MS_REC, None)
    for path, size in stage["tmpfs"]:
        _mkdirs(root + path)
        _tmpfs(calls, root + path, size)
    hide = stage.get("hide")
    if hide:
        _mkdirs(root + hide)
        _tmpfs(calls, root + hide, 1 << 20)
    for src, dest in stage["binds"]:
        _mount_point(src, root + dest)
        calls.mount(_b(src), _b(root + dest), None, MS_BIND | MS_REC, None)
    if hide:
        calls.mount(None, _b(root + hide), None,
                    MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    posix.chdir(root)
    calls.pivot_root(b".", b".")  # the old root now sits on top of the new one
    calls.umount2(b".", MNT_DETACH)
    posix.chdir("/")


def drop_capabilities(calls: Calls) -> None:
    """Empty every capability set (bounding first: then no exec regains any, even as uid
    0), clear the ambient set, set no_new_privs; raise StageError unless
    ``/proc/self/status`` then shows every set empty and no_new_privs on."""
    with open("/proc/sys/kernel/cap_last_cap", "rb") as f:
        last = int(f.read())
    for cap in range(last + 1):
        calls.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    calls.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = LINUX_CAPABILITY_VERSION_3.to_bytes(4, sys.byteorder) + bytes(4)  # pid 0: us
    calls.capset(header, bytes(24))  # effective, permitted, inheritable: all zero
    calls.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    check_dropped()


def check_dropped() -> None:
    with open("/proc/self/status", "rb") as f:
        status = f.read().decode()
    found = {}
    for line in status.splitlines():
        key, _, value = line.partition("\t")
        found[key] = value.strip()
    left = [k for k in CAP_LINES if int(found.get(k, "1"), 16) != 0]
    if left or found.get("NoNewPrivs:") != "1":
        raise StageError(f"capabilities not dropped: {[(k, found.get(k)) for k in left]}, "
                         f"NoNewPrivs {found.get('NoNewPrivs:')}")
