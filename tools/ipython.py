"""A persistent IPython kernel inside a sandbox, behind a Trio API.

- The kernel is ``python -m ipykernel_launcher -f <conn>`` spawned by the sandbox helper. The
  connection file lives in the sandbox's control dir (bind-mounted at the same path inside)
  and uses the ``ipc`` transport: each channel is a Unix socket ``<prefix>-<port>`` in that
  dir; nothing listens on TCP.
- jupyter_client is only used for the wire protocol (:class:`jupyter_client.session.Session`
  signs and parses messages). The zmq sockets belong to ONE dedicated OS thread per kernel
  (zmq sockets are not thread-safe; jupyter's clients are asyncio-based), which polls the
  shell and iopub sockets and a wake-up pipe with :class:`zmq.Poller` -- no fixed sleeps, so
  a trivial cell costs a few ms. Requests go in through a queue + the pipe; results come back
  with ``TrioToken.run_sync_soon``. The thread runs under its own CapacityLimiter, never the
  default one.
- Timeout: SIGINT to the kernel (``KeyboardInterrupt`` in the cell; state is kept), then, if it
  does not answer within a grace period, kill and restart. A kernel that dies (``os._exit``,
  segfault, OOM) is restarted and the model is told that its variables are gone.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import os
import queue
import secrets
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import trio
import zmq
from jupyter_client.session import Session

from ._control import write_private
from ._errors import ToolError, ToolStartError
from ._text import TextCollector, strip_ansi

if TYPE_CHECKING:
    from rolloutd.sandbox import Sandbox, SandboxProcess

__all__ = ["IPythonResult", "KernelSession"]

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 60.0
INTERRUPT_GRACE_S = 2.0
CLOSE_TIMEOUT_S = 5.0
POLL_MS = 250  # the kernel thread checks for cancellation at least this often
MAX_SUN_PATH = 107  # sizeof(sockaddr_un.sun_path) - 1
PORTS = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5}
KERNEL_ARGS = [
    "--HistoryManager.enabled=False",  # no sqlite file in a possibly read-only HOME
    "--InteractiveShell.colors=nocolor",
    "--IPKernelApp.quiet=True",
    # fd-level output (subprocesses, C extensions) reaches us on the kernel's stdout pipe
    # instead of through ipykernel's fd-watcher threads, which cost ~1.3 ms per cell
    "--IPKernelApp.capture_fd_output=False",
]
KERNEL_ENV = {"MPLBACKEND": "agg", "PYTHONUNBUFFERED": "1", "TERM": "dumb", "PAGER": "cat",
              "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
NO_OUTPUT = "[Code executed successfully with no output]"
# Run in the kernel at start (IPKernelApp.exec_files; leaves no names behind). ipykernel's
# OutStream.flush() does two blocking round trips to its IOPub thread even when nothing is
# buffered, twice per cell (stdout, stderr): about 1 ms of a trivial cell. Skip them when the
# buffers are empty. Guarded: on another ipykernel version it silently does nothing.
KERNEL_STARTUP = """\
def __rolloutd_init():
    try:
        import ipykernel.iostream as io
        orig = io.OutStream.flush
        if getattr(orig, "_rolloutd", False) or not hasattr(io.OutStream, "_rotate_buffers"):
            return
        def flush(self):
            if getattr(self, "_buffers", True) or getattr(self, "_flush_pending", True):
                orig(self)
        flush._rolloutd = True
        io.OutStream.flush = flush
    except Exception:
        pass
