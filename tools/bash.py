"""A persistent bash shell on a pty inside a sandbox, driven natively from Trio.

One :class:`BashSession` per sandbox. The helper spawns ``bash --noediting -i`` on a pty and
passes the master fd back; we read and write it with :class:`trio.lowlevel.FdStream` (no
threads). How a command runs:

- It is typed as ONE short line,
  ``{ __rd_r=0; eval <prefix>$'<command, ANSI-C quoted>'; } </dev/null; __rd_done "$?" N "$-"``,
  or, when that line would not fit a canonical tty line (4096 bytes), the command is written
  to a new file in the control dir and ``source``d there instead of the ``$'...'``.
  ``eval``/``source`` keep the command in the shell itself, so ``cd``, variables and functions
  persist; a syntax error or a ``set -u`` failure is an ordinary non-zero status (bash does not
  abort the rest of the line when the error happens inside ``eval``/``source``).
- Every call starts in a clean shell (``__rd_done``): prompt variables emptied, ``set -x``/``-v``
  off between commands and turned back on by the prefix inside the eval (so the tool's own
  line is never traced; the trace of the ``__rd_done`` call is cut out here), bash's notices
  about ended background jobs dropped. A shell that can no longer run commands or show their
  output (an fd limit too low, stdout/stderr closed or redirected by ``exec``) is reported by
  flags in the marker and restarted at once.
- stdin of every command is ``/dev/null``: a program that waits for input sees end-of-file
  instead of hanging (``read x``, ``python``, ``cat``); heredocs still work because their
  bodies are part of the command text. Programs that open ``/dev/tty`` themselves (``less``,
  ``vim`` on a file) are caught by the hard timeout.
- ``python`` and ``pip`` run the sandbox's interpreter (shims in ``<control dir>/bin``, first
  on the PATH); the host may have only ``python3``.
- ``__rd_done`` (a function defined at start, not PS1/PROMPT_COMMAND, which ``set -u``/``-e``
  break) prints ``\\x1e<nonce>:<status>:<flags>\\x1e``; the nonce is random per command and
  the typed text never contains the marker bytes, so neither echo nor the command's own
  output can fake it. Only new bytes are scanned for it.
- Hard timeout: SIGINT to the terminal's foreground process group, then SIGKILL; once the
  shell is in the foreground again a sync marker confirms it is usable; otherwise it is
  restarted. The partial output is returned either way.
- If the shell dies (``exit``, ``set -e`` and a failing command, ``exec``), a new one is
  started and the model is told that the shell state was lost. ``set -e`` is switched off
  again after every command, so it applies to one call only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import shlex
import signal
import termios
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ._control import write_private
from ._errors import ToolStartError
from ._text import OutputCollector

if TYPE_CHECKING:
    from rolloutd.sandbox import Sandbox, SandboxProcess

__all__ = ["BashResult", "BashSession"]

log = logging.getLogger(__name__)

MAX_TTY_LINE = 4000  # canonical-mode line limit is 4095 bytes on Linux; stay below it
INTERRUPT_GRACE_S = 0.5  # after SIGINT, and again after SIGKILL
STARTUP_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 5.0
READ_CHUNK = 1 << 16
SHIMS = ("python", "pip")  # in <control dir>/bin, first on the shell's PATH
TRACE_KEEP = 512  # bytes held back before a marker: the wrapper's xtrace is cut from them

SHELL_ENV = {
    "TERM": "dumb",
    "PS1": "",
    "PS2": "",
    "PS4": "+ ",
    "PAGER": "cat",
    "GIT_PAGER": "cat",
    "MANPAGER": "cat",
    "SYSTEMD_PAGER": "",
    "LESS": "-FRX",
    "GIT_TERMINAL_PROMPT": "0",
    "DEBIAN_FRONTEND": "noninteractive",
    "PIP_NO_INPUT": "1",
    "PIP_PROGRESS_BAR": "off",
    "HISTFILE": "/dev/null",
    "LANG": "C.UTF-8",
}

# Run after every command (``__rd_done <status> <nonce> <$->``), so each call starts in a
# clean shell: first xtrace/verbose/errexit off (the trace of this call is cut out on our
# side); x and v come back, untraced, in front of the next command (``__rd_pre``). Prompt
# variables are unset (they print between commands; `unset` of a read-only one fails
# without aborting the function, an assignment would). ``__rd_bad`` (the slow path) adds
# flags to the marker when the shell can no longer work: ``r`` a `</dev/null` fails (this
# command's, or the probe's: an open-file limit too low), ``1``/``2`` stdout/stderr is not
# the terminal (closed or redirected by `exec`), ``p`` a prompt variable is read-only; the
# marker then goes to the first fd that still is the terminal.
_MARK = "builtin printf '\\036%s:%s:%s\\036' \"$2\" \"$3\" \"$__rd_b\""
_DONE = (
    "__rd_done() { builtin set +xve; __rd_pre=${3//[!xv]/}; builtin local __rd_p=; "
    "builtin unset PS1 PS2 PS0 PROMPT_COMMAND || __rd_p=p; "
    "if [[ -z $__rd_p && ${4-${__rd_r-}} == 0 && -t 1 && -t 2 ]] && { builtin :; } </dev/null; "
    "then __rd_r=1; builtin printf '\\036%s:%s:\\036' \"$2\" \"$1\"; "
    "else __rd_bad \"${4-${__rd_r-}}\" \"$2\" \"$1\" \"$__rd_p\"; fi; }; "
    "__rd_bad() { __rd_r=1; builtin local __rd_b=$4; [[ $1 == 0 ]] || __rd_b+=r; "
    "[[ -t 1 ]] || __rd_b+=1; [[ -t 2 ]] || __rd_b+=2; __rd_b=${__rd_b:-r}; "
    f"if [[ -t 1 ]]; then {_MARK}; elif [[ -t 2 ]]; then {_MARK} >&2; "
    f"else {_MARK} >/dev/tty; fi; }}; "
)
# In front of the eval'd command. The typed words are backslashed: the model's aliases
# (`alias eval=...`) are not expanded for them.
_PRE = '"${__rd_pre:+\\builtin set -$__rd_pre; }"'
# One line; typed after spawn. `bind` is guarded: it fails harmlessly without readline.
_INIT = (
    "set +H +o history; PS1=''; PS2=''; PS0=''; unset PROMPT_COMMAND; "
    "bind 'set enable-bracketed-paste off' >/dev/null 2>&1; "
    "export TERM=dumb PAGER=cat GIT_PAGER=cat MANPAGER=cat GIT_TERMINAL_PROMPT=0 "
    "DEBIAN_FRONTEND=noninteractive{path}; __rd_r=1; __rd_pre=; "
    + _DONE +
    "__rd_r=0; __rd_done 0 {nonce}\n"
)

_RESTARTED_NOTE = (
    "[The shell exited{status} while running this command (for example because of `exit`, "
    "`exec`, or `set -e` and a failing command). A new shell has been started: the working "
    "directory, environment variables and shell functions from earlier commands are lost.]"
)


@dataclass
class BashResult:
    output: str
    exit_code: int | None
    timed_out: bool = False
    restarted: bool = False


class _ShellGone(Exception):
    """The shell exited or its pty reached EOF."""


def ansi_c_quote(text: str) -> str:
    """``$'...'`` quoting that is plain ASCII with no control characters (safe to type)."""
    out = ["$'"]
    for b in text.encode("utf-8", errors="replace"):
        if b == 0x5C:
            out.append("\\\\")
        elif b == 0x27:
            out.append("\\'")
        elif b == 0x0A:
            out.append("\\n")
        elif b == 0x09:
            out.append("\\t")
        elif 0x20 <= b < 0x7F:
            out.append(chr(b))
        else:
            out.append(f"\\x{b:02x}")
    out.append("'")
    return "".join(out)


_TRACE_TAIL = b"builtin set +xve\n"


def _cut_wrapper_trace(data: bytes, nonce: str) -> bytes:
    """Under the model's ``set -x`` bash traces our ``__rd_done`` call and its first line just
    before the marker: ``<PS4>__rd_done 0 <nonce> <$->`` and ``<PS4>builtin set +xve``. Cut
    both, using the second line's PS4 expansion to find where the first one starts."""
    k = data.rfind(b"__rd_done ")
    if k < 0 or not data.endswith(_TRACE_TAIL):
        return data
    e = data.find(b"\n", k)
    if e < 0 or nonce.encode() not in data[k:e]:
        return data
    ps4 = data[e + 1:len(data) - len(_TRACE_TAIL)]
    if data[max(0, k - len(ps4)):k] == ps4:
        return data[:k - len(ps4)]
    # a PS4 that expands differently each time: the trace starts at a line start
    s = data.rfind(b"\n", 0, k)
    return data[:s + 1] if s >= 0 else data[:k]


