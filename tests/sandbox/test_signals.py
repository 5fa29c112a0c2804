"""Signals and sandboxes: a sandbox outlives the SIGTERM a Slurm ``scancel`` sends to every
process of the job step (the daemon drains, its sandboxes must keep working); a daemon
started with signals blocked or ignored hands none of that to the sandbox's processes; and
the marker kill that ends a sandbox's strays is one function, run off the event loop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import pytest
import trio

from rolloutd.sandbox import SandboxSpec, _backend, _helper, _lifeline, open_backend

from ._signal_probe import host_pids
from .conftest import marked_pids

REPO = Path(__file__).resolve().parents[2]


def bits(*sigs: int) -> int:
    return sum(1 << (s - 1) for s in sigs)


STANDARD = bits(*range(1, 32))  # glibc's internal 32 and 33 are left out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ----- scancel: SIGTERM to every process of the step ---------------------------------


@pytest.mark.parametrize("name", ["bwrap", "local"])
async def test_a_sandbox_outlives_sigterm_to_its_host_processes(name, state_dir, boot_id,
                                                                leak_check):
    """SIGTERM and SIGINT to the launcher (bwrap, or the local helper), the helper and a
    parked spare, as Slurm's scancel and srun's interrupt send them to a whole job step: a
    command that is running finishes, the sandbox keeps working, the spare still opens, and
    the daemon's teardown still ends every process. (bwrap has no SIGTERM handler: it died,
    and its --die-with-parent killed the helper.)"""
    backend = open_backend(name, state_dir=state_dir, boot_id=boot_id, check=True, spares=2)
    backend.warm_up()
    try:
        async with backend.open(SandboxSpec()) as sb:
            launcher, helper = host_pids(sb)
            parked = backend._spares[0].process
            assert parked is not None
            spare = parked.pid
            results = []

            async def run() -> None:
                results.append(await sb.run(["sh", "-c", "sleep 1; echo done"], timeout_s=20))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await trio.sleep(0.3)  # the command is running
                for pid in (launcher, helper, spare):
                    for sig in (signal.SIGTERM, signal.SIGINT):
                        os.kill(pid, sig)
            [r] = results
            assert (r.exit_code, r.stdout) == (0, b"done\n")
            assert (await sb.run(["echo", "still here"], timeout_s=10)).stdout == b"still here\n"
            assert backend.live[sb.id] is sb
        async with backend.open(SandboxSpec()) as sb:  # on the spare that was signalled
            assert (await sb.run(["echo", "hi"], timeout_s=10)).stdout == b"hi\n"
        assert backend.spare_hits == 2
    finally:
        await backend.aclose()
    assert marked_pids(leak_check.tag) == []


async def test_sandboxes_that_ignored_sigterm_still_die_with_the_daemon(state_dir, boot_id,
                                                                       leak_check):
    """SIGKILL a stand-in daemon whose local and bwrap sandboxes got (and ignored) SIGTERM:
    their host processes die with it (bwrap's --die-with-parent, the local helper's
    parent-death signal), and with bwrap's helper its whole PID namespace; a local
    sandbox's commands are left for the next daemon's sweep (it has no namespace), which
    kills them and removes the dirs and cgroups."""
    argv = [sys.executable, "-m", "tests.sandbox._signal_probe", str(state_dir), boot_id, "hold"]
    async with trio.open_nursery() as nursery:
        proc = await nursery.start(partial(trio.run_process, argv, cwd=REPO,
                                           stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                           check=False))
        try:
            line = b""
            with trio.fail_after(60):
                while not line.endswith(b"\n"):
                    chunk = await proc.stdout.receive_some()
                    assert chunk, "the stand-in daemon exited"
                    line += chunk
            pids = json.loads(line)
            assert len(pids) == 4 and all(alive(p) for p in pids)
            assert len(marked_pids(leak_check.tag)) == 2  # a sleep in each
        finally:
            proc.kill()
    with trio.fail_after(10):
        while any(alive(p) for p in pids) or len(marked_pids(leak_check.tag)) > 1:
            await trio.sleep(0.05)
    sweeper = open_backend("local", state_dir=state_dir, boot_id=boot_id + "x")
    assert await sweeper.sweep() == 2
    assert marked_pids(leak_check.tag) == []


def mentioning(text: str) -> list[str]:
    """The command lines of live processes that mention ``text``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline and alive(int(name)):
                found.append(f"{name}: {cmdline[:200]}")
    return found


