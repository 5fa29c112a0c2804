"""Sandbox and SandboxProcess: the handle every backend yields. All of it goes through
the sandbox's helper, so the three backends behave the same above this line."""

from __future__ import annotations

import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from ._exceptions import SandboxClosed, SandboxError
from ._helper import LIFETIME_EXIT
from ._models import DirEntry, FileStat, RunResult
from ._protocol import HelperClient

# Slack on top of a run's own timeout before the daemon stops waiting for the helper.
_RUN_SLACK_S = 5.0


class SandboxProcess:
    """A process the helper spawned. ``pid`` is the pid inside the sandbox.

    With ``pty=True`` the caller owns ``pty_fd`` (the pty master; close it yourself;
    EIO on read means EOF). Otherwise ``stdin``/``stdout`` are Trio streams (stderr is
    merged into stdout) owned by the caller; ``aclose()`` closes them.
    """

    def __init__(self, sandbox: Sandbox, pid: int, *, pty_fd: int | None = None,
                 stdin: trio.lowlevel.FdStream | None = None,
                 stdout: trio.lowlevel.FdStream | None = None) -> None:
        self._sandbox = sandbox
        self.pid = pid
        self.pty_fd = pty_fd
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None

    def __repr__(self) -> str:
        return f"<SandboxProcess pid={self.pid} sandbox={self._sandbox.id} rc={self.returncode}>"

    async def wait(self) -> int:
        """Wait for the exit status (negative: killed by that signal). Cancellable."""
        if self.returncode is None:
            reply, _, _ = await self._sandbox._call("wait", {"pid": self.pid})
            self.returncode = int(reply["returncode"])
        return self.returncode

    async def signal(self, sig: int, *, group: bool = True) -> None:
        """Signal the process, or (group=True) its process group and, on a pty, the
        terminal's foreground process group."""
        await self._sandbox.signal(self.pid, sig, group=group)

    async def aclose(self) -> None:
        """Close the pipe streams (not ``pty_fd``, which the caller closes)."""
        for stream in (self.stdin, self.stdout):
            if stream is not None:
                await stream.aclose()