def install_python_shims(control_dir: Path, python: str) -> str | None:
    """``<control_dir>/bin`` with ``python`` and ``pip`` scripts that run the sandbox's
    interpreter (``Sandbox.python``: the one the ipython tool and the task checks use); the
    host may have only ``python3`` and the interpreter's own bin dir is not on the PATH.
    Returns the directory, or None when the sandbox replaced it with something else. Written
    with dir fds and ``O_NOFOLLOW``: the control dir is writable from inside."""
    quoted = shlex.quote(python)
    shims = {"pip": f"#!/bin/sh\nexec {quoted} -m pip \"$@\"\n"}
    if os.path.isabs(python) or os.path.basename(python) != "python":  # no self-loop
        shims["python"] = f"#!/bin/sh\nexec {quoted} \"$@\"\n"
    top = os.open(control_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.mkdir("bin", 0o755, dir_fd=top)
        except FileExistsError:
            pass
        try:
            bin_fd = os.open("bin", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=top)
        except OSError as exc:  # a symlink or a file put there from inside
            log.debug("no python shims in %s: %r", control_dir, exc)
            return None
    finally:
        os.close(top)
    try:
        for name, text in shims.items():
            tmp = f".{name}-{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o755, dir_fd=bin_fd)
            with open(fd, "w") as f:
                f.write(text)
            os.replace(tmp, name, src_dir_fd=bin_fd, dst_dir_fd=bin_fd)
    finally:
        os.close(bin_fd)
    return str(Path(control_dir) / "bin")


def remove_python_shims(control_dir: Path) -> None:
    """Undo :func:`install_python_shims` (only a real directory; nothing is followed).
    Whatever is gone, or not ours, is left to the sandbox's teardown."""
    with contextlib.suppress(OSError):
        top = os.open(control_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            bin_fd = os.open("bin", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=top)
            try:
                for name in SHIMS:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=bin_fd)
            finally:
                os.close(bin_fd)
            os.rmdir("bin", dir_fd=top)
        finally:
            os.close(top)


_BROKEN = {
    "r": "its open-file limit is too low to run commands (`ulimit -n`)",
    "p": "a prompt variable (PS0, PS1, PS2, PROMPT_COMMAND) was made read-only, so it would "
         "print between commands",
    "1": "its standard output was closed or redirected away from the terminal "
         "(`exec >file`, `exec 1>&-`)",
    "2": "its standard error was closed or redirected away from the terminal "
         "(`exec 2>file`, `exec 2>&-`)",
}


def _broken_note(flags: set[str]) -> str:
    what = "; ".join(_BROKEN[f] for f in "rp12" if f in flags) or "it stopped working"
    return (f"[This command left the shell unusable: {what}. A new shell has been started: "
            "the working directory, environment variables and shell functions from earlier "
            "commands are lost.]")


# bash's notices about background jobs that ended ("[1]+  Done   sleep 1 &"): printed after
# whichever later command is running when bash notices, so they are dropped. The notice
# "[1] 4242" when a job starts stays: it belongs to the command that started it.
_JOB_NOTICE = re.compile(
    r"^\[\d+\][+\- ]  (?:Done|Done\(\d+\)|Exit \d+|Stopped|Terminated|Killed|Hangup|Interrupt|"
    r"Quit|Aborted|Segmentation fault|Bus error|Broken pipe|Alarm clock|User defined signal "
    r"[12]|Floating point exception|Illegal instruction|Trace/breakpoint trap|CPU time limit "
    r"exceeded|File size limit exceeded|Bad system call|Signal \d+)(?: \(core dumped\))? .*\n?",
    re.MULTILINE)


def drop_job_notices(text: str) -> str:
    if "]" not in text:
        return text
    return _JOB_NOTICE.sub("", text)


def _sandbox_pid(host_pid: int) -> int:
    """The pid of ``host_pid`` in its innermost PID namespace (the sandbox's view)."""
    try:
        with open(f"/proc/{host_pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return host_pid


class BashSession:
    """One persistent shell in ``sandbox``. Start with :meth:`start` (or lazily via
    :meth:`run`); close with :meth:`aclose`. Calls must not overlap (the Toolbox serialises).

    ``nursery`` (the toolbox's) runs one watcher per shell that notices the shell's exit even
    when a background job keeps the pty open.
    """

    def __init__(self, sandbox: Sandbox, nursery: trio.Nursery, *, max_output_chars: int = 10_000,
                 env: dict[str, str] | None = None, shell: str = "bash",
                 startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 interrupt_grace_s: float = INTERRUPT_GRACE_S) -> None:
        self._sb = sandbox
        self._nursery = nursery
        self.max_output_chars = max_output_chars
        self._env = {**SHELL_ENV, **(env or {})}
        self._shell = shell
        self._startup_timeout_s = startup_timeout_s
        self._grace_s = interrupt_grace_s
        self._proc: SandboxProcess | None = None
        self._stream: trio.lowlevel.FdStream | None = None
        self._fd = -1
        self._shell_pgrp = 0
        self._termios: list[Any] | None = None
        self._pending = b""
        self._exit_status: int | None = None
        self._exited = trio.Event()
        self._io_scope: trio.CancelScope | None = None
        self._dirty = False
        self._broken: set[str] = set()
        self._gen = 0
        self._script: Path | None = None  # the last long command's file
        self.commands_run = 0
        self.restarts = 0

    # ------------------------------------------------------------------ lifecycle
    @property
    def alive(self) -> bool:
        return self._proc is not None and self._exit_status is None

    async def start(self) -> None:
        """Spawn the shell and wait for its first marker (really ready)."""
        self._gen += 1
        gen = self._gen
        self._exit_status = None
        self._exited = trio.Event()
        self._pending = b""
        self._dirty = False
        try:
            shims = await trio.to_thread.run_sync(install_python_shims, self._sb.control_dir,
                                                  self._sb.python)
        except OSError as exc:
            raise ToolStartError(f"cannot prepare the shell: {exc}") from exc
        path = f" PATH={shlex.quote(shims)}:\"$PATH\"" if shims else ""
        try:
            proc = await self._sb.spawn(
                [self._shell, "--noprofile", "--norc", "--noediting", "-i"],
                pty=True, env=self._env, cwd=self._sb.workdir)
        except trio.Cancelled:
            raise
        except Exception as exc:
            raise ToolStartError(f"cannot start the shell: {exc}") from exc
        if proc.pty_fd is None:
            raise ToolStartError("the sandbox returned no pty for the shell")
        self._proc = proc
        self._fd = proc.pty_fd
        self._stream = trio.lowlevel.FdStream(proc.pty_fd)
        self._nursery.start_soon(self._watch, proc, gen, name=f"bash-watch-{gen}")
        # echo off and no \n -> \r\n translation, set from our side of the pty before any
        # byte is typed (ioctls on the master apply to the slave)
        attrs = termios.tcgetattr(self._fd)
        attrs[1] &= ~termios.ONLCR
        attrs[3] &= ~(termios.ECHO | termios.ECHONL)
        termios.tcsetattr(self._fd, termios.TCSANOW, attrs)
        nonce = secrets.token_hex(6)
        try:
            with trio.fail_after(self._startup_timeout_s):
                init = _INIT.replace("{path}", path).replace("{nonce}", nonce)
                await self._stream.send_all(init.encode())
                await self._expect([nonce], None)
        except (trio.TooSlowError, _ShellGone) as exc:
            await self._kill()
            raise ToolStartError(f"the shell did not start: {exc!r}") from exc
        self._termios = termios.tcgetattr(self._fd)
        self._shell_pgrp = os.tcgetpgrp(self._fd)

    async def _watch(self, proc: SandboxProcess, gen: int) -> None:
        try:
            status = await proc.wait()
        except trio.Cancelled:
            raise
        except Exception:  # the sandbox went away: treat as an exit
            status = -signal.SIGKILL
        if gen == self._gen:
            self._exit_status = status
            self._exited.set()
            if self._io_scope is not None:
                self._io_scope.cancel()

    async def _kill(self) -> None:
        """Kill the current shell (its process group), reap it, close our pty fd. Shielded
        and bounded; the sandbox teardown catches anything that escapes."""
        proc, stream = self._proc, self._stream
        self._proc, self._stream, self._fd = None, None, -1
        self._gen += 1  # the old watcher must not touch the next shell's state
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            if proc is not None and proc.returncode is None:
                try:
                    await proc.signal(signal.SIGKILL, group=True)
                    await proc.wait()
                except trio.Cancelled:
                    raise
                except Exception as exc:  # sandbox already gone
                    log.debug("killing shell: %r", exc)
            if stream is not None:
                await stream.aclose()

    async def aclose(self) -> None:
        await self._kill()
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
            await self._remove_script()
            await trio.to_thread.run_sync(remove_python_shims, self._sb.control_dir)

    async def _remove_script(self) -> None:
        script, self._script = self._script, None
        if script is not None:
            try:
                await trio.Path(script).unlink(missing_ok=True)
            except OSError:
                pass

    async def restart(self) -> None:
        await self._kill()
        self.restarts += 1
        await self.start()

    # ------------------------------------------------------------------ I/O
    async def _receive(self) -> bytes:
        assert self._stream is not None
        try:
            data = await self._stream.receive_some(READ_CHUNK)
        except OSError as exc:
            if exc.errno == errno.EIO:
                raise _ShellGone("pty EOF") from None
            raise
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # FdStream turns EIO (the slave side is closed everywhere) into BrokenResourceError
            raise _ShellGone("pty EOF") from None
        if not data:
            raise _ShellGone("pty EOF")
        return data

    async def _expect(self, nonces: list[str], sink: OutputCollector | None) -> tuple[str, int]:
        """Read until the marker of one of ``nonces``; feed the output before it to ``sink``.
        Returns ``(nonce, status)``; the marker's flags (what is broken in the shell, if
        anything) go to ``self._broken``. Raises :class:`_ShellGone` when the shell exits."""
        pats = [(b"\x1e" + n.encode() + b":", n) for n in nonces]
        keep = max(len(p) for p, _ in pats) + TRACE_KEEP
        buf = self._pending
        self._pending = b""
        with trio.CancelScope() as scope:
            self._io_scope = scope
            try:
                while True:
                    if self._exit_status is not None:
                        raise _ShellGone(f"exit status {self._exit_status}")
                    hit = min(((i, p, n) for p, n in pats if (i := buf.find(p)) >= 0),
                              default=None)
                    if hit is not None:
                        i, p, n = hit
                        j = buf.find(b"\x1e", i + len(p))
                        if j >= 0:
                            if sink is not None:
                                sink.feed(_cut_wrapper_trace(buf[:i], n))
                            self._pending = buf[j + 1:]
                            status, _, flags = buf[i + len(p):j].partition(b":")
                            self._broken |= set(flags.decode(errors="replace"))
                            try:
                                return n, int(status)
                            except ValueError:
                                return n, -1
                        if sink is not None:
                            sink.feed(buf[:max(0, i - TRACE_KEEP)])
                        buf = buf[max(0, i - TRACE_KEEP):]
                    elif len(buf) > keep:
                        if sink is not None:
                            sink.feed(buf[:-keep])
                        buf = buf[-keep:]
                    buf += await self._receive()
            except BaseException:
                self._pending = buf
                raise
            finally:
                self._io_scope = None
        # the io scope was cancelled by the watcher: the shell exited
        self._pending = buf
        raise _ShellGone(f"exit status {self._exit_status}")

    async def _signal_foreground(self, sig: int) -> bool:
        """Signal the terminal's foreground process group. Returns False when the shell
        itself is in the foreground (nothing else to signal)."""
        try:
            pgrp = os.tcgetpgrp(self._fd)
        except OSError:
            return False
        if pgrp <= 0:
            return False
        if pgrp == self._shell_pgrp and sig == signal.SIGKILL:
            return False
        try:
            await self._sb.signal(_sandbox_pid(pgrp), sig, group=True)
        except trio.Cancelled:
            raise
        except Exception:
            try:
                os.killpg(pgrp, sig)
            except OSError:
                pass
        return pgrp != self._shell_pgrp

    async def _wait_foreground_shell(self, nonce: str, sink: OutputCollector,
                                     timeout_s: float) -> int | None:
        """Keep draining output until the shell is back in the foreground (or the command's
        own marker shows up). Returns the command's status if its marker was seen."""
        deadline = trio.current_time() + timeout_s
        while trio.current_time() < deadline:
            with trio.move_on_after(0.02):
                _, status = await self._expect([nonce], sink)
                return status
            try:
                if os.tcgetpgrp(self._fd) == self._shell_pgrp:
                    return None
            except OSError:
                return None
        return None

    # ------------------------------------------------------------------ commands
    async def _type_command(self, command: str, nonce: str) -> None:
        assert self._stream is not None
        # `__rd_r=0` runs only if the `</dev/null` could be set up; `$__rd_pre` turns the
        # model's xtrace/verbose back on inside the eval, so the line itself is not traced
        done = f"\\__rd_done \"$?\" {nonce} \"$-\"\n"
        line = f"{{ __rd_r=0; \\eval {_PRE}{ansi_c_quote(command)}; }} </dev/null; {done}"
        if len(line) > MAX_TTY_LINE:
            await self._remove_script()
            self._script = Path(self._sb.control_dir) / f"bash-{secrets.token_hex(8)}.sh"
            await trio.to_thread.run_sync(write_private, self._script,
                                          command.encode("utf-8", "replace"))
            script = shlex.quote(str(self._script))
            line = f"{{ __rd_r=0; \\eval {_PRE}'source '{script}; }} </dev/null; {done}"
        await self._stream.send_all(line.encode())

    async def run(self, command: str, *, timeout_s: float) -> BashResult:
        """Run ``command`` in the persistent shell; never raises for the command's behaviour
        (timeouts, shell death), only :class:`ToolError` when the shell cannot be (re)started."""
        notes: list[str] = []
        prefix = ""
        if self._dirty and self.alive:
            await self.restart()
            prefix = ("[The previous command was cancelled; the shell was restarted and its "
                      "state was lost.]\n")
        elif not self.alive:
            if self._proc is not None:
                await self.restart()
            else:
                await self.start()
        assert self._termios is not None
        if termios.tcgetattr(self._fd) != self._termios:  # a program left the tty raw
            termios.tcsetattr(self._fd, termios.TCSANOW, self._termios)
        self.commands_run += 1
        sink = OutputCollector()
        nonce = secrets.token_hex(6)
        deadline = trio.current_time() + timeout_s
        self._dirty = True
        self._broken = set()
        timed_out = restarted = False
        status: int | None = None
        try:
            await self._type_command(command, nonce)
            with trio.move_on_at(deadline):
                _, status = await self._expect([nonce], sink)
            if status is None:
                timed_out = True
                status, how, restarted = await self._interrupt(nonce, sink)
                notes.append(f"[The command timed out after {timeout_s:g} s and was stopped "
                             f"({how}). The output so far is shown above. Run long commands in "
                             "the background with their output redirected to a file, e.g. "
                             "`cmd > out.log 2>&1 &`.]")
        except _ShellGone:
            await self._drain_dead(sink)
            with trio.move_on_after(self._grace_s):  # EOF can come before the exit report
                await self._exited.wait()
            st = self._exit_status
            restarted = True
            status = st
            notes.append(_RESTARTED_NOTE.format(status=f" with status {st}" if st is not None
                                                else ""))
            await self.restart()
        if self._broken and not restarted:
            restarted = True
            notes.append(_broken_note(self._broken))
            await self.restart()
        self._dirty = False
        if status is not None and status < 0:
            status = 128 - status  # killed by a signal: bash's convention
        output = drop_job_notices(sink.render(
            self.max_output_chars, hint="; use head, tail or grep, or redirect the output to a file"))
        if notes:
            output = (output.rstrip("\n") + "\n" if output else "") + "\n".join(notes)
        return BashResult(output=prefix + output, exit_code=status, timed_out=timed_out,
                          restarted=restarted)

    async def _drain_dead(self, sink: OutputCollector) -> None:
        """The shell is gone: collect what it wrote before exiting (until EOF, or briefly if
        a background job still holds the pty open)."""
        sink.feed(self._pending)
        self._pending = b""
        if self._stream is None:
            return
        with trio.move_on_after(0.1):
            try:
                while True:
                    sink.feed(await self._receive())
            except _ShellGone:
                pass

    async def _interrupt(self, nonce: str,
                         sink: OutputCollector) -> tuple[int | None, str, bool]:
        """SIGINT, then SIGKILL, to the foreground group; then a sync marker. Restarts the
        shell if it does not come back. Raises _ShellGone if it died on the way."""
        how = "SIGINT"
        status = await self._after_signal(signal.SIGINT, nonce, sink)
        if status is None and os.tcgetpgrp(self._fd) != self._shell_pgrp:
            how = "SIGINT, then SIGKILL"
            status = await self._after_signal(signal.SIGKILL, nonce, sink)
        if status is not None:
            return status, how, False
        # the shell should be reading commands again: confirm with a sync marker
        sync = secrets.token_hex(6)
        assert self._stream is not None
        await self._stream.send_all(f"\\__rd_done \"$?\" {sync} \"$-\" 0\n".encode())
        with trio.move_on_after(self._grace_s):
            n, st = await self._expect([nonce, sync], sink)
            if n == nonce:  # the command finished after all; consume the sync marker too
                with trio.move_on_after(self._grace_s):
                    await self._expect([sync], sink)
            return st, how, False
        await self.restart()
        return None, how + "; the shell did not respond and was restarted, its state was lost", True

    async def _after_signal(self, sig: int, nonce: str, sink: OutputCollector) -> int | None:
        await self._signal_foreground(sig)
        return await self._wait_foreground_shell(nonce, sink, self._grace_s)

