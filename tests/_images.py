"""Real container images for the test suite and the benchmarks, built once on this machine.

``build_test_images()`` builds (or finds already built) under
``~/.cache/rolloutd-test-images/<VERSION>/`` (``ROLLOUTD_TEST_IMAGES`` overrides the parent
directory; CI may keep ``~/.cache`` between runs):

- ``debian``: a Debian bookworm rootfs (mmdebstrap, variant apt, with python3, pytest, git,
  ca-certificates; from the mirror apt is configured with, read at run time) as an OCI layout,
  a docker-archive tarball (skopeo) and a SIF (mksquashfs + siftool; no Apptainer).
- ``busybox``: a no-Python, no-glibc image (static busybox and its applet links in /bin,
  and musl as its libc: /lib/ld-musl-x86_64.so.1 from Debian's ``musl`` package) as an OCI
  layout with WorkingDir /work.
- ``layered``: a 3-layer OCI layout from the busybox rootfs: layer 1 the busybox rootfs
  (``umoci insert``), layer 2 a /data tree (``umoci insert``), layer 3 a layer tar written
  here with Python's tarfile and appended verbatim with ``umoci raw add-layer``: it deletes
  /data/remove-me (whiteout ``/data/.wh.remove-me``), replaces the contents of /data/dir
  (opaque marker ``/data/dir/.wh..wh..opq`` plus ``/data/dir/new``), adds /data/added and
  changes /etc/rolloutd-image to "layered". See LAYERED_EXPECT for the composed result.

Every rootfs has /etc/rolloutd-image holding the image's name, so a test can tell the
image's files from the host's. OCI layouts are tagged ``test``; their blobs are mode 0644
(umoci writes 0600) so an unprivileged reader can import them.

Building is idempotent and process-safe: one flock per version directory, each image built
in a temporary directory and renamed into place when complete. Change VERSION whenever a
recipe changes: the images are then rebuilt in a new directory.

This module imports nothing of rolloutd (benchmarks and other tools use it as is).
"""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rolloutd.test_images")

#: Bump on any change of a recipe below (the cache directory is named after it).
VERSION = "v3"
TAG = "test"
DEBIAN_SUITE = "bookworm"
# python3-ipykernel: the ipython tool runs the image's own kernel
DEBIAN_PACKAGES = ("python3", "python3-pytest", "python3-ipykernel", "git", "ca-certificates")
DEBIAN_ENV = (
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ROLLOUTD_IMAGE=debian",
)
BUSYBOX_ENV = ("PATH=/bin:/usr/bin", "ROLLOUTD_IMAGE=busybox")
LAYERED_ENV = ("PATH=/bin:/usr/bin", "ROLLOUTD_IMAGE=layered")
MARKER = "etc/rolloutd-image"
#: Offset of the primary partition in a SIF made by ``siftool new`` + ``siftool add``
#: (checked at build time against ``siftool list``; recorded in TestImages.debian_sif_offset).
SIF_DEFAULT_OFFSET = 32768

#: The composed /data of the ``layered`` image (path -> file content); absent paths must
#: not exist: /data/remove-me (whiteout), /data/dir/old-a and /data/dir/old-b (opaque dir).
LAYERED_EXPECT = {
    "data/keep": "kept from layer 2\n",
    "data/dir/new": "new in layer 3\n",
    "data/added": "added in layer 3\n",
    MARKER: "layered\n",
}
LAYERED_GONE = ("data/remove-me", "data/dir/old-a", "data/dir/old-b")

#: Debian package of each tool (for the error message when one is missing).
TOOL_PACKAGES = {
    "mmdebstrap": "mmdebstrap",
    "umoci": "umoci",
    "skopeo": "skopeo",
    "mksquashfs": "squashfs-tools",
    "unsquashfs": "squashfs-tools",
    "siftool": "siftool",
    "apt-get": "apt",
    "dpkg-deb": "dpkg",
}


class ImageBuildError(RuntimeError):
    """A test image could not be built; the message names the tool and its stderr tail."""


