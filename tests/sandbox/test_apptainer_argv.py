"""Apptainer command lines, checked where the binary is absent too (issue: B19)."""

from __future__ import annotations

import pytest

from rolloutd.sandbox import Bind, ImageNotFound, SandboxSpec, SandboxStartError, open_backend
from rolloutd.sandbox._apptainer import (
    ApptainerBackend,
    build_argv,
    build_source,
    exec_argv,
    instance_name,
    overlay_argv,
    pull_argv,
    sif_name,
    start_argv,
    stop_argv,
)

KW = dict(image="/img/py.sif", name="rld-boot-abc", workspace="/s/ws", control_dir="/s/c",
          lib_dir="/s/lib")


def test_instance_start_has_every_isolation_flag():
    argv = start_argv("apptainer", SandboxSpec(), overlay=None, **KW)
    assert argv[:4] == ["apptainer", "instance", "start", "--containall"]
    assert argv[argv.index("--no-mount") + 1] == "home,cwd,tmp" and "--no-home" in argv
    assert "--cleanenv" in argv
    i = argv.index("--net")
    assert argv[i + 1 : i + 3] == ["--network", "none"]
    assert "--writable-tmpfs" in argv
    binds = [argv[j + 1] for j, a in enumerate(argv) if a == "--bind"]
    assert binds == ["/s/ws:/workspace", "/s/c:/s/c", "/s/lib:/s/lib:ro"]
    assert argv[-2:] == ["/img/py.sif", "rld-boot-abc"]


def test_instance_start_variants():
    spec = SandboxSpec(network=True, workdir="/testbed",
                       binds=[Bind(host="/data", dest="/data"),
                              Bind(host="/out", dest="/out", readonly=False)])
    argv = start_argv("singularity", spec, overlay="/s/overlay.img", containall=False, **KW)
    assert argv[3:6] == ["--contain", "--pid", "--ipc"]
    assert "--net" not in argv and "--network" not in argv
    assert argv[argv.index("--overlay") + 1] == "/s/overlay.img"
    assert "--writable-tmpfs" not in argv
    binds = [argv[j + 1] for j, a in enumerate(argv) if a == "--bind"]
    assert binds == ["/s/ws:/testbed", "/s/c:/s/c", "/s/lib:/s/lib:ro", "/data:/data:ro",
                     "/out:/out"]


def test_exec_stop_overlay_pull_argv():
    helper = ["python3", "-I", "-S", "/s/lib/_helper.py", "{}"]
    assert exec_argv("apptainer", "rld-x", "/workspace", helper) == [
        "apptainer", "exec", "--cleanenv", "--pwd", "/workspace", "instance://rld-x", *helper]
    assert stop_argv("apptainer", "rld-x") == ["apptainer", "instance", "stop", "--timeout", "5",
                                               "rld-x"]
    assert stop_argv("apptainer", "rld-x", force=True)[-2:] == ["--force", "rld-x"]
    assert overlay_argv("apptainer", "/s/o.img", 512) == [
        "apptainer", "overlay", "create", "--sparse", "--size", "512", "/s/o.img"]
    assert pull_argv("apptainer", "/c/x.sif", "docker://python:3.11") == [
        "apptainer", "pull", "--force", "/c/x.sif", "docker://python:3.11"]
    assert instance_name("boot", "abc") == "rld-boot-abc"
    name = sif_name("docker://python:3.11-slim")
    assert name.startswith("python_3.11-slim-") and name.endswith(".sif")
    assert sif_name("docker://a") != sif_name("docker://b")


def test_bind_paths_are_validated():
    with pytest.raises(ValueError):
        Bind(host="/a:b", dest="/x")
    with pytest.raises(ValueError):
        Bind(host="relative", dest="/x")


def test_missing_binary_is_a_clear_start_error(state_dir):
    backend = open_backend("apptainer", state_dir=state_dir, boot_id="b",
                           apptainer="/nonexistent/apptainer")
    with pytest.raises(SandboxStartError, match="apptainer"):
        backend.check()


async def test_open_without_binary_fails_cleanly(state_dir, boot_id, leak_check):
    backend = open_backend("apptainer", state_dir=state_dir, boot_id=boot_id,
                           apptainer="/nonexistent/apptainer")
    with pytest.raises(SandboxStartError):
        async with backend.open(SandboxSpec(image="/img.sif")):
            pass


def test_image_sources_convert_with_apptainer_build(tmp_path):
    layout = tmp_path / "layout"
    layout.mkdir()
    (layout / "oci-layout").write_text("{}")
    tar = tmp_path / "img.tar"
    tar.write_bytes(b"x")
    assert build_source(f"oci:{layout}:v1") == f"oci:{layout}:v1"
    assert build_source(str(layout)) == f"oci:{layout}"
    assert build_source(str(tar)) == f"docker-archive:{tar}"
    assert build_source(f"docker-archive:{tar}:x/y") == f"docker-archive:{tar}:x/y"
    assert build_source("/img/x.sif") is None and build_source("docker://a") is None
    assert build_argv("apptainer", "/c/x.sif", f"oci:{layout}") == [
        "apptainer", "build", "--force", "/c/x.sif", f"oci:{layout}"]


FAKE_APPTAINER = """#!/bin/sh
# TEST DOUBLE for apptainer: records its argv, makes the output file of build/pull
echo "$@" >> "$(dirname "$0")/calls"
if [ "$1" = build ] || [ "$1" = pull ]; then echo sif > "$3"; fi
"""


async def test_image_is_converted_once_per_source(tmp_path, state_dir, test_images):
    from rolloutd.sandbox.images import ImageStore

    fake = tmp_path / "apptainer"
    fake.write_text(FAKE_APPTAINER)
    fake.chmod(0o755)
    store = ImageStore(tmp_path / "store")
    backend = ApptainerBackend(state_dir=state_dir, boot_id="b", apptainer=str(fake),
                               images=store)
    oci = test_images.oci_ref(test_images.busybox_oci)
    sif = await backend.image(oci)
    assert sif.startswith(str(tmp_path / "store" / "sif")) and sif.endswith(".sif")
    assert await backend.image(oci) == sif  # once
    stored = store.resolve(f"docker-archive:{test_images.debian_tar}")
    named = await backend.image(stored.digest)
    assert await backend.image(f"sif:{test_images.debian_sif}") == str(test_images.debian_sif)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2, calls  # one build per source; the .sif needs none
    assert calls[0].startswith("build --force ") and calls[0].endswith(f" {oci}")
    assert calls[1].startswith("build --force ") and calls[1].endswith(f" {stored.rootfs}")
    assert named.endswith(".sif")
    with pytest.raises(ImageNotFound):
        await backend.image("/nonexistent/x.sif")
