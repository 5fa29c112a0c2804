"""Apptainer command lines, checked where the binary is absent too (issue: B19)."""

from __future__ import annotations

import pytest

from rolloutd.sandbox import Bind, SandboxSpec, SandboxStartError, open_backend
from rolloutd.sandbox._apptainer import (
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
    assert argv[argv.index("--no-mount") + 1] == "home,cwd,tmp"
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