class Sandbox:
    """One live sandbox. Created by a backend; use it inside ``backend.open(spec)`` or
    between ``supervisor.open`` and ``supervisor.release``.

    ``closed_reason`` says why it closed: ``released``, the lifetime (the helper exited
    with ``LIFETIME_EXIT``), or ``helper gone`` (any other end of the helper; its exit
    status when known). ``helper_exit`` is the backend's: the helper's exit status, or
    None if it is still running after a bounded wait."""

    def __init__(self, *, id: str, backend: str, workspace: Path, workdir: str,
                 control_dir: Path, python: str, socket_path: str,
                 limits: Mapping[str, str], spec: Any,
                 helper_exit: Callable[[], Awaitable[int | None]] | None = None) -> None:
        self.id = id
        self.backend = backend
        self.workspace = workspace
        self.workdir = workdir
        self.control_dir = control_dir
        self.python = python
        self.limits = dict(limits)  # resource -> mechanism in force ("cgroup-v1", "rlimit", ...)
        self.spec = spec
        self.opened_at = time.monotonic()
        self.closed_reason: str | None = None
        self._client = HelperClient(socket_path)
        self._helper_exit = helper_exit

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} backend={self.backend} workspace={self.workspace}>"

    @property
    def closed(self) -> bool:
        return self.closed_reason is not None

    def _mark_closed(self, reason: str) -> None:
        if self.closed_reason is None:
            self.closed_reason = reason

    async def _call(self, op: str, args: dict[str, Any] | None = None, blob: bytes = b"",
                    ) -> tuple[dict[str, Any], bytes, list[int]]:
        if self.closed_reason is not None:
            raise SandboxClosed(f"sandbox {self.id} is closed ({self.closed_reason})")
        try:
            return await self._client.call(op, args, blob)
        except SandboxClosed:
            if self.closed_reason is None:
                status = await self._helper_exit() if self._helper_exit is not None else None
                self._mark_closed(self._gone_reason(status))
            raise SandboxClosed(f"sandbox {self.id} is closed ({self.closed_reason})") from None

    def _gone_reason(self, status: int | None) -> str:
        """Why the helper is gone, from its exit status (None: unknown, or still running)."""
        if status == LIFETIME_EXIT:
            return f"lifetime of {getattr(self.spec, 'lifetime_s', None) or 0:g} s expired"
        return "helper gone" if status is None else f"helper gone (exit status {status})"

    # ----- processes -------------------------------------------------------------------
    async def spawn(self, argv: Sequence[str], *, pty: bool = False,
                    env: Mapping[str, str] | None = None, cwd: str | None = None,
                    rows: int = 50, cols: int = 200) -> SandboxProcess:
        """Start a process in its own session: on a new pty (``pty_fd``) or on pipes."""
        args = {"argv": list(argv), "pty": pty, "env": dict(env or {}), "cwd": cwd,
                "rows": rows, "cols": cols}
        reply, _, fds = await self._call("spawn", args)
        pid = int(reply["pid"])
        if pty:
            return SandboxProcess(self, pid, pty_fd=fds[0])
        return SandboxProcess(self, pid, stdin=trio.lowlevel.FdStream(fds[0]),
                              stdout=trio.lowlevel.FdStream(fds[1]))

    async def run(self, argv: Sequence[str], *, timeout_s: float, stdin: bytes | None = None,
                  cwd: str | None = None, env: Mapping[str, str] | None = None,
                  max_output_bytes: int = 1_000_000) -> RunResult:
        """Run a command to completion with bounded capture (per stream, head and tail).

        On timeout the command's whole tree is killed (process group and every process
        that inherited the run's marker, ``setsid`` escapees included); what the command
        left running when it returned is killed too. Cancelling the call cancels the run.
        """
        args = {"argv": list(argv), "timeout_s": float(timeout_s), "cwd": cwd,
                "env": dict(env or {}), "stdin": stdin is not None,
                "max_output_bytes": int(max_output_bytes)}
        started = time.monotonic()
        with trio.move_on_after(timeout_s + _RUN_SLACK_S) as scope:
            reply, out, _ = await self._call("run", args, stdin or b"")
        if scope.cancelled_caught:
            raise SandboxError(f"sandbox {self.id}: helper did not finish a run within "
                               f"{timeout_s + _RUN_SLACK_S:.1f} s")
        split = int(reply["stdout_len"])
        return RunResult(exit_code=reply["exit_code"], stdout=out[:split], stderr=out[split:],
                         truncated=bool(reply["truncated"]), timed_out=bool(reply["timed_out"]),
                         duration_s=time.monotonic() - started)

    async def set_env(self, set: Mapping[str, str], unset: Sequence[str] = ()) -> None:
        """Change the environment every process started after this gets (e.g. a task's
        activated conda env); per-call ``env`` still goes over it."""
        await self._call("setenv", {"set": dict(set), "unset": list(unset)})

    async def listen(self, *, port: int = 0) -> tuple[int, trio.socket.SocketType]:
        """A TCP socket listening on ``127.0.0.1:<port>`` of the sandbox's own network
        namespace (``port`` 0: a free one), opened by the helper and handed over: the daemon
        accepts the sandbox's connections on it, and the sandbox keeps no other network.
        Returns the port and the socket (the caller closes it). With the local backend the
        port is on the host's loopback."""
        reply, _, fds = await self._call("listen", {"port": port})
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM, fileno=fds[0])
        return int(reply["port"]), sock

    async def kill_all(self) -> None:
        """SIGKILL every process of the sandbox but its helper (what shutdown ends): e.g.
        whatever an agent left running, before its work is judged in the same sandbox."""
        await self._call("kill_all")

    async def signal(self, pid: int, sig: int, *, group: bool = True) -> None:
        """Signal a process of this sandbox (or its group; see SandboxProcess.signal)."""
        await self._call("signal", {"pid": pid, "sig": int(sig), "group": group})

    # ----- files -----------------------------------------------------------------------
    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        _, data, _ = await self._call("read_file", {"path": path, "max_bytes": max_bytes})
        return data

    async def write_file(self, path: str, data: bytes, *, mode: int | None = None) -> None:
        await self._call("write_file", {"path": path, "mode": mode}, bytes(data))

    async def list_dir(self, path: str) -> list[DirEntry]:
        reply, _, _ = await self._call("list_dir", {"path": path})
        return [DirEntry(**entry) for entry in reply["entries"]]

    async def stat(self, path: str) -> FileStat | None:
        reply, _, _ = await self._call("stat", {"path": path})
        found = reply["stat"]
        return None if found is None else FileStat(**found)

    async def mkdir(self, path: str, *, parents: bool = True) -> None:
        await self._call("mkdir", {"path": path, "parents": parents})

    async def remove(self, path: str) -> None:
        """Remove a file, a symlink (not its target) or a directory tree."""
        await self._call("remove", {"path": path})
