"""The helper's private interpreter: runs in any root file system, with or without a Python
or a glibc of its own.

A copy of the helper's Python binary, the dynamic loader and every shared library the
binary and its extension modules need lives under ``<state_dir>/lib/rt-<digest>/``::

    ld.so                 the loader, run explicitly (an image may have none at /lib64)
    so/                   the libraries (libc, libm, libz, libffi, ...), via --library-path
    bin/python3.X         the interpreter; it finds its stdlib from its own location:
    lib/python3.X/        an empty mount point: the host's stdlib is bound here read-only

Inside a sandbox the runtime dir sits at its host path, read-only, so the helper's argv is
the same whatever the sandbox's root is (a parked launcher is started before its spec is
known). ``--library-path`` is not inherited: the helper's children are the image's own
programs, run with the image's loader and libraries.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ._exceptions import SandboxStartError

_PROBE = ("import sys, sysconfig; print(sysconfig.get_path('stdlib')); "
          "print(sys.version_info[0], sys.version_info[1])")
_LIB_LINE = re.compile(r"=>\s+(/\S+)\s+\(0x")
_LOADER_LINE = re.compile(r"^\s*(/\S*ld-linux\S*)\s+\(0x", re.M)


@dataclass(frozen=True, slots=True)
class Runtime:
    """A private interpreter under ``root``; ``stdlib`` is the host dir bound at
    ``stdlib_mount``."""

    root: Path
    stdlib: str
    version: str  # "3.11"

    @property
    def loader(self) -> str:
        return str(self.root / "ld.so")

    @property
    def python(self) -> str:
        return str(self.root / "bin" / f"python{self.version}")

    @property
    def stdlib_mount(self) -> str:
        return str(self.root / "lib" / f"python{self.version}")

    def argv(self) -> list[str]:
        """The argv prefix that runs this interpreter inside any root."""
        return [self.loader, "--library-path", str(self.root / "so"), self.python]

    def bind_args(self) -> list[str]:
        """bwrap options that show the runtime at its host path (read-only)."""
        return ["--ro-bind", str(self.root), str(self.root),
                "--ro-bind", self.stdlib, self.stdlib_mount]


def build_runtime(lib_root: Path, python: str) -> Runtime:
    """Make (once per interpreter build) the private runtime of ``python`` under
    ``lib_root``. Blocking (a probe and ``ldd``, ~0.2 s the first time): call it
    from a thread or before the event loop's hot path."""
    binary = os.path.realpath(python)
    try:
        st = os.stat(binary)
    except OSError as exc:
        raise SandboxStartError(f"helper interpreter {python}: {exc}") from exc
    key = hashlib.sha256(f"{binary}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    root = lib_root / f"rt-{key}"
    meta = root / "runtime.json"
    if meta.exists():
        info = json.loads(meta.read_text())
        return Runtime(root, info["stdlib"], info["version"])
    probe = _run([binary, "-I", "-S", "-c", _PROBE]).split("\n")
    stdlib, version = probe[0], ".".join(probe[1].split())
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "so").mkdir(parents=True)
    (tmp / "bin").mkdir()
    (tmp / "lib" / f"python{version}").mkdir(parents=True)
    dynload = Path(stdlib) / "lib-dynload"
    modules = sorted(str(p) for p in dynload.glob("*.so")) if dynload.is_dir() else []
    listing = _run(["ldd", binary, *modules])
    loaders = _LOADER_LINE.findall(listing)
    if not loaders:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SandboxStartError(f"cannot find the dynamic loader of {binary} (ldd said: "
                                f"{listing[:300]!r})")
    shutil.copy2(os.path.realpath(loaders[0]), tmp / "ld.so")
    for lib in sorted(set(_LIB_LINE.findall(listing))):
        dest = tmp / "so" / os.path.basename(lib)
        if not dest.exists():
            shutil.copy2(os.path.realpath(lib), dest)
    shutil.copy2(binary, tmp / "bin" / f"python{version}")
    for path in [tmp, *tmp.rglob("*")]:
        if path.is_dir():
            path.chmod(0o755)
        else:
            path.chmod(0o755 if path.parent.name in ("bin",) or path.name == "ld.so" else 0o644)
    (tmp / "runtime.json").write_text(json.dumps({"stdlib": stdlib, "version": version,
                                                  "python": binary}))
    try:
        tmp.rename(root)
    except OSError:  # another daemon won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return Runtime(root, stdlib, version)


def _run(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, timeout=60, check=False,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxStartError(f"`{argv[0]}` failed: {exc}") from exc
    if out.returncode != 0 and argv[0] != "ldd":  # ldd exits 1 when one file is static
        raise SandboxStartError(f"`{' '.join(argv[:2])}` failed: "
                                f"{out.stderr.decode(errors='replace')[-500:]}")
    return out.stdout.decode(errors="replace").strip()