class ImageToolMissing(ImageBuildError):
    """A tool needed to build the test images is not installed."""


@dataclass(frozen=True)
class TestImages:
    """Paths of the built test images (all under ``root``)."""

    __test__ = False  # not a pytest test class

    root: Path
    tag: str
    debian_rootfs: Path  # the mmdebstrap directory (root-owned files), kept for bwrap tests
    debian_oci: Path  # OCI layout, tag ``tag``
    debian_tar: Path  # docker-archive, name localhost/rolloutd-debian:test
    debian_sif: Path  # SIF, primary system partition = squashfs of debian_rootfs
    debian_sif_offset: int  # byte offset of that squashfs in the SIF
    busybox_rootfs: Path
    busybox_oci: Path
    layered_oci: Path  # 3 layers, whiteout + opaque dir in the top one (LAYERED_EXPECT)

    def oci_ref(self, layout: Path) -> str:
        """``oci:PATH:TAG`` for one of the layouts."""
        return f"oci:{layout}:{self.tag}"


# ---------------------------------------------------------------------------- helpers


def default_cache() -> Path:
    env = os.environ.get("ROLLOUTD_TEST_IMAGES")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "rolloutd-test-images"


def require_tools(*tools: str) -> None:
    """Raise ImageToolMissing naming every tool of ``tools`` that is not on PATH."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pkgs = sorted({TOOL_PACKAGES.get(t, t) for t in missing})
        raise ImageToolMissing(
            f"test images need {', '.join(missing)} (not on PATH); "
            f"install the Debian packages: apt-get install {' '.join(pkgs)}"
        )


def run(argv: Sequence[str | os.PathLike[str]], *, timeout: float = 900, **kw: object) -> str:
    """Run a build tool; ImageBuildError with the tool and its stderr tail when it fails."""
    args = [os.fspath(a) for a in argv]
    require_tools(args[0])
    try:
        proc = subprocess.run(
            args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw
        )  # type: ignore[call-overload]
    except subprocess.TimeoutExpired as e:
        raise ImageBuildError(f"{args[0]} timed out after {timeout:.0f} s: {' '.join(args)}") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
        raise ImageBuildError(
            f"{args[0]} failed (exit {proc.returncode}): {' '.join(args)}\n{tail}"
        )
    return proc.stdout


@contextmanager
def step(name: str, timings: dict[str, float]) -> Iterator[None]:
    t0 = time.monotonic()
    log.info("test images: %s ...", name)
    yield
    timings[name] = round(time.monotonic() - t0, 2)
    log.info("test images: %s done in %.1f s", name, timings[name])


def debian_mirror() -> str:
    """The Debian mirror apt is configured with (``ROLLOUTD_DEBIAN_MIRROR`` overrides).

    Reads the deb822 ``.sources`` files (``URIs:`` of an entry whose ``Suites:`` list the
    suite) and then the one-line format (``deb URI SUITE ...``)."""
    env = os.environ.get("ROLLOUTD_DEBIAN_MIRROR")
    if env:
        return env
    candidates: list[str] = []
    for f in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        try:
            text = f.read_text()
        except OSError:
            continue
        for stanza in re.split(r"\n\s*\n", text):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line:
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
            if (
                "deb" in fields.get("types", "").split()
                and DEBIAN_SUITE in fields.get("suites", "").split()
            ):
                candidates.extend(fields.get("uris", "").split())
    lists = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*.list"))]
    for f in lists:
        try:
            lines = f.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            words = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
            if len(words) >= 3 and words[0] == "deb" and words[2] == DEBIAN_SUITE:
                candidates.append(words[1])
    if not candidates:
        raise ImageBuildError(
            f"no Debian mirror for {DEBIAN_SUITE} in the apt sources (/etc/apt/sources.list"
            "[.d]); set ROLLOUTD_DEBIAN_MIRROR"
        )
    return candidates[0]


def is_static_elf(path: Path) -> bool:
    """True for an ELF executable without a PT_INTERP program header (statically linked)."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit only
        return False
    little = data[5] == 1
    order = "little" if little else "big"
    phoff = int.from_bytes(data[0x20:0x28], order)
    phentsize = int.from_bytes(data[0x36:0x38], order)
    phnum = int.from_bytes(data[0x38:0x3A], order)
    for i in range(phnum):
        off = phoff + i * phentsize
        if int.from_bytes(data[off : off + 4], order) == 3:  # PT_INTERP
            return False
    return True


