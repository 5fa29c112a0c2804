"""bwrap runs container images: real images built on this machine (tests/_images.py), the
image's files as '/', writes on a throwaway overlay, the helper with its own interpreter
(a busybox image has no Python), the image's Env and WorkingDir, and the tools inside."""

from __future__ import annotations

import os

import pytest
import trio

from rolloutd.sandbox import ImageError, ImageNotFound, SandboxSpec
from rolloutd.tools import open_toolbox
from tests._images import LAYERED_EXPECT, LAYERED_GONE, MARKER


def refs(images) -> dict[str, str]:
    return {
        "debian-oci": images.oci_ref(images.debian_oci),
        "debian-docker-archive": f"docker-archive:{images.debian_tar}",
        "debian-sif": f"sif:{images.debian_sif}",
        "busybox": images.oci_ref(images.busybox_oci),
    }


@pytest.mark.parametrize("which", ["debian-oci", "debian-docker-archive", "debian-sif", "busybox"])
async def test_the_sandbox_sees_the_images_files(image_bwrap, test_images, which):
    ref = refs(test_images)[which]
    name = which.split("-")[0]
    async with image_bwrap.open(SandboxSpec(image=ref)) as sb:
        r = await sb.run(["cat", f"/{MARKER}"], timeout_s=30)
        assert (r.exit_code, r.stdout) == (0, f"{name}\n".encode()), r
        assert not os.path.exists(f"/{MARKER}")  # the host has no such file
        r = await sb.run(["sh", "-c", "id -u; echo $ROLLOUTD_IMAGE; pwd"], timeout_s=10)
        uid, env, cwd = r.stdout.decode().split("\n")[:3]
        assert uid == "0"
        if which != "debian-sif":  # a SIF carries no OCI config
            assert env == name
        # busybox's WorkingDir is /work; debian's is "/": the workspace stays the start
        assert cwd == ("/work" if name == "busybox" else "/workspace")
        assert sb.limits["overlay"] == "tmpfs-size"


async def test_cwd_starts_processes_in_the_image_and_is_a_file_root(image_bwrap, test_images):
    spec = SandboxSpec(image=refs(test_images)["debian-oci"], cwd="/usr/share")
    async with image_bwrap.open(spec) as sb:
        assert sb.workdir == "/usr/share"
        r = await sb.run(["pwd"], timeout_s=10)
        assert r.stdout == b"/usr/share\n", r
        await sb.write_file("added.txt", b"in the overlay")  # relative: under cwd
        assert await sb.read_file("/usr/share/added.txt") == b"in the overlay"
        await sb.write_file("/workspace/w.txt", b"w")  # the workspace stays a root
        assert (await sb.run(["cat", "/workspace/w.txt"], timeout_s=10)).stdout == b"w"


async def test_helper_runs_in_an_image_without_python_or_glibc(image_bwrap, test_images):
    async with image_bwrap.open(SandboxSpec(image=refs(test_images)["busybox"])) as sb:
        r = await sb.run(["sh", "-c", "ls /usr/bin/python3 /usr/lib/python3* 2>&1; echo $PATH"],
                         timeout_s=10)
        assert b"No such file" in r.stdout and r.stdout.endswith(b"/bin:/usr/bin\n")
        # the image's libc is musl; it has no glibc loader (the helper brought its own)
        r = await sb.run(["/lib/ld-musl-x86_64.so.1"], timeout_s=10)
        assert b"musl libc" in r.stdout + r.stderr, r
        r = await sb.run(["ls", "/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu"],
                         timeout_s=10)
        assert r.exit_code != 0 and r.stdout == b"", r
        await sb.write_file("/work/hello.txt", b"hi\n")  # file ops go through the helper
        assert (await sb.run(["cat", "/work/hello.txt"], timeout_s=10)).stdout == b"hi\n"
        assert await sb.read_file("/work/hello.txt") == b"hi\n"
        proc = await sb.spawn(["sleep", "30"])
        await proc.signal(9)
        assert await proc.wait() == -9