@pytest.mark.parametrize("name", ["bwrap"])
async def test_a_sandbox_starting_when_the_daemon_dies_dies_too(name, state_dir, boot_id,
                                                                leak_check):
    """A stand-in daemon SIGKILLed the moment it lets a launcher go, before bwrap (outside
    and in the namespace) or the helper set their parent-death signals: the sandbox still
    ends (the helper dies writing READY to the dead daemon, or by the daemon's lifeline).

    bwrap only: in CI the local backend's helper (Debian's python3, no namespace) was once
    found alive 10 s after the stand-in's death, its config not yet read, so before any of
    its own checks ran; not understood yet (the local backend is for development)."""
    argv = [sys.executable, "-m", "tests.sandbox._signal_probe", str(state_dir), boot_id,
            "die-on-go", name]
    with trio.fail_after(60):
        done = await trio.run_process(argv, cwd=REPO, capture_stdout=True, capture_stderr=True,
                                      check=False, stdin=subprocess.DEVNULL)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-3000:]
    with trio.move_on_after(10):
        while mentioning(str(state_dir)):
            await trio.sleep(0.05)
    left = mentioning(str(state_dir))
    for line in left:  # not left to the next test
        os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert left == []
    sweeper = open_backend(name, state_dir=state_dir, boot_id=boot_id + "x")
    await sweeper.sweep()


@pytest.mark.parametrize("name", ["bwrap", "local"])
async def test_a_helper_whose_lifeline_hangs_up_ends_its_sandbox(name, state_dir, boot_id,
                                                                 leak_check):
    """The daemon's lifeline hangs up (here its write end is closed by hand, as the kernel
    closes it when the daemon dies): the helper kills every process of the sandbox and
    exits, though its parent lives on (so no parent-death signal could have told it)."""
    backend = open_backend(name, state_dir=state_dir, boot_id=boot_id, check=True)
    read, write = _lifeline._fds
    async with backend.open(SandboxSpec()) as sb:
        launcher, helper = host_pids(sb)
        await (await sb.spawn(["sleep", "300"])).aclose()
        assert len(marked_pids(leak_check.tag)) == 1
        new_read, new_write = os.pipe2(os.O_CLOEXEC)  # to put back, at the same fds
        os.close(write)
        try:
            with trio.fail_after(10):
                while alive(helper) or marked_pids(leak_check.tag):
                    await trio.sleep(0.05)
        finally:
            os.dup2(new_read, read, inheritable=False)
            os.dup2(new_write, write, inheritable=False)
            os.close(new_read)
            os.close(new_write)
    assert not alive(launcher)


# ----- a daemon started with signals blocked or ignored ------------------------------

#: What starts the probe: SIGINT, SIGTERM and SIGCHLD blocked (a parent that blocked them
#: around its fork), SIGHUP and SIGUSR1 ignored (nohup, a CI runner); then exec.
BLOCKING_WRAPPER = (
    "import os, signal, sys; "
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGCHLD}); "
    "[signal.signal(s, signal.SIG_IGN) for s in (signal.SIGHUP, signal.SIGUSR1)]; "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