__rolloutd_init()
del __rolloutd_init
"""


@dataclass
class IPythonResult:
    output: str
    ok: bool
    timed_out: bool = False
    restarted: bool = False


@dataclass
class _Request:
    kind: str  # "execute" | "ready"
    code: str = ""
    done: trio.Event = field(default_factory=trio.Event)
    status: str = ""  # "ok" | "error" | "aborted" | "died" | "stopped"
    text: TextCollector = field(default_factory=TextCollector)
    lock: threading.Lock = field(default_factory=threading.Lock)  # text: thread + drain task

    def feed(self, text: str) -> None:
        with self.lock:
            self.text.feed(text)


class _KernelThread:
    """The zmq side of one kernel; ``main`` runs in a dedicated thread."""

    def __init__(self, conn: dict[str, Any], token: trio.lowlevel.TrioToken) -> None:
        self._conn = conn
        self._token = token
        self._requests: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = False
        self._current: _Request | None = None

    # -- trio side (never blocks)
    def submit(self, req: _Request) -> None:
        self._requests.put(req)
        self._wake()

    def stop(self) -> None:
        self._stop = True
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    # -- thread side
    def _deliver(self, req: _Request, status: str) -> None:
        def done() -> None:
            req.status = status
            req.done.set()

        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(done)

    def main(self) -> None:
        ctx = zmq.Context()
        session = Session(key=self._conn["key"].encode(), signature_scheme="hmac-sha256",
                          username="rolloutd")
        prefix = f"ipc://{self._conn['ip']}-"
        shell = ctx.socket(zmq.DEALER)
        iopub = ctx.socket(zmq.SUB)
        try:
            for s in (shell, iopub):
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.RECONNECT_IVL, 10)
            iopub.setsockopt(zmq.SUBSCRIBE, b"")
            shell.connect(prefix + str(self._conn["shell_port"]))
            iopub.connect(prefix + str(self._conn["iopub_port"]))
            self._loop(session, shell, iopub)
        finally:
            shell.close(0)
            iopub.close(0)
            ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)
            if self._current is not None:
                self._deliver(self._current, "stopped")
            while True:
                try:
                    req = self._requests.get_nowait()
                except queue.Empty:
                    break
                if req is not None:
                    self._deliver(req, "stopped")

    def _loop(self, session: Session, shell: zmq.Socket[Any], iopub: zmq.Socket[Any]) -> None:
        poller = zmq.Poller()
        poller.register(shell, zmq.POLLIN)
        poller.register(iopub, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        req: _Request | None = None
        msg_id = ""
        replied = idle = False
        iopub_live = False
        while not self._stop:
            if req is None:
                try:
                    req = self._requests.get_nowait()
                except queue.Empty:
                    req = None
                if req is not None:
                    self._current = req
                    replied = idle = False
                    if req.kind == "execute":
                        msg = session.send(shell, "execute_request", {
                            "code": req.code, "silent": False, "store_history": True,
                            "user_expressions": {}, "allow_stdin": False,
                            "stop_on_error": True})
                    else:
                        msg = session.send(shell, "kernel_info_request", {})
                    assert msg is not None
                    msg_id = msg["header"]["msg_id"]
            events = dict(poller.poll(POLL_MS if req is None or req.kind == "execute" else 50))
            if self._wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            if not events:
                trio.from_thread.check_cancelled()
                if req is not None and req.kind == "ready" and not iopub_live:
                    # nudge until the iopub subscription is live
                    session.send(shell, "kernel_info_request", {})
            while _readable(shell):
                _, reply = session.recv(shell, mode=zmq.NOBLOCK)
                if reply is None:
                    break
                if req is not None and reply["parent_header"].get("msg_id") == msg_id:
                    replied = True
                    if req.kind == "execute":
                        req.status = reply["content"].get("status", "error")
            while _readable(iopub):
                _, m = session.recv(iopub, mode=zmq.NOBLOCK)
                if m is None:
                    break
                iopub_live = True
                if req is None or m["parent_header"].get("msg_id") != msg_id:
                    continue
                kind, content = m["header"]["msg_type"], m["content"]
                if kind == "status":
                    idle = idle or content.get("execution_state") == "idle"
                else:
                    with req.lock:
                        _collect(req.text, kind, content)
            if req is not None and replied and (idle or (req.kind == "ready" and iopub_live)):
                self._current = None
                self._deliver(req, req.status or "ok")
                req = None


def _readable(sock: zmq.Socket[Any]) -> bool:
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def _collect(out: TextCollector, kind: str, content: dict[str, Any]) -> None:
    if kind == "stream":
        out.feed(content.get("text", ""))
    elif kind in ("execute_result", "display_data", "update_display_data"):
        data = content.get("data", {})
        if "text/plain" in data:
            text = data["text/plain"]
            if kind == "execute_result":
                count = content.get("execution_count")
                text = f"Out[{count}]: {text}" if count else text
            out.feed(text.rstrip("\n") + "\n")
        else:
            kinds = ", ".join(sorted(data)) or "empty"
            out.feed(f"[display data ({kinds}) not shown]\n")
    elif kind == "error":
        tb = content.get("traceback") or [f"{content.get('ename')}: {content.get('evalue')}"]
        out.feed(strip_ansi("\n".join(tb)).rstrip("\n") + "\n")
    elif kind == "clear_output":
        out.clear()


class _Kernel:
    """One kernel process + its thread (one generation)."""

    def __init__(self, proc: SandboxProcess, thread: _KernelThread, files: list[Path]) -> None:
        self.proc = proc
        self.thread = thread
        self.files = files
        self.exit_status: int | None = None
        self.exited = trio.Event()
        self.thread_done = trio.Event()
        self.log_tail = b""
        self.active: _Request | None = None  # receives the process's own stdout/stderr
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")


class KernelSession:
    """A persistent IPython kernel in ``sandbox``. ``nursery`` (the toolbox's) runs the
    kernel's thread, its exit watcher and the drain of its stdout. Calls must not overlap."""

    def __init__(self, sandbox: Sandbox, nursery: trio.Nursery, *, max_output_chars: int = 10_000,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 interrupt_grace_s: float = INTERRUPT_GRACE_S) -> None:
        self._sb = sandbox
        self._nursery = nursery
        self.max_output_chars = max_output_chars
        self._startup_timeout_s = startup_timeout_s
        self._grace_s = interrupt_grace_s
        self._kernel: _Kernel | None = None
        self._gen = 0
        self._tag = secrets.token_hex(3)
        self._limiter = trio.CapacityLimiter(1)
        self._dirty = False
        self.restarts = 0

    @property
    def alive(self) -> bool:
        return self._kernel is not None and self._kernel.exit_status is None

    async def start(self) -> None:
        """Start a kernel and return once it answered ``kernel_info`` and iopub is live."""
        self._gen += 1
        ctl = Path(self._sb.control_dir)
        # A new random name per start: the sandbox can see and write the control dir, so a
        # name it could predict (the next generation's) is a name it could plant a link at.
        prefix = str(ctl / f"k{self._tag}{self._gen}{secrets.token_hex(4)}")
        if len(prefix) + 3 > MAX_SUN_PATH:
            raise ToolStartError(f"control dir path too long for Unix sockets: {prefix!r}")
        conn: dict[str, Any] = {**PORTS, "transport": "ipc", "ip": prefix,
                                "key": secrets.token_hex(16),
                                "signature_scheme": "hmac-sha256", "kernel_name": ""}
        conn_file = Path(prefix + ".json")
        startup = Path(prefix + "_init.py")
        files = [conn_file, startup] + [Path(f"{prefix}-{p}") for p in PORTS.values()]
        try:
            await trio.to_thread.run_sync(write_private, conn_file, json.dumps(conn).encode())
            await trio.to_thread.run_sync(write_private, startup, KERNEL_STARTUP.encode())
        except OSError as exc:  # something the sandbox planted at the new names
            raise ToolStartError(f"cannot write the kernel's files: {exc}") from exc
        try:
            proc = await self._sb.spawn(
                [self._sb.python, "-m", "ipykernel_launcher", "-f", str(conn_file),
                 *KERNEL_ARGS, f"--IPKernelApp.exec_files={[str(startup)]!r}"], pty=False, env=KERNEL_ENV, cwd=self._sb.workdir)
        except trio.Cancelled:
            raise
        except Exception as exc:
            raise ToolStartError(f"cannot start the IPython kernel: {exc}") from exc
        kernel = _Kernel(proc, _KernelThread(conn, trio.lowlevel.current_trio_token()), files)
        self._kernel = kernel
        self._dirty = False
        self._nursery.start_soon(self._watch, kernel, name=f"kernel-watch-{self._gen}")
        self._nursery.start_soon(self._drain, kernel, name=f"kernel-drain-{self._gen}")
        self._nursery.start_soon(self._run_thread, kernel, name=f"kernel-thread-{self._gen}")
        req = _Request("ready")
        kernel.thread.submit(req)
        with trio.move_on_after(self._startup_timeout_s):
            await self._wait(kernel, req)
        if req.status != "ok":
            tail = kernel.log_tail.decode(errors="replace")[-2000:]
            await self._stop(kernel)
            why = "timed out" if not req.done.is_set() else f"status {req.status}"
            raise ToolStartError(f"the IPython kernel did not start ({why}); its output:\n{tail}")

    async def _run_thread(self, kernel: _Kernel) -> None:
        try:
            await trio.to_thread.run_sync(kernel.thread.main, limiter=self._limiter,
                                          thread_name=f"ipykernel-{self._sb.id}-{self._gen}")
        finally:
            kernel.thread_done.set()

    async def _watch(self, kernel: _Kernel) -> None:
        try:
            status = await kernel.proc.wait()
        except trio.Cancelled:
            raise
        except Exception:
            status = -signal.SIGKILL
        kernel.exit_status = status
        kernel.exited.set()

    async def _drain(self, kernel: _Kernel) -> None:
        stream = kernel.proc.stdout
        if stream is None:
            return
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await stream.receive_some(65536):
                if kernel.active is not None:
                    kernel.active.feed(kernel.decoder.decode(data))
                else:
                    kernel.log_tail = (kernel.log_tail + data)[-8192:]

    async def _wait(self, kernel: _Kernel, req: _Request) -> None:
        """Wait for ``req`` or the kernel's death (then ``req.status == "died"``)."""
        async with trio.open_nursery() as n:
            async def on_exit() -> None:
                await kernel.exited.wait()
                await trio.sleep(0.05)  # let a reply that raced the exit arrive
                if not req.done.is_set():
                    req.status = "died"
                    req.done.set()

            n.start_soon(on_exit)
            await req.done.wait()
            n.cancel_scope.cancel()

    async def _stop(self, kernel: _Kernel) -> None:
        """Kill the kernel, stop its thread, remove its files. Shielded and bounded."""
        if self._kernel is kernel:
            self._kernel = None
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            kernel.thread.stop()
            if kernel.exit_status is None:
                try:
                    await kernel.proc.signal(signal.SIGKILL, group=True)
                except trio.Cancelled:
                    raise
                except Exception as exc:
                    log.debug("killing kernel: %r", exc)
                await kernel.exited.wait()
            await kernel.thread_done.wait()
            for f in kernel.files:
                with contextlib.suppress(OSError):
                    await trio.Path(f).unlink(missing_ok=True)
            for s in (kernel.proc.stdin, kernel.proc.stdout):
                if s is not None:
                    await s.aclose()

    async def aclose(self) -> None:
        if self._kernel is not None:
            await self._stop(self._kernel)

    async def restart(self) -> None:
        if self._kernel is not None:
            await self._stop(self._kernel)
        self.restarts += 1
        await self.start()

    async def execute(self, code: str, *, timeout_s: float) -> IPythonResult:
        notes: list[str] = []
        if self._kernel is None:
            await self.start()
        elif self._dirty or not self.alive:
            await self.restart()
            notes.append("[The previous kernel was restarted; its variables are gone.]")
        kernel = self._kernel
        assert kernel is not None
        req = _Request("execute", code)
        self._dirty = True
        kernel.active = req
        kernel.thread.submit(req)
        timed_out = restarted = False
        with trio.move_on_after(timeout_s):
            await self._wait(kernel, req)
        if not req.done.is_set():
            timed_out = True
            try:
                await kernel.proc.signal(signal.SIGINT, group=False)
            except trio.Cancelled:
                raise
            except Exception as exc:
                raise ToolError(f"cannot interrupt the kernel: {exc}") from exc
            with trio.move_on_after(self._grace_s):
                await self._wait(kernel, req)
            if req.done.is_set() and req.status != "died":
                notes.append(f"[Execution timed out after {timeout_s:g} s and was interrupted "
                             "(KeyboardInterrupt); variables defined so far are kept.]")
            else:
                req.status = "died"
                notes.append(f"[Execution timed out after {timeout_s:g} s and the kernel did not "
                             "respond to an interrupt; it was restarted and all variables are "
                             "gone.]")
                restarted = True
        if req.status in ("died", "stopped") and not restarted:
            status = kernel.exit_status
            notes.append(f"[The kernel died{f' (exit status {status})' if status is not None else ''}"
                         " while running this code and was restarted; all variables, imports "
                         "and functions are gone.]")
            restarted = True
        # output the cell's subprocesses wrote to the kernel's fd 1/2 is already in the pipe:
        # give the drain task a chance to forward it
        for _ in range(2):
            await trio.lowlevel.checkpoint()
        kernel.active = None
        if restarted:
            await self.restart()
        self._dirty = False
        output = req.text.render(self.max_output_chars, hint="; print less, or write to a file")
        if notes:
            output = (output.rstrip("\n") + "\n" if output else "") + "\n".join(notes)
        elif not output:
            output = NO_OUTPUT
        ok = req.status == "ok" and not timed_out
        return IPythonResult(output=output, ok=ok, timed_out=timed_out, restarted=restarted)
