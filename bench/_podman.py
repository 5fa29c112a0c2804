"""podman as the benchmarks' anchor: a private configuration and timed ``podman run``.

Imports nothing of rolloutd. Nothing under /etc is read or changed for our settings: the
configuration lives in a directory of its own (``CONTAINERS_CONF`` and
``CONTAINERS_STORAGE_CONF`` point there), and so do the image store and podman's state.
See docs/sandbox.md ("Benchmark: bench/images.py") for why each setting is needed here.

    pm = prepare_podman(Path("/tmp/pm"))
    image = load_oci(pm, Path(".../busybox/oci"), "test", "localhost/rolloutd-busybox:test")
    seconds = time_runs(pm, image, 20)  # podman run --rm --network none IMAGE /bin/true
    reset(pm)
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: Default ulimits podman gives a container must not exceed what runc may set here: rootful
#: podman defaults to nofile 1048576 / nproc 4194304 and runc then fails with "error setting
#: rlimits for ready process: operation not permitted". These caps worked on this machine
#: (nproc at the hard limit 96365 did not; 32768 did).
NOFILE_CAP = 20000
NPROC_CAP = 32768


@dataclass(frozen=True)
class Podman:
    home: Path  # holds containers.conf, storage.conf, storage/, run/, tmp/, events.log
    env: dict[str, str]  # the environment to run podman with

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["podman", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"podman {' '.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
            )
        return proc


def _limit(which: int, cap: int) -> int:
    hard = resource.getrlimit(which)[1]
    return cap if hard == resource.RLIM_INFINITY else min(hard, cap)


def prepare_podman(home: Path, *, driver: str = "overlay", runtime: str = "runc") -> Podman:
    """Write a private podman configuration under ``home`` and return how to call podman.

    Settings (containers.conf): runc (crun refuses this machine's hybrid cgroup layout),
    cgroup_manager cgroupfs (no systemd), events_logger file, netns none (the default bridge
    network would add host iptables chains), default ulimits within the hard limits.
    storage.conf: ``driver`` (overlay works as root here) with graphroot/runroot under home."""
    if shutil.which("podman") is None:
        raise RuntimeError("podman is not installed (apt-get install podman runc)")
    home = home.absolute()
    for d in ("storage", "run", "tmp"):
        (home / d).mkdir(parents=True, exist_ok=True)
    nofile = _limit(resource.RLIMIT_NOFILE, NOFILE_CAP)
    nproc = _limit(resource.RLIMIT_NPROC, NPROC_CAP)
    (home / "containers.conf").write_text(
        "[containers]\n"
        'netns = "none"\n'
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        "[engine]\n"
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "file"\n'
        f'events_logfile_path = "{home / "events.log"}"\n'
        f'runtime = "{runtime}"\n'
        f'tmp_dir = "{home / "tmp"}"\n'
    )
    (home / "storage.conf").write_text(
        "[storage]\n"
        f'driver = "{driver}"\n'
        f'graphroot = "{home / "storage"}"\n'
        f'runroot = "{home / "run"}"\n'
    )
    env = dict(os.environ)
    env["CONTAINERS_CONF"] = str(home / "containers.conf")
    env["CONTAINERS_STORAGE_CONF"] = str(home / "storage.conf")
    return Podman(home=home, env=env)


def load_oci(pm: Podman, layout: Path, tag: str, name: str) -> str:
    """Copy the image ``layout:tag`` (an OCI layout) into podman's private store as
    ``name`` with ``skopeo copy oci:DIR:TAG containers-storage:NAME`` (skopeo reads the same
    CONTAINERS_STORAGE_CONF); returns ``name``. (``podman pull oci:DIR:TAG`` would name the
    image after the directory, which fails for a path with a dot such as ~/.cache.)"""
    proc = subprocess.run(
        ["skopeo", "copy", "--quiet", f"oci:{layout}:{tag}", f"containers-storage:{name}"],
        env=pm.env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"skopeo copy of {layout}:{tag} failed: {proc.stderr.strip()[-2000:]}")
    pm.run("image", "exists", name)
    return name


def time_runs(
    pm: Podman,
    image: str,
    n: int = 20,
    argv: Sequence[str] = ("/bin/true",),
    *,
    warmup: int = 1,
    extra: Sequence[str] = ("--network", "none"),
) -> list[float]:
    """Seconds of each of ``n`` ``podman run --rm EXTRA IMAGE ARGV`` (after ``warmup``
    untimed runs), wall clock from spawning podman to its exit."""
    out = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        pm.run("run", "--rm", *extra, image, *argv)
        dt = time.perf_counter() - t0
        if i >= warmup:
            out.append(dt)
    return out


def reset(pm: Podman) -> None:
    """Remove every container and image of the private store, then the directory."""
    subprocess.run(
        ["podman", "system", "reset", "--force"],
        env=pm.env,
        capture_output=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    shutil.rmtree(pm.home, ignore_errors=True)


if __name__ == "__main__":  # python -m bench._podman: p50 on the test images
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests._images import build_test_images

    imgs = build_test_images()
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    pm = prepare_podman(Path(tempfile.mkdtemp(prefix="rolloutd-podman-")))
    try:
        for label, layout in (("busybox", imgs.busybox_oci), ("debian", imgs.debian_oci)):
            image = load_oci(pm, layout, imgs.tag, f"localhost/rolloutd-{label}:test")
            secs = time_runs(pm, image, n)
            q = statistics.quantiles(secs, n=20)
            print(
                f"{label}: podman run --rm --network none {image} /bin/true: n={n} "
                f"p50={statistics.median(secs) * 1000:.0f} ms p95={q[18] * 1000:.0f} ms"
            )
    finally:
        reset(pm)