def fix_modes(layout: Path) -> None:
    """umoci writes blobs 0600: make the layout readable by everyone (0644 / dirs 0755)."""
    for dirpath, dirnames, filenames in os.walk(layout):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)


def oci_layout(rootfs: Path, layout: Path, env: Sequence[str], workdir: str) -> None:
    """An OCI layout at ``layout`` with one layer holding ``rootfs``, tagged TAG."""
    rootless = [] if os.geteuid() == 0 else ["--rootless"]
    image = f"{layout}:{TAG}"
    run(["umoci", "init", "--layout", layout])
    run(["umoci", "new", "--image", image])
    run(["umoci", "insert", *rootless, "--image", image, rootfs, "/"])
    configure(image, env, workdir)


def configure(image: str, env: Sequence[str], workdir: str) -> None:
    args = ["umoci", "config", "--image", image, "--config.workingdir", workdir]
    for e in env:
        args += ["--config.env", e]
    run(args)


def finish_layout(layout: Path) -> None:
    run(["umoci", "gc", "--layout", layout])
    fix_modes(layout)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextmanager
def building(final: Path) -> Iterator[Path]:
    """A fresh temporary directory beside ``final``, renamed to ``final`` on success."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    os.chmod(tmp, 0o755)  # readable by a non-root test user or daemon
    try:
        yield tmp
        (tmp / ".complete").write_text(VERSION + "\n")
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def complete(d: Path) -> bool:
    return (d / ".complete").is_file()


# ---------------------------------------------------------------------------- recipes


def build_debian(out: Path, timings: dict[str, float]) -> None:
    require_tools("mmdebstrap", "umoci", "skopeo", "mksquashfs", "siftool")
    rootfs = out / "rootfs"
    mirror = debian_mirror()
    with step("debian: mmdebstrap", timings):
        run(
            [
                "mmdebstrap",
                "--variant=apt",
                "--include=" + ",".join(DEBIAN_PACKAGES),
                # smaller and faster; nothing in the tests reads docs, man pages or locales
                "--dpkgopt=path-exclude=/usr/share/doc/*",
                "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/info/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*",
                "--dpkgopt=path-include=/usr/share/locale/locale.alias",
                DEBIAN_SUITE,
                rootfs,
                f"deb {mirror} {DEBIAN_SUITE} main",
            ],
            timeout=1200,
        )
        (rootfs / MARKER).write_text("debian\n")
    layout = out / "oci"
    with step("debian: oci layout (umoci)", timings):
        oci_layout(rootfs, layout, DEBIAN_ENV, "/")
        finish_layout(layout)
    with step("debian: docker-archive (skopeo)", timings):
        run(
            [
                "skopeo",
                "copy",
                "--quiet",
                f"oci:{layout}:{TAG}",
                f"docker-archive:{out / 'debian.tar'}:localhost/rolloutd-debian:{TAG}",
            ]
        )
        os.chmod(out / "debian.tar", 0o644)
    with step("debian: sif (mksquashfs + siftool)", timings):
        sqfs = out / "rootfs.sqfs"
        run(["mksquashfs", rootfs, sqfs, "-noappend", "-comp", "gzip", "-quiet"], timeout=1200)
        sif = out / "debian.sif"
        run(["siftool", "new", sif])
        run(
            [
                "siftool",
                "add",
                sif,
                sqfs,
                "--datatype",
                "4",
                "--parttype",
                "2",
                "--partfs",
                "1",
                "--partarch",
                "2",
            ]
        )
        sqfs.unlink()
        os.chmod(sif, 0o644)
        (out / "sif-offset").write_text(f"{sif_offset(sif)}\n")


def sif_offset(sif: Path) -> int:
    """Offset of the first partition (the squashfs) from ``siftool list``."""
    out = run(["siftool", "list", sif])
    for line in out.splitlines():
        cols = [c.strip() for c in line.split("|")]
        if len(cols) >= 5 and cols[0].isdigit() and "Squashfs" in cols[4]:
            m = re.match(r"(\d+)", cols[3])
            if m:
                return int(m.group(1))
    raise ImageBuildError(f"siftool list shows no partition in {sif}:\n{out}")


def busybox_binary(tmp: Path) -> Path:
    """A static busybox: the host's when it is static, else from `apt-get download`."""
    for cand in (Path("/bin/busybox"), Path("/usr/bin/busybox")):
        if cand.is_file() and is_static_elf(cand):
            return cand
    require_tools("apt-get", "dpkg-deb")
    run(["apt-get", "download", "busybox-static"], cwd=tmp)
    debs = sorted(tmp.glob("busybox-static_*.deb"))
    if not debs:
        raise ImageBuildError("apt-get download busybox-static left no .deb")
    run(["dpkg-deb", "-x", debs[0], tmp / "x"])
    for cand in (tmp / "x/bin/busybox", tmp / "x/usr/bin/busybox"):
        if cand.is_file():
            return cand
    raise ImageBuildError("busybox-static package holds no busybox binary")