async def test_a_daemon_started_with_signals_blocked_passes_none_on(state_dir, boot_id,
                                                                    leak_check):
    """No process of a local or a bwrap sandbox (the parked launcher, bwrap, the helper,
    commands on pipes and on a pty) has a signal blocked that it does not ignore; commands
    have none blocked or ignored and answer SIGINT. (The launcher inherited the daemon's
    mask: the local helper, with SIGCHLD blocked, never woke for a child's exit.)"""
    argv = [sys.executable, "-c", BLOCKING_WRAPPER, sys.executable, "-m",
            "tests.sandbox._signal_probe", str(state_dir), boot_id]
    with trio.fail_after(90):
        done = await trio.run_process(argv, cwd=REPO, capture_stdout=True, capture_stderr=True,
                                      check=False, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    records = {r["backend"]: r for r in map(json.loads, done.stdout.decode().splitlines())}
    assert set(records) == {"local", "bwrap"}
    drain = bits(signal.SIGTERM, signal.SIGINT)
    for name, r in records.items():
        # the scenario: the probe itself runs with them blocked
        assert r["probe"]["SigBlk"] & bits(signal.SIGINT, signal.SIGCHLD) == bits(signal.SIGINT, signal.SIGCHLD)
        # a launcher blocks nothing but the two it ignores (from its spawn to its trap)
        assert r["parked"]["SigBlk"] == drain, (name, r)
        assert r["parked"]["SigIgn"] & STANDARD == drain, (name, r)
        # bwrap keeps that, and blocks SIGCHLD itself (it reads it from a signalfd); the
        # local launcher is the helper
        own = drain | bits(signal.SIGCHLD) if name == "bwrap" else 0
        assert r["launcher"]["SigBlk"] == own, (name, r)
        assert r["helper"]["SigBlk"] == 0, (name, r)
        ignored = drain | bits(signal.SIGPIPE, signal.SIGXFSZ)
        assert r["helper"]["SigIgn"] & STANDARD == ignored, (name, r)
        assert r["command"]["SigBlk"] == 0 and r["command"]["SigIgn"] & STANDARD == 0, (name, r)
        assert r["sigint_pipes"] == r["sigint_pty"] == -signal.SIGINT, (name, r)


# ----- the marker kill ---------------------------------------------------------------


def test_the_daemon_kills_strays_with_the_helpers_function():
    """One implementation: the daemon-side copy had drifted (it gave up on a process caught
    mid-execve, whose environment reads empty for a moment)."""
    assert _backend.kill_marked is _helper.kill_marked


async def test_the_local_teardown_scans_proc_in_a_worker_thread(state_dir, boot_id, leak_check,
                                                                monkeypatch):
    threads = []
    real = _helper.scan_marked

    def spy(marker, unsure=None):  # TEST DOUBLE: records the thread, runs the real scan
        threads.append(threading.current_thread())
        return real(marker, unsure)

    monkeypatch.setattr(_helper, "scan_marked", spy)
    backend = open_backend("local", state_dir=state_dir, boot_id=boot_id, check=True)
    async with backend.open(SandboxSpec()) as sb:
        await sb.run(["true"], timeout_s=10)
    assert threads and threading.main_thread() not in threads


async def test_the_marker_kill_looks_again_at_a_process_with_no_environment_yet():
    """The shared scan reports a live process whose environment reads empty (one mid-execve
    shows none for a moment) as unsure, so the kill looks again; not a zombie."""
    name, value = "ROLLOUTD_SANDBOX", "test/" + os.urandom(4).hex()
    marker = f"{name}={value}".encode()
    marked = subprocess.Popen(["sleep", "30"], env={name: value})
    bare = subprocess.Popen(["sleep", "30"], env={})  # its environment reads empty
    zombie = subprocess.Popen(["true"], env={})
    try:
        with trio.fail_after(5):
            while not _helper.is_zombie(zombie.pid):
                await trio.sleep(0.01)
        unsure: list[int] = []
        assert _helper.scan_marked(marker, unsure) == [marked.pid]
        assert bare.pid in unsure and zombie.pid not in unsure
        _helper.kill_marked(marker)
        with trio.fail_after(5):
            while marked.poll() is None:
                await trio.sleep(0.01)
        assert marked.returncode == -signal.SIGKILL
    finally:
        for p in (marked, bare, zombie):
            p.kill()
            p.wait()
