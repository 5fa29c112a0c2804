"""A stand-in daemon for tests/sandbox/test_signals.py. ``python -m
tests.sandbox._signal_probe STATE_DIR BOOT_ID``, started with signals blocked and ignored,
opens a local and a bwrap sandbox as the daemon does and prints, as one JSON object per
backend, the signal state of each process of the sandbox and how a command answers SIGINT.
With ``hold`` it keeps a sandbox of each open after SIGTERM to their host processes, to be
SIGKILLed; with ``die-on-go BACKEND`` it kills itself while a sandbox starts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import trio

from rolloutd.sandbox import SandboxSpec, open_backend
from rolloutd.sandbox._backend import first_child
from rolloutd.sandbox._launcher import Launcher

#: What a command prints: its pid, then its own signal masks (an exec'd grep reads them:
#: dash blocks every signal while it waits for a child).
PROBE = ["sh", "-c", "echo $$; exec grep -E '^Sig(Blk|Ign)' /proc/self/status"]


def host_pids(sb: Any) -> tuple[int, int]:
    """(launcher, helper) host pids of a sandbox: the launcher is bwrap or the local helper."""
    launcher = int((sb.workspace.parent / "pid").read_text().split()[0])
    helper = first_child(launcher) if sb.backend == "bwrap" else launcher
    assert helper is not None
    return launcher, helper


def masks(pid: int) -> dict[str, int]:
    """SigBlk and SigIgn of ``pid`` as ints (bit n-1 for signal n)."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("SigBlk", "SigIgn"):
                found[name] = int(value, 16)
    return found


async def answers_sigint(sb: Any, pty: bool) -> int:
    proc = await sb.spawn(["sleep", "300"], pty=pty)
    try:
        await proc.signal(signal.SIGINT, group=False)
        with trio.fail_after(5):
            return int(await proc.wait())
    finally:
        await proc.aclose()
        if proc.pty_fd is not None:
            os.close(proc.pty_fd)


async def probe(name: str, state_dir: Path, boot_id: str) -> dict[str, Any]:
    backend = open_backend(name, state_dir=state_dir, boot_id=boot_id, check=True, spares=1)
    backend.warm_up()
    out: dict[str, Any] = {"backend": name, "probe": masks(os.getpid())}
    try:
        parked = backend._spares[0].process
        assert parked is not None
        drain = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1))
        with trio.fail_after(5):  # until the shell has run its trap
            while masks(parked.pid)["SigIgn"] & drain != drain:
                await trio.sleep(0.01)
        out["parked"] = masks(parked.pid)
        async with backend.open(SandboxSpec()) as sb:
            launcher, helper = host_pids(sb)
            out["launcher"], out["helper"] = masks(launcher), masks(helper)
            r = await sb.run(PROBE, timeout_s=10)
            lines = r.stdout.decode().split("\n")
            out["command"] = {k: int(v, 16) for k, v in (line.split(":\t") for line in lines[1:] if line)}
            out["sigint_pipes"] = await answers_sigint(sb, pty=False)
            out["sigint_pty"] = await answers_sigint(sb, pty=True)
    finally:
        await backend.aclose()
    return out


async def hold(state_dir: Path, boot_id: str) -> None:
    """Open a local and a bwrap sandbox, send their host processes what scancel sends,
    print their pids, and wait to be killed (the test checks they die with this process)."""
    pids = []
    async with contextlib.AsyncExitStack() as stack:
        for name in ("local", "bwrap"):
            backend = open_backend(name, state_dir=state_dir, boot_id=boot_id, check=True)
            sb = await stack.enter_async_context(backend.open(SandboxSpec()))
            launcher, helper = host_pids(sb)
            for pid in (launcher, helper):
                os.kill(pid, signal.SIGTERM)
            await trio.sleep(0.2)
            assert (await sb.run(["echo", "ok"], timeout_s=10)).stdout == b"ok\n"
            await (await sb.spawn(["sleep", "300"])).aclose()
            pids += [launcher, helper]
        print(json.dumps(pids), flush=True)
        await trio.sleep_forever()


async def die_on_go(name: str, state_dir: Path, boot_id: str) -> None:
    """Open a sandbox and die (SIGKILL) the moment its launcher is told to go: before bwrap
    or the helper could have set a parent-death signal (the test checks nothing of the
    sandbox outlives this process)."""
    go = Launcher.go

    async def go_and_die(self: Launcher, data: bytes = b"") -> None:
        await go(self, data)
        os.kill(os.getpid(), signal.SIGKILL)

    Launcher.go = go_and_die  # type: ignore[method-assign]
    backend = open_backend(name, state_dir=state_dir, boot_id=boot_id, check=True)
    async with backend.open(SandboxSpec()):
        raise AssertionError("the sandbox opened: the stand-in daemon should be dead")


async def main() -> None:
    state_dir, boot_id = Path(sys.argv[1]), sys.argv[2]
    if sys.argv[3:] == ["hold"]:
        await hold(state_dir, boot_id)
        return
    if sys.argv[3:4] == ["die-on-go"]:
        await die_on_go(sys.argv[4], state_dir, boot_id)
        return
    for name in ("local", "bwrap"):
        print(json.dumps(await probe(name, state_dir, boot_id)), flush=True)


if __name__ == "__main__":
    trio.run(main)
