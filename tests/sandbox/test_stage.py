"""Image sandboxes whose helper builds the root (sandbox/_stage.py): bwrap's staging
options, the plan the helper follows, and that a failure to build it fails the open,
with nothing left behind and nothing run with a capability."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rolloutd.sandbox import Bind, SandboxSpec, SandboxStartError, _bwrap
from rolloutd.sandbox._backend import Handle
from rolloutd.sandbox._bwrap import stage_plan, staging_options
from rolloutd.sandbox._layout import SandboxDirs
from rolloutd.sandbox._runtime import Runtime

RUNTIME = Runtime(Path("/s/lib/rt-abc"), "/usr/lib/python3.11", "3.11")
HANDLE = Handle(SandboxDirs("box1", "boot", Path("/s/sandboxes/boot/box1"), -1))
KW = {"lib_dir": "/s/lib/0123", "runtime": RUNTIME}


def pairs(argv: list[str], option: str) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == option]


def test_a_parked_image_sandboxs_staging_root_needs_no_spec():
    argv = staging_options(None, HANDLE, store="/s/images", **KW)
    binds = [p for p in pairs(argv, "--ro-bind") if not p[0].startswith("/proc/")]  # root
    assert binds == [("/s/images", "/s/images"), ("/s/lib", "/s/lib"),
                                        ("/usr/lib/python3.11", "/s/lib/rt-abc/lib/python3.11")]
    assert pairs(argv, "--bind") == [("/s/sandboxes/boot/box1/c",) * 2,
                                     ("/s/sandboxes/boot/box1/ws",) * 2]
    for part in (["--unshare-all", "--unshare-user", "--disable-userns", "--uid", "0"],
                 ["--as-pid-1", "--die-with-parent", "--new-session", "--cap-add", "ALL",
                  "--clearenv"]):
        assert " ".join(part) in " ".join(argv)
    assert "--share-net" not in argv and "--cap-drop" not in argv
    assert argv[argv.index("--dir") + 1] == "/.stage"


def test_a_specs_binds_and_network_are_staged():
    spec = SandboxSpec(image="x", network=True,
                       binds=[Bind(host="/data", dest="/data"), Bind(host="/rw", dest="/mnt/rw",
                                                                     readonly=False)])
    argv = staging_options(spec, HANDLE, store="/s/images", **KW)
    assert ("/data", "/.binds/0") in pairs(argv, "--ro-bind")
    assert ("/rw", "/.binds/1") in pairs(argv, "--bind")
    assert "--share-net" in argv
    assert "--share-net" in staging_options(None, HANDLE, store="/s/images", netns=True, **KW)


def test_the_plan_mounts_as_bwrap_would_for_the_host_root():
    spec = SandboxSpec(image="x", disk_mb=64, workdir="/work",
                       binds=[Bind(host="/data", dest="/data")])
    plan = stage_plan(spec, HANDLE, rootfs="/s/images/layers/ab", state_dir="/s", **KW)
    assert plan["lower"] == "/s/images/layers/ab" and plan["upper_bytes"] == 64 << 20
    assert [p for p, _ in plan["tmpfs"]] == ["/tmp", "/dev/shm", "/run"]
    assert plan["tmpfs"][0][1] == 64 << 20  # /tmp is capped by disk_mb too
    assert plan["hide"] == "/s"
    assert plan["binds"] == [["/s/lib", "/s/lib"],  # the stdlib bind under it comes along
                             ["/s/sandboxes/boot/box1/c", "/s/sandboxes/boot/box1/c"],
                             ["/s/sandboxes/boot/box1/ws", "/work"], ["/.binds/0", "/data"]]
    default = stage_plan(SandboxSpec(image="x"), HANDLE, rootfs="/r", state_dir="/s", **KW)
    assert default["upper_bytes"] == _bwrap.OVERLAY_DEFAULT_MB << 20


@pytest.mark.parametrize("spares", [0, 1])
async def test_a_root_that_cannot_be_built_fails_the_open(image_bwrap, test_images, monkeypatch,
                                                          spares):
    """Parked or not, a helper that cannot build its root exits before anything runs, and
    the open says why (here: an overlay over a lower dir that does not exist)."""
    ref = test_images.oci_ref(test_images.debian_oci)
    image_bwrap.spares = spares
    try:
        async with image_bwrap.open(SandboxSpec(image=ref)):
            pass  # parks an image sandbox when spares=1
        assert sum(h.prestarted for h in image_bwrap._spares) == spares
        real = _bwrap.stage_plan

        def broken(*args, **kwargs):
            return {**real(*args, **kwargs), "lower": "/nonexistent/rootfs"}

        monkeypatch.setattr(_bwrap, "stage_plan", broken)
        with pytest.raises(SandboxStartError, match="cannot set up the sandbox's root"):
            async with image_bwrap.open(SandboxSpec(image=ref)):
                pass
        monkeypatch.undo()
        async with image_bwrap.open(SandboxSpec(image=ref)) as sb:  # the next one works
            assert (await sb.run(["cat", "/etc/rolloutd-image"], timeout_s=30)).stdout \
                == b"debian\n"
    finally:
        await image_bwrap.aclose()


def test_a_failing_call_is_a_stage_error_with_its_errno():
    """The helper's own ``_ctypes`` lookup (ints come back as C ints: -1 is -1)."""
    from rolloutd.sandbox import _helper, _stage

    calls = _stage.Calls(_helper.libc)
    with pytest.raises(_stage.StageError,
                       match=r"umount2\('/nonexistent/x', 0\): (No such file|Operation not perm)"):
        calls.umount2(b"/nonexistent/x", 0)


async def test_a_capped_workspace_as_root_is_never_a_parked_image_sandboxs(image_bwrap,
                                                                          test_images):
    """As root ``disk_mb`` mounts a tmpfs on the host's workspace dir when the sandbox opens;
    a parked image sandbox's staging root was made before that, so such a spec starts on
    demand and its workspace is the capped tmpfs."""
    ref = test_images.oci_ref(test_images.debian_oci)
    image_bwrap.spares = 1
    try:
        async with image_bwrap.open(SandboxSpec(image=ref)):
            pass
        assert sum(h.prestarted for h in image_bwrap._spares) == 1
        async with image_bwrap.open(SandboxSpec(image=ref, disk_mb=16)) as sb:
            parked = sum(h.prestarted for h in image_bwrap._spares)
            assert parked == (1 if os.geteuid() == 0 else 0)
            r = await sb.run(["sh", "-c", "dd if=/dev/zero of=/workspace/f bs=1M count=40; "
                              "stat -f -c %T /workspace"], timeout_s=60)
            if os.geteuid() == 0:
                assert b"No space left" in r.stderr and r.stdout == b"tmpfs\n", r
    finally:
        await image_bwrap.aclose()