def install_musl(rootfs: Path, scratch: Path) -> None:
    """musl as the image's libc (Debian's ``musl`` package; its libc.so is also its dynamic
    loader, and run as a program it prints its version)."""
    require_tools("apt-get", "dpkg-deb")
    run(["apt-get", "download", "musl"], cwd=scratch)
    debs = sorted(scratch.glob("musl_*.deb"))
    if not debs:
        raise ImageBuildError("apt-get download musl left no .deb")
    run(["dpkg-deb", "-x", debs[-1], scratch / "musl"])
    libc = scratch / "musl/lib/x86_64-linux-musl/libc.so"
    if not libc.is_file():
        raise ImageBuildError("the musl package holds no lib/x86_64-linux-musl/libc.so")
    (rootfs / "lib/x86_64-linux-musl").mkdir(parents=True)
    shutil.copy2(libc, rootfs / "lib/x86_64-linux-musl/libc.so")
    os.symlink("x86_64-linux-musl/libc.so", rootfs / "lib/ld-musl-x86_64.so.1")


def make_busybox_rootfs(rootfs: Path, scratch: Path) -> None:
    for d in ("bin", "etc", "root", "work", "usr/bin", "dev", "proc", "sys"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    (rootfs / "tmp").mkdir()
    os.chmod(rootfs / "tmp", 0o1777)
    os.chmod(rootfs / "root", 0o700)
    shutil.copy2(busybox_binary(scratch), rootfs / "bin/busybox")
    os.chmod(rootfs / "bin/busybox", 0o755)
    applets = run([rootfs / "bin/busybox", "--list"]).split()
    for name in applets:
        if name != "busybox" and not (rootfs / "bin" / name).exists():
            os.symlink("busybox", rootfs / "bin" / name)
    install_musl(rootfs, scratch)
    (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (rootfs / "etc/group").write_text("root:x:0:\n")
    (rootfs / MARKER).write_text("busybox\n")


def build_busybox(out: Path, timings: dict[str, float]) -> None:
    require_tools("umoci")
    rootfs = out / "rootfs"
    with step("busybox: rootfs", timings):
        scratch = Path(tempfile.mkdtemp(dir=out))
        make_busybox_rootfs(rootfs, scratch)
        shutil.rmtree(scratch)
    layout = out / "oci"
    with step("busybox: oci layout (umoci)", timings):
        oci_layout(rootfs, layout, BUSYBOX_ENV, "/work")
        finish_layout(layout)


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes | None = None, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.mtime = 0
    info.uid = info.gid = 0
    if data is None:
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
        tar.addfile(info)
    else:
        info.size = len(data)
        info.mode = mode
        tar.addfile(info, io.BytesIO(data))


def build_layered(busybox_rootfs: Path, out: Path, timings: dict[str, float]) -> None:
    require_tools("umoci")
    rootless = [] if os.geteuid() == 0 else ["--rootless"]
    layout = out / "oci"
    image = f"{layout}:{TAG}"
    with step("layered: oci layout (umoci insert x2 + raw add-layer)", timings):
        run(["umoci", "init", "--layout", layout])
        run(["umoci", "new", "--image", image])
        # layer 1: the busybox rootfs
        run(["umoci", "insert", *rootless, "--image", image, busybox_rootfs, "/"])
        # layer 2: /data with files to delete, a directory to replace, a file to keep
        data = out / "data"
        (data / "dir").mkdir(parents=True)
        (data / "remove-me").write_text("removed by layer 3\n")
        (data / "keep").write_text("kept from layer 2\n")
        (data / "dir/old-a").write_text("hidden by the opaque dir\n")
        (data / "dir/old-b").write_text("hidden by the opaque dir\n")
        run(["umoci", "insert", *rootless, "--image", image, data, "/data"])
        shutil.rmtree(data)
        # layer 3, written here: whiteout, opaque dir, added file, changed marker
        tar_path = out / "layer3.tar"
        with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
            _tar_add(tar, "data", None)
            _tar_add(tar, "data/.wh.remove-me", b"", 0o600)
            _tar_add(tar, "data/dir", None)
            _tar_add(tar, "data/dir/.wh..wh..opq", b"", 0o600)
            _tar_add(tar, "data/dir/new", LAYERED_EXPECT["data/dir/new"].encode())
            _tar_add(tar, "data/added", LAYERED_EXPECT["data/added"].encode())
            _tar_add(tar, "etc", None)
            _tar_add(tar, MARKER, LAYERED_EXPECT[MARKER].encode())
        run(["umoci", "raw", "add-layer", "--image", image, tar_path])
        tar_path.unlink()
        configure(image, LAYERED_ENV, "/work")
        finish_layout(layout)


# ---------------------------------------------------------------------------- entry point


def build_test_images(cache: Path | None = None) -> TestImages:
    """Build the test images once (or find them built) and return their paths.

    ``cache`` is the parent directory (default: ``ROLLOUTD_TEST_IMAGES`` or
    ``~/.cache/rolloutd-test-images``); the images live in ``cache/VERSION/``. Safe to call
    from several processes at once (they wait on one flock). Raises ImageToolMissing when a
    tool is not installed and ImageBuildError when a build step fails. Step times are logged
    (logger ``rolloutd.test_images``) and saved in ``VERSION/timings.json``."""
    root = (cache if cache is not None else default_cache()).absolute() / VERSION
    root.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    with locked(root.parent / f"{VERSION}.lock"):
        t0 = time.monotonic()
        if not complete(root / "busybox"):
            with building(root / "busybox") as tmp:
                build_busybox(tmp, timings)
        if not complete(root / "layered"):
            with building(root / "layered") as tmp:
                build_layered(root / "busybox/rootfs", tmp, timings)
        if not complete(root / "debian"):
            with building(root / "debian") as tmp:
                build_debian(tmp, timings)
        if timings:
            timings["total"] = round(time.monotonic() - t0, 2)
            old = {}
            if (root / "timings.json").is_file():
                old = json.loads((root / "timings.json").read_text())
            (root / "timings.json").write_text(json.dumps({**old, **timings}, indent=1) + "\n")
    deb = root / "debian"
    return TestImages(
        root=root,
        tag=TAG,
        debian_rootfs=deb / "rootfs",
        debian_oci=deb / "oci",
        debian_tar=deb / "debian.tar",
        debian_sif=deb / "debian.sif",
        debian_sif_offset=int((deb / "sif-offset").read_text()),
        busybox_rootfs=root / "busybox/rootfs",
        busybox_oci=root / "busybox/oci",
        layered_oci=root / "layered/oci",
    )


if __name__ == "__main__":  # python tests/_images.py: build and print the paths
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    imgs = build_test_images()
    for k, v in vars(imgs).items():
        print(f"{k}: {v}")