async def test_writes_go_to_the_overlay_are_private_and_vanish(image_bwrap, test_images,
                                                               image_store):
    ref = refs(test_images)["debian-oci"]
    async with image_bwrap.open(SandboxSpec(image=ref)) as a, \
            image_bwrap.open(SandboxSpec(image=ref)) as b:
        r = await a.run(["sh", "-c", "echo mine > /etc/rolloutd-image; rm /bin/ls; "
                         "echo new > /usr/new-file; cat /etc/rolloutd-image"], timeout_s=10)
        assert r.stdout == b"mine\n"
        r = await b.run(["sh", "-c", "cat /etc/rolloutd-image; ls /usr/new-file; ls -d /bin/ls"],
                        timeout_s=10)
        assert r.stdout.startswith(b"debian\n") and b"/bin/ls" in r.stdout
        assert b"No such file" in r.stderr  # b does not see a's new file
    rootfs = (await trio.to_thread.run_sync(image_store.resolve, ref)).rootfs
    assert (rootfs / MARKER).read_text() == "debian\n"  # the store's copy is untouched
    assert not (rootfs / "usr/new-file").exists() and (rootfs / "bin/ls").exists()
    async with image_bwrap.open(SandboxSpec(image=ref)) as c:
        r = await c.run(["sh", "-c", "cat /etc/rolloutd-image; ls /usr/new-file"], timeout_s=10)
        assert r.stdout == b"debian\n" and r.exit_code != 0


async def test_whiteouts_and_opaque_dirs_hide_lower_files(image_bwrap, test_images):
    async with image_bwrap.open(SandboxSpec(image=test_images.oci_ref(test_images.layered_oci))) as sb:
        for path, text in LAYERED_EXPECT.items():
            r = await sb.run(["cat", "/" + path], timeout_s=10)
            assert r.stdout == text.encode(), path
        for path in LAYERED_GONE:
            r = await sb.run(["ls", "/" + path], timeout_s=10)
            assert r.exit_code != 0, path


async def test_tools_run_in_the_image(image_bwrap, test_images):
    ref = refs(test_images)["debian-oci"]
    async with image_bwrap.open(SandboxSpec(image=ref, lifetime_s=300)) as sb, \
            open_toolbox(sb, ["bash", "ipython", "editor"]) as tb:
        out = await tb.call("bash", {"command": "cat /etc/rolloutd-image && python3 -c "
                                     "'import sys; print(sys.version_info[:2])' && cd /root && pwd"}, timeout_s=60)
        assert out.ok and out.output.splitlines()[:3] == ["debian", "(3, 11)", "/root"], out
        out = await tb.call("bash", {"command": "pwd"}, timeout_s=60)  # the shell keeps its state
        assert out.output.strip() == "/root"
        out = await tb.call("editor", {"command": "create", "path": "/workspace/x.py",
                                       "file_text": "print('edited')\n"}, timeout_s=60)
        assert out.ok, out
        out = await tb.call("bash", {"command": "python3 /workspace/x.py"}, timeout_s=60)
        assert out.output.strip() == "edited"
        # the editor's roots are those over the host's root: the workdir, /tmp, the binds
        out = await tb.call("editor", {"command": "view", "path": "/etc/rolloutd-image"},
                            timeout_s=60)
        assert not out.ok, out
        out = await tb.call("ipython", {"code": "import sys, pathlib\n"
                                        "print(sys.executable, pathlib.Path('/etc/rolloutd-image').read_text())"}, timeout_s=60)
        assert out.ok and "/usr/bin/python3 debian" in out.output, out


async def test_an_image_that_cannot_be_read_fails_the_open(image_bwrap, state_dir, leak_check):
    with pytest.raises(ImageNotFound, match="does not exist"):
        async with image_bwrap.open(SandboxSpec(image="oci:/nonexistent/layout:x")):
            pass
    bad = state_dir / "bad.tar"
    bad.write_bytes(b"this is not a tarball" * 100)
    with pytest.raises(ImageError):
        async with image_bwrap.open(SandboxSpec(image=f"docker-archive:{bad}")):
            pass
    with pytest.raises(ImageNotFound):
        async with image_bwrap.open(SandboxSpec(image="no-such-name")):
            pass


async def test_filling_the_overlay_hits_enospc(image_bwrap, test_images):
    """As root and rootless (_rootless_images.py): the helper mounts the writable layer
    as a tmpfs of ``disk_mb``."""
    async with image_bwrap.open(SandboxSpec(image=refs(test_images)["debian-oci"],
                                            disk_mb=32, memory_mb=512)) as sb:
        r = await sb.run(["sh", "-c", "dd if=/dev/zero of=/var/fill bs=1M count=100"],
                         timeout_s=60)
        assert r.exit_code != 0 and b"No space left" in r.stderr
        assert (await sb.run(["rm", "/var/fill"], timeout_s=10)).exit_code == 0


async def test_two_refs_of_one_image_share_its_layer(image_store, test_images):
    one = await trio.to_thread.run_sync(image_store.resolve, refs(test_images)["debian-oci"])
    two = await trio.to_thread.run_sync(image_store.resolve,
                                        refs(test_images)["debian-docker-archive"])
    assert one.layers == two.layers and one.rootfs == two.rootfs
