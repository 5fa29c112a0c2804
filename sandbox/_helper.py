"""The in-sandbox helper: the first process of every sandbox.

Run as ``python -I -S _helper.py CONFIG_PATH`` (a JSON file it reads and removes). It
listens on a Unix socket in the control dir and answers one request per connection. It spawns every process of the sandbox (on a
pty through ptyprocess, whose master fd goes back to the daemon with SCM_RIGHTS, or on
pipes), reaps its children, reports exits, signals process groups, runs commands with
bounded head+tail capture, and does file operations with paths resolved here, inside the
sandbox, confined to the configured roots.

Stdlib only, plus ptyprocess (imported lazily, for pty spawns). Start-up is most of a
sandbox's open latency, so the helper imports only C modules (``_json``, ``_socket``,
``select``, ``_signal``, ``_struct``, ``posix``: about 1 ms, where ``json``, ``socket``,
``selectors`` and ``signal`` cost 11 ms through ``re`` and ``enum``, and ``os`` another
0.5-0.7 ms through ``_collections_abc`` and ``posixpath``); ``Codec`` and ``Poller`` are
the few lines of those modules it needs, ``join``, ``is_file`` and ``real_dir`` the few of
``os.path`` that starting and running a command need (the file operations import
``posixpath`` when first asked), and ``prctl`` calls libc through ``_ctypes``.

Wire format, both directions: ``>II`` (json length, blob length), the JSON object, the
blob. Replies are ``{"ok": true, ...}`` or ``{"ok": false, "error": {...}}``; file
descriptors ride on the reply's first byte. A connection closed by the daemon while a
``wait`` or ``run`` is pending cancels it (a cancelled ``run`` kills its process tree).

At its ``lifetime_s`` (counted from its own start) the helper kills every process of the
sandbox, removes its socket and exits with ``LIFETIME_EXIT``: the daemon tells the
sandbox's end by that status, not by its own clock (sandbox/_sandbox.py).
"""

import _socket as socket
import _struct as struct
import errno
import posix
import select
import sys
import time

#: ``typing.TYPE_CHECKING`` without importing ``typing`` (its imports cost start-up). The
#: helper must run on Python >= 3.9 without ``from __future__ import annotations`` (one
#: more import): annotations evaluated at run time (signatures, class bodies) name only
#: builtins, the rest are strings.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal  # typeshed has no stubs for ``_signal``; ``signal`` re-exports it, typed
    from collections.abc import Callable
    from typing import Any, NoReturn, ParamSpec, TypeVar

    from ptyprocess import PtyProcess

    P = ParamSpec("P")
    T = TypeVar("T")
    #: A decoded JSON object: a request, or a reply before it is encoded.
    Message = dict[str, Any]
    #: What an ``op_`` handler answers at once: (message, blob, fds to pass); None when
    #: the answer comes later (``wait``, ``run``).
    Reply = tuple[Message, bytes, tuple[int, ...]]
    #: What a registered fd stands for: (kind, Conn | Run | None), see ``Helper.serve``.
    Event = tuple[str, Any]
else:
    import _signal as signal

HEADER = struct.Struct(">II")
CHUNK = 65536
DRAIN_GRACE_S = 0.5
KEEP_EXITED = 4096
#: The helper's exit status when its lifetime ran out. No other exit gives it: Python
#: exits 1 (an uncaught exception, a parent gone at start), 2 or 120; bwrap 1 on its own
#: errors; a signal shows as negative, or as 128 + its number through bwrap.
LIFETIME_EXIT = 3
#: Where the helper finds the daemon's lifeline (sandbox/_lifeline.py): the read end of a
#: pipe that hangs up when the daemon dies.
LIFELINE_FD = 3
S_IFMT, S_IFIFO, S_IFREG = 0o170000, 0o010000, 0o100000
DEVNULL = "/dev/null"
#: Where ``which`` looks when the environment has no PATH (``os.defpath``).
DEFPATH = "/bin:/usr/bin"


def join(a: str, b: str) -> str:
    """``os.path.join(a, b)``."""
    if b.startswith("/"):
        return b
    return a + b if not a or a.endswith("/") else a + "/" + b


def is_file(path: str) -> bool:
    """``os.path.isfile(path)``."""
    try:
        return posix.stat(path).st_mode & S_IFMT == S_IFREG
    except (OSError, ValueError):
        return False


def real_dir(path: str) -> str:
    """``os.path.realpath(path)``, asked of the kernel when ``path`` exists (the file
    operations check what they open the same way, see ``Helper.check_fd``)."""
    try:
        fd = posix.open(path, posix.O_PATH | posix.O_CLOEXEC)
        try:
            return posix.readlink(f"/proc/self/fd/{fd}")
        finally:
            posix.close(fd)
    except (OSError, ValueError):
        import posixpath

        return posixpath.realpath(path)


class Codec:
    """JSON through the ``_json`` accelerator the ``json`` package itself uses (compact,
    ASCII, NaN allowed: what ``json.dumps``/``json.loads`` accept). Falls back to ``json``
    on an interpreter whose ``_json`` differs."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    memo = None
    CONSTANTS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}

    def __init__(self) -> None:
        self.dumps: Callable[[Any], str]
        self.loads: Callable[[str | bytes | bytearray], Any]
        try:
            import _json

            scan = _json.make_scanner(self)  # type: ignore[arg-type]  # reads our attributes
            encoder = _json.make_encoder(None, self.default, _json.encode_basestring_ascii,
                                         None, ":", ",", False, False, True)

            def dumps(obj: object) -> str:
                return "".join(encoder(obj, 0))

            def loads(data: "str | bytes | bytearray") -> "Any":
                text = data.decode() if isinstance(data, (bytes, bytearray)) else data
                obj, end = scan(text, len(text) - len(text.lstrip()))
                if text[end:].strip():
                    raise ValueError("extra data after the JSON value")
                return obj

            sample = {"a": [1, 2.5, "\u00e9\n", None, True, False, {}]}
            if loads(dumps(sample).encode()) != sample:
                raise ValueError("round trip differs")
            self.dumps, self.loads = dumps, loads
        except Exception:  # any other interpreter: the package (slower to import)
            import json

            self.dumps, self.loads = json.dumps, json.loads

    def parse_constant(self, name: str) -> float:
        return self.CONSTANTS[name]

    @staticmethod
    def default(obj: object) -> "NoReturn":
        raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


json = Codec()


class Poller:
    """The part of ``selectors`` the helper uses, over ``select.epoll``: fds and their data;
    ``select`` yields (fd, data) for each ready fd (errors and hang-ups count as ready)."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.data: dict[int, Event] = {}

    def register(self, fd: "int | socket.socket", events: int, data: "Event") -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        self.epoll.register(fd, events)
        self.data[fd] = data

    def unregister(self, fd: "int | socket.socket") -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        del self.data[fd]
        try:
            self.epoll.unregister(fd)
        except OSError:
            pass

    def select(self, timeout: "float | None") -> "list[tuple[int, Event]]":
        events = self.epoll.poll(-1 if timeout is None else timeout)
        return [(fd, self.data[fd]) for fd, _ in events if fd in self.data]


READ, WRITE = select.EPOLLIN, select.EPOLLOUT

PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
#: How much more likely than the helper a process it starts is to be the OOM killer's pick.
CHILD_OOM_BONUS = 1000


def libc(name: str) -> "Callable[..., int]":
    """The C library's ``name`` (a function returning an ``int``) through ``_ctypes`` alone
    (~0.7 ms the first time; the ``ctypes`` package costs ~5 ms more through ``struct`` and
    ``ctypes._endian``). Takes ints and bytes; its errno is ``_ctypes.get_errno()``."""
    import _ctypes

    if TYPE_CHECKING:
        SimpleInt = _ctypes._SimpleCData[int]
    else:  # not subscriptable at run time
        SimpleInt = _ctypes._SimpleCData

    class Int(SimpleInt):
        _type_ = "i"

    class Function(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
        _restype_ = Int

    class Libc:
        _handle = _ctypes.dlopen(None)  # type: ignore[arg-type]  # NULL: the program itself

    return Function((name, Libc))  # type: ignore[arg-type]  # any object with _handle


def prctl(option: int, arg: int) -> int:
    """``prctl(option, arg, 0, 0, 0)``: its errno, 0 when it succeeded."""
    import _ctypes

    return 0 if libc("prctl")(option, arg, 0, 0, 0) == 0 else _ctypes.get_errno()


def warn(text: str) -> None:
    """A line on the helper's stderr: a non-blocking pipe that the daemon reads (never a
    host file); a line that does not fit is dropped rather than waited for."""
    try:
        posix.write(2, f"helper: {text}\n".encode())
    except OSError:
        pass


def set_oom_score_adj(fd: int, value: int) -> None:
    try:
        posix.write(fd, str(value).encode())
    except OSError as exc:
        warn(f"oom_score_adj {value}: {exc}")


class Refused(Exception):
    """A request the helper will not carry out (sent back as an error of type ``kind``)."""

    def __init__(self, kind: str, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.kind = kind
        self.code = code


def exit_code(status: int) -> int:
    return posix.waitstatus_to_exitcode(status)


#: Every signal a child gets back at its default: Python ignores SIGPIPE and SIGXFSZ, and
#: the daemon may have been started with some ignored (nohup, a CI runner), which a child
#: would inherit. (glibc's internal signals 32 and 33 are not valid_signals().)
RESET_SIGNALS = tuple(sorted(set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}))


#: What the helper itself ignores. SIGTERM and SIGINT: the daemon drains on them, and a
#: Slurm job step's ``scancel`` (or an ``srun`` interrupt) sends them to every process of
#: the step, this one included; the sandbox ends when the daemon is done with it (its
#: shutdown request, SIGKILL, or the daemon's death: the parent-death signal). SIGPIPE and
#: SIGXFSZ, as Python sets them. Ignored, not handled: under bwrap the helper is the PID
#: namespace's init, and the kernel drops every signal sent to it from inside the sandbox
#: for which it has no handler.
IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ)


def restore_signals() -> None:
    for sig in RESET_SIGNALS:
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def own_signals(on_child: "Callable[..., object]") -> None:
    """The helper's own signal state, whatever it inherited (a daemon started with signals
    blocked or ignored passes them on): nothing blocked, ``on_child`` for SIGCHLD (it wakes
    the loop), the IGNORED_SIGNALS ignored, every other signal at its default. Only what
    differs is changed (``getsignal`` reads Python's table: no system call)."""
    for sig in RESET_SIGNALS:
        want = on_child if sig == signal.SIGCHLD else \
            signal.SIG_IGN if sig in IGNORED_SIGNALS else signal.SIG_DFL
        if signal.getsignal(sig) != want:
            try:
                signal.signal(sig, want)
            except (OSError, ValueError):
                pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def scan_marked(marker: bytes, unsure: "list[int] | None" = None) -> "list[int]":
    """Pids whose initial environment carries ``marker`` (bytes, ``NAME=value``). Live
    processes whose environment reads empty go to ``unsure`` (a list) if given: a process
    in the middle of an execve shows none for a moment.

    The one implementation of the marker scan: the helper runs it inside the sandbox, the
    daemon (sandbox/_backend.py) on the host, in a worker thread (it reads all of /proc)."""
    me = posix.getpid()
    found: list[int] = []
    try:
        names = posix.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open("/proc/" + name + "/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if env.startswith(marker + b"\0") or (b"\0" + marker + b"\0") in env:
            found.append(int(name))
        elif not env and unsure is not None and not is_zombie(name):
            unsure.append(int(name))
    return found


def is_zombie(pid: "int | str") -> bool:
    try:
        with open("/proc/" + str(pid) + "/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def kill_marked(marker: bytes, rounds: int = 4) -> None:
    """SIGKILL every process carrying ``marker``; repeat while new ones keep turning up,
    or while some process's environment could not be seen yet (mid-execve)."""
    for _ in range(rounds):
        unsure: list[int] = []
        pids = scan_marked(marker, unsure)
        if not pids and not unsure:
            return
        for pid in pids:
            try:
                posix.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if unsure and not pids:
            time.sleep(0.001)  # let an execve finish before looking again


def killpg(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        posix.killpg(pgid, sig)
    except OSError:
        pass


class Capture:
    """Bounded head+tail capture of one stream; the middle is counted, not kept."""

    def __init__(self, limit: int) -> None:
        self.head_max = limit // 2
        self.tail_max = limit - self.head_max
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.closed = False

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_max - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_max + CHUNK:
                del self.tail[: len(self.tail) - self.tail_max]

    @property
    def truncated(self) -> bool:
        return self.total > self.head_max + self.tail_max

    def value(self) -> bytes:
        if not self.truncated:
            return bytes(self.head + self.tail)
        tail = self.tail[-self.tail_max :] if self.tail_max else b""
        cut = self.total - len(self.head) - len(tail)
        note = f"\n[... {cut} bytes truncated ...]\n".encode()
        return bytes(self.head) + note + bytes(tail)


class Proc:
    def __init__(self, pid: int, pty: "PtyProcess | None" = None) -> None:
        self.pid = pid
        self.pgid = pid
        self.pty = pty  # the ptyprocess object (kept so it never closes our master)
        self.returncode: int | None = None
        self.waiters: list[Conn] = []
        self.run: Run | None = None


class Run:
    """A ``run`` request in progress: pipes, capture, deadline, the connection to answer."""

    def __init__(self, conn: "Conn | None", proc: Proc, marker: bytes, out: int, err: int,
                 stdin_fd: "int | None", stdin_data: bytes, deadline: float,
                 limit: int) -> None:
        self.conn = conn
        self.proc = proc
        self.marker = marker
        self.fds = {out: Capture(limit), err: Capture(limit)}
        self.out, self.err = out, err
        self.stdin_fd = stdin_fd
        self.stdin_data = memoryview(stdin_data)
        self.deadline = deadline
        self.drain_deadline: float | None = None
        self.timed_out = False
        self.started = time.monotonic()


class Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.pending: tuple[str, Any] | None = None  # ("wait", Proc) | ("run", Run)


class Helper:
    def __init__(self, cfg: "Message") -> None:
        self.cfg = cfg
        self.sock_path: str = cfg["socket"]
        self.workdir: str = cfg["workdir"]
        self.env: dict[str, str] = dict(cfg.get("env", {}))
        self.marker_name: str = cfg.get("marker_name", "ROLLOUTD_SANDBOX")
        self.marker_value: str = cfg.get("marker_value", "")
        self.roots = [real_dir(r) for r in cfg.get("roots", [self.workdir])]
        self.cwd: str | None = None  # the workdir once the helper is in it
        self.procs: dict[int, Proc] = {}
        self.exited: dict[int, int] = {}
        self.runs: list[Run] = []
        self.run_seq = 0
        self.sel = Poller()
        self.stopping = False
        self.exit_status = 0
        self.oom_fd: int | None  # see protect()
        self.oom_fd, self.oom, self.child_oom = None, 0, 0
        lifetime = cfg.get("lifetime_s")
        self.expires = None if lifetime is None else time.monotonic() + float(lifetime)

    # ----- start-up --------------------------------------------------------------------
    def start(self) -> None:
        try:  # bwrap starts us there already; local in the sandbox's dir
            posix.chdir(self.workdir)
            self.cwd = self.workdir
        except OSError:
            self.cwd = None
        self.apply_rlimits(self.cfg.get("rlimits") or {})
        if self.cfg.get("parent_death"):
            self.set_parent_death()
        try:
            posix.unlink(self.sock_path)
        except FileNotFoundError:
            pass
        old = posix.umask(0o077)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.sock_path)
        posix.umask(old)
        self.listener.listen(256)
        self.listener.setblocking(False)
        self.sel.register(self.listener, READ, ("accept", None))
        self.wake_r, self.wake_w = posix.pipe2(posix.O_NONBLOCK | posix.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        own_signals(lambda *_: None)
        self.sel.register(self.wake_r, READ, ("wake", None))
        self.watch_lifeline()
        posix.write(1, f"READY {posix.getpid()}\n".encode())
        null = posix.open(DEVNULL, posix.O_RDWR)
        posix.dup2(null, 1)
        posix.close(null)
        self.protect()  # after READY (off the open's path), before any sandbox process exists

    def watch_lifeline(self) -> None:
        """Watch the daemon's lifeline (``cfg["lifeline"]``, an fd we inherited): its hang-up
        means the daemon is gone, even one that died before we started. Kept from what we
        spawn. A backend that could not pass it on (Apptainer may not) leaves the helper to
        its parent-death signal and lifetime, with a warning."""
        fd = self.cfg.get("lifeline")
        if fd is None:
            return
        try:
            if posix.fstat(fd).st_mode & S_IFMT != S_IFIFO:
                raise OSError(errno.EBADF, "not a pipe")
            posix.set_inheritable(fd, False)
            self.sel.register(fd, READ, ("lifeline", None))
        except OSError as exc:
            warn(f"no lifeline on fd {fd}: {exc}")

    def protect(self) -> None:
        """What no process of the sandbox may do to the helper. Not dumpable: tracing it,
        reading its memory or environment and opening its fds through /proc/1/fd then take
        CAP_SYS_PTRACE, which nothing inside has (its fds hold nothing of the host anyway:
        stderr is a pipe to the daemon). And the OOM killer's last pick: everything it
        starts gets ``CHILD_OOM_BONUS`` more oom_score_adj than the helper's own, which it
        keeps (lowering it takes CAP_SYS_RESOURCE, which nothing inside has; a command may
        lower its own back to the helper's value, not below)."""
        try:  # opened first: once not dumpable, /proc/self's files are root's
            self.oom_fd = posix.open("/proc/self/oom_score_adj", posix.O_RDWR | posix.O_CLOEXEC)
            self.oom = int(posix.read(self.oom_fd, 16))
        except (OSError, ValueError) as exc:
            warn(f"oom_score_adj: {exc}")
            self.oom_fd = None
        self.child_oom = min(1000, self.oom + CHILD_OOM_BONUS) if self.oom_fd is not None else 0
        err = prctl(PR_SET_DUMPABLE, 0)
        if err:
            warn(f"PR_SET_DUMPABLE: {posix.strerror(err)}")

    def as_parent(self, start: "Callable[P, T]", *args: "P.args", **kwargs: "P.kwargs") -> "T":
        """``start(*args, **kwargs)``, which starts a process, with the helper's
        oom_score_adj raised to its children's meanwhile, so that what it starts inherits
        that from the first instruction on (posix_spawn has no hook before the exec); then
        back down (allowed unprivileged: to no less than the helper started with)."""
        if self.oom_fd is None or self.child_oom == self.oom:
            return start(*args, **kwargs)
        set_oom_score_adj(self.oom_fd, self.child_oom)
        try:
            return start(*args, **kwargs)
        finally:
            set_oom_score_adj(self.oom_fd, self.oom)

    def apply_rlimits(self, limits: "dict[str, int]") -> None:
        if not limits:
            return
        import resource

        for name, value in limits.items():
            res = getattr(resource, name)
            _soft, hard = resource.getrlimit(res)
            value = int(value)
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            try:
                resource.setrlimit(res, (value, value))
            except (ValueError, OSError) as exc:
                warn(f"setrlimit {name}={value} failed: {exc}")

    def set_parent_death(self) -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if posix.getppid() != self.cfg["parent_death"]:
            posix._exit(1)

    # ----- main loop -------------------------------------------------------------------
    def serve(self) -> None:
        while not self.stopping:
            timeout = self.next_timeout()
            for fd, (kind, obj) in self.sel.select(timeout):
                if kind == "accept":
                    self.accept()
                elif kind == "wake":
                    self.drain_wakeups()
                elif kind == "conn":
                    self.on_readable(obj)
                elif kind == "pipe":
                    self.on_pipe(obj, fd)
                elif kind == "stdin":
                    self.on_stdin(obj)
                elif kind == "lifeline":
                    warn("the daemon is gone; killing everything")
                    self.stopping = True
            self.reap()
            self.check_runs()
            if self.expires is not None and time.monotonic() >= self.expires:
                warn("sandbox lifetime reached; killing everything")
                self.stopping = True
                self.exit_status = LIFETIME_EXIT
        self.kill_all()

    def next_timeout(self) -> "float | None":
        now = time.monotonic()
        soonest = self.expires
        for run in self.runs:
            for t in (run.deadline, run.drain_deadline):
                if t is not None and (soonest is None or t < soonest):
                    soonest = t
        if soonest is None:
            return None
        return max(0.0, soonest - now)

    def accept(self) -> None:
        while True:
            try:
                fd, _ = self.listener._accept()  # type: ignore[attr-defined]  # accept4, CLOEXEC
            except (BlockingIOError, InterruptedError):
                return
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            conn = Conn(sock)
            self.sel.register(sock, READ, ("conn", conn))

    def drain_wakeups(self) -> None:
        try:
            while posix.read(self.wake_r, 4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def on_readable(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.drop(conn)
            return
        if conn.pending is not None:
            return  # one request per connection; ignore anything more
        conn.buf += data
        if len(conn.buf) < HEADER.size:
            return
        jlen, blen = HEADER.unpack_from(conn.buf)
        if len(conn.buf) < HEADER.size + jlen + blen:
            return
        req = json.loads(bytes(conn.buf[HEADER.size : HEADER.size + jlen]))
        blob = bytes(conn.buf[HEADER.size + jlen : HEADER.size + jlen + blen])
        conn.buf = bytearray()
        self.dispatch(conn, req, blob)

    def dispatch(self, conn: Conn, req: "Message", blob: bytes) -> None:
        op = req.get("op")
        handler = getattr(self, "op_" + str(op), None)
        try:
            if handler is None:
                raise Refused("BadRequest", f"unknown op {op!r}")
            result = handler(conn, req, blob)
        except Refused as exc:
            self.reply(conn, {"ok": False, "error": {"type": exc.kind, "message": str(exc),
                                                     "errno": exc.code}})
            return
        except OSError as exc:
            self.reply(conn, {"ok": False, "error": {"type": "OSError", "errno": exc.errno or 0,
                                                     "message": exc.strerror or str(exc)}})
            return
        except Exception as exc:  # a helper bug must not kill the sandbox
            self.reply(conn, {"ok": False, "error": {"type": "HelperError",
                                                     "message": f"{type(exc).__name__}: {exc}"}})
            return
        if result is not None:
            msg, out_blob, fds = result
            self.reply(conn, msg, out_blob, fds)

    def reply(self, conn: Conn, msg: "Message", blob: bytes = b"",
              fds: "tuple[int, ...]" = ()) -> None:
        if "ok" not in msg:
            msg = dict(msg, ok=True)
        body = json.dumps(msg).encode()
        data = HEADER.pack(len(body), len(blob)) + body + blob
        sock = conn.sock
        try:
            sock.settimeout(30)
            if fds:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
                sent = sock.sendmsg([data], anc)
                data = data[sent:]
            if data:
                sock.sendall(data)
        except OSError:
            pass
        finally:
            for fd in fds:
                posix.close(fd)
        self.drop(conn)

    def drop(self, conn: Conn) -> None:
        pending, conn.pending = conn.pending, None
        if pending is not None:
            kind, obj = pending
            if kind == "wait" and conn in obj.waiters:
                obj.waiters.remove(conn)
            elif kind == "run":
                self.cancel_run(obj)
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # ----- processes -------------------------------------------------------------------
    def child_env(self, extra: "Message | None", marker: "str | None" = None) -> "dict[str, str]":
        env = dict(self.env)
        if extra:
            env.update({str(k): str(v) for k, v in extra.items()})
        env[self.marker_name] = self.marker_value
        if marker:
            name, _, value = marker.partition("=")
            env[name] = value
        return env

    def resolve_cwd(self, cwd: "str | None") -> str:
        if not cwd:
            return self.workdir
        return cwd if cwd.startswith("/") else join(self.workdir, cwd)

    def fork_exec(self, argv: "list[str]", env: "dict[str, str]", cwd: str, fd0: int, fd1: int,
                  fd2: int) -> int:
        program = which(argv[0], env.get("PATH"), cwd)
        if cwd == self.cwd and same_dir(".", cwd):
            # posix_spawn: vfork and exec, no copy of our page tables (~0.4 ms less per
            # command). Python 3.11's cannot chdir, hence only in our own cwd. Like every
            # posix_spawn'd process on glibc, the child starts with glibc's two internal
            # signals (32, 33) ignored; the standard ones are at their defaults.
            actions = [(posix.POSIX_SPAWN_DUP2, fd, target)
                       for target, fd in ((0, fd0), (1, fd1), (2, fd2))]
            try:
                return posix.posix_spawn(program, argv, env, file_actions=actions, setsid=True,
                                      setsigdef=RESET_SIGNALS, setsigmask=())
            except OSError as exc:
                raise Refused("SpawnError", str(exc), exc.errno or 0) from None
        err_r, err_w = posix.pipe2(posix.O_CLOEXEC)
        pid = posix.fork()
        if pid == 0:
            try:
                posix.close(err_r)
                signal.set_wakeup_fd(-1)
                restore_signals()
                posix.setsid()
                for target, fd in ((0, fd0), (1, fd1), (2, fd2)):
                    if fd != target:
                        posix.dup2(fd, target)
                    else:
                        posix.set_inheritable(fd, True)
                posix.chdir(cwd)
                posix.execve(program, argv, env)
            except BaseException as exc:
                code = getattr(exc, "errno", 0) or 0
                try:
                    posix.write(err_w, f"{code}:{exc}".encode())
                finally:
                    posix._exit(127)
        posix.close(err_w)
        try:
            failure = b""
            while chunk := posix.read(err_r, 4096):  # EOF once the exec succeeded (CLOEXEC)
                failure += chunk
        finally:
            posix.close(err_r)
        if failure:
            try:
                posix.waitpid(pid, 0)
            except ChildProcessError:
                pass
            code, _, text = failure.decode(errors="replace").partition(":")
            raise Refused("SpawnError", text, int(code) if code.isdigit() else 0)
        return pid

    def spawn_pipes(self, argv: "list[str]", env: "dict[str, str]", cwd: str, stdin_null: bool = False,
                    merge: bool = False) -> "tuple[Proc, int | None, int, int | None]":
        if stdin_null:
            in_r, in_w = posix.open(DEVNULL, posix.O_RDONLY | posix.O_CLOEXEC), None
        else:
            in_r, in_w = posix.pipe2(posix.O_CLOEXEC)
        out_r, out_w = posix.pipe2(posix.O_CLOEXEC)
        err_r, err_w = (None, out_w) if merge else posix.pipe2(posix.O_CLOEXEC)
        try:
            pid = self.as_parent(self.fork_exec, argv, env, cwd, in_r, out_w, err_w)
        except BaseException:
            for fd in {in_r, in_w, out_r, out_w, err_r, err_w}:
                if fd is not None:
                    posix.close(fd)
            raise
        for fd in {in_r, out_w, err_w}:
            posix.close(fd)
        proc = Proc(pid)
        self.procs[pid] = proc
        return proc, in_w, out_r, err_r

    def op_ping(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        return {"pid": posix.getpid(), "python": sys.version.split()[0]}, b"", ()

    def op_setenv(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        """Change the environment every later process starts with (an activated env)."""
        for name in req.get("unset") or ():
            self.env.pop(str(name), None)
        for name, value in (req.get("set") or {}).items():
            if "=" in str(name) or "\0" in str(name) + str(value) or not name:
                raise Refused("BadRequest", f"bad environment variable {name!r}")
            if name in (self.marker_name, "ROLLOUTD_RUN"):  # the helper's own markers
                raise Refused("BadRequest", f"{name} is the sandbox's own variable")
            self.env[str(name)] = str(value)
        return {}, b"", ()

    def op_spawn(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        argv = [str(a) for a in req["argv"]]
        if not argv:
            raise Refused("BadRequest", "empty argv")
        env = self.child_env(req.get("env"))
        cwd = self.resolve_cwd(req.get("cwd"))
        if req.get("pty"):
            from ptyprocess import PtyProcess  # lazy: only pty spawns pay for it

            try:
                pty = self.as_parent(PtyProcess.spawn, argv, cwd=cwd, env=env,
                                     echo=req.get("echo", True), preexec_fn=restore_signals,
                                     dimensions=(int(req.get("rows", 50)), int(req.get("cols", 200))))
            except OSError as exc:
                raise Refused("SpawnError", str(exc), exc.errno or 0) from None
            proc = Proc(pty.pid, pty)
            self.procs[pty.pid] = proc
            return {"pid": pty.pid}, b"", (posix.dup(pty.fd),)
        proc, in_w, out_r, _ = self.spawn_pipes(argv, env, cwd, merge=True)  # stderr -> stdout
        assert in_w is not None  # stdin is a pipe: not stdin_null
        return {"pid": proc.pid}, b"", (in_w, out_r)

    def op_listen(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        """A TCP socket listening on the sandbox's own loopback (``port``, 0: any free one),
        passed to the daemon: it accepts there, in the sandbox's network namespace, while
        the sandbox keeps no other network (one endpoint per sandbox, e.g. an LLM API)."""
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind(("127.0.0.1", int(req.get("port") or 0)))
            lsock.listen(128)
            port = lsock.getsockname()[1]
            fd = posix.dup(lsock.fileno())
        finally:
            lsock.close()
        return {"port": port}, b"", (fd,)

    def op_wait(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        pid = int(req["pid"])
        proc = self.procs.get(pid)
        if proc is None:
            if pid in self.exited:
                return {"returncode": self.exited[pid]}, b"", ()
            raise Refused("NoSuchProcess", f"pid {pid} is not a child of this sandbox", errno.ESRCH)
        proc.waiters.append(conn)
        conn.pending = ("wait", proc)
        return None

    def is_ours(self, pid: int) -> bool:
        if pid in self.procs:
            return True
        marker = (f"{self.marker_name}={self.marker_value}").encode()
        return pid in scan_marked(marker)

    def op_signal(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        pid, sig, group = int(req["pid"]), int(req["sig"]), bool(req.get("group", True))
        if pid <= 0 or not self.is_ours(pid):
            raise Refused("NoSuchProcess", f"pid {pid} is not a process of this sandbox", errno.ESRCH)
        if not group:
            posix.kill(pid, sig)
            return {}, b"", ()
        proc = self.procs.get(pid)
        pgids = set()
        try:
            pgids.add(posix.getpgid(pid))
        except ProcessLookupError:
            if proc is not None:
                pgids.add(proc.pgid)
        if proc is not None and proc.pty is not None:
            try:
                pgids.add(posix.tcgetpgrp(proc.pty.fd))
            except OSError:
                pass
        for pgid in pgids:
            if pgid > 1:
                killpg(pgid, sig)
        return {"groups": sorted(pgids)}, b"", ()

    def op_run(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        argv = [str(a) for a in req["argv"]]
        if not argv:
            raise Refused("BadRequest", "empty argv")
        self.run_seq += 1
        marker = f"ROLLOUTD_RUN={posix.getpid()}.{self.run_seq}"
        env = self.child_env(req.get("env"), marker)
        cwd = self.resolve_cwd(req.get("cwd"))
        has_stdin = bool(req.get("stdin"))
        proc, in_w, out_r, err_r = self.spawn_pipes(argv, env, cwd, stdin_null=not has_stdin)
        assert err_r is not None  # a pipe of its own: not merge
        for fd in (out_r, err_r):
            posix.set_blocking(fd, False)
        if in_w is not None:
            posix.set_blocking(in_w, False)
        deadline = time.monotonic() + float(req["timeout_s"])
        run = Run(conn, proc, marker.encode(), out_r, err_r, in_w, blob, deadline,
                  int(req.get("max_output_bytes", 1_000_000)))
        proc.run = run
        self.runs.append(run)
        conn.pending = ("run", run)
        self.sel.register(out_r, READ, ("pipe", run))
        self.sel.register(err_r, READ, ("pipe", run))
        if in_w is not None:
            if blob:
                self.sel.register(in_w, WRITE, ("stdin", run))
            else:
                posix.close(in_w)
                run.stdin_fd = None
        return None

    def on_stdin(self, run: Run) -> None:
        assert run.stdin_fd is not None  # registered only while open (close_stdin)
        try:
            n = posix.write(run.stdin_fd, run.stdin_data[:CHUNK])
            run.stdin_data = run.stdin_data[n:]
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            run.stdin_data = run.stdin_data[:0]
        if not run.stdin_data:
            self.close_stdin(run)

    def close_stdin(self, run: Run) -> None:
        if run.stdin_fd is not None:
            try:
                self.sel.unregister(run.stdin_fd)
            except (KeyError, ValueError):
                pass
            posix.close(run.stdin_fd)
            run.stdin_fd = None

    def on_pipe(self, run: Run, fd: int) -> None:
        try:
            data = posix.read(fd, CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            run.fds[fd].feed(data)
            return
        self.sel.unregister(fd)
        posix.close(fd)
        run.fds[fd].closed = True

    def run_pipes_open(self, run: Run) -> "list[int]":
        return [fd for fd, cap in run.fds.items() if not cap.closed]

    def kill_run_tree(self, run: Run) -> None:
        killpg(run.proc.pgid)
        kill_marked(run.marker)

    def check_runs(self) -> None:
        now = time.monotonic()
        for run in list(self.runs):
            if run.proc.returncode is None and now >= run.deadline and not run.timed_out:
                run.timed_out = True
                self.kill_run_tree(run)
            if run.proc.returncode is None:
                continue
            if run.drain_deadline is None:
                # the command returned: whatever it left behind (setsid, double fork) goes now
                self.kill_run_tree(run)
                self.close_stdin(run)
                run.drain_deadline = now + DRAIN_GRACE_S
            if self.run_pipes_open(run) and now < run.drain_deadline:
                continue
            self.finish_run(run)

    def finish_run(self, run: Run) -> None:
        self.runs.remove(run)
        for fd in self.run_pipes_open(run):
            self.sel.unregister(fd)
            posix.close(fd)
        self.close_stdin(run)
        out, err = run.fds[run.out], run.fds[run.err]
        stdout, stderr = out.value(), err.value()
        msg = {"exit_code": None if run.timed_out else run.proc.returncode,
               "returncode": run.proc.returncode, "timed_out": run.timed_out,
               "truncated": out.truncated or err.truncated, "stdout_len": len(stdout),
               "stdout_total": out.total, "stderr_total": err.total,
               "duration_s": time.monotonic() - run.started}
        conn, run.conn = run.conn, None
        if conn is not None:
            conn.pending = None
            self.reply(conn, msg, stdout + stderr)

    def cancel_run(self, run: Run) -> None:
        run.conn = None
        if run.proc.returncode is None:
            run.timed_out = True
            self.kill_run_tree(run)

    def reap(self) -> None:
        while True:
            try:
                pid, status = posix.waitpid(-1, posix.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            proc = self.procs.pop(pid, None)
            if proc is None:
                continue
            proc.returncode = exit_code(status)
            self.exited[pid] = proc.returncode
            if len(self.exited) > KEEP_EXITED:
                self.exited.pop(next(iter(self.exited)))
            if proc.pty is not None:
                try:
                    proc.pty.fileobj.close()
                except OSError:
                    pass
                proc.pty.closed = True
            for conn in proc.waiters:
                conn.pending = None
                self.reply(conn, {"returncode": proc.returncode})
            proc.waiters = []

    def op_shutdown(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        self.stopping = True
        self.kill_all()
        return {}, b"", ()

    def op_kill_all(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        self.kill_all()
        return {}, b"", ()

    def kill_all(self) -> None:
        for proc in list(self.procs.values()):
            killpg(proc.pgid)
            try:
                posix.kill(proc.pid, signal.SIGKILL)
            except OSError:
                pass
        kill_marked((f"{self.marker_name}={self.marker_value}").encode())

    # ----- files -----------------------------------------------------------------------
    def absolute(self, path: object) -> str:
        import posixpath  # os.path: imported at the first file operation

        if not isinstance(path, str) or not path or "\0" in path:
            raise Refused("BadRequest", f"invalid path {path!r}")
        return posixpath.normpath(path if path.startswith("/") else join(self.workdir, path))

    def within(self, real: str) -> bool:
        return any(real == root or real.startswith(root.rstrip("/") + "/") for root in self.roots)

    def resolve(self, path: object) -> str:
        """The real path of ``path``, which must stay within the roots."""
        import posixpath  # os.path: imported at the first file operation

        real = posixpath.realpath(self.absolute(path))
        if not self.within(real):
            raise Refused("PathEscape", "{} resolves to {}, outside {}".format(path, real, ", ".join(self.roots)), errno.EACCES)
        return real

    def check_fd(self, fd: int, path: object) -> int:
        real = posix.readlink(f"/proc/self/fd/{fd}")
        if not self.within(real):
            posix.close(fd)
            raise Refused("PathEscape", f"{path} moved outside the sandbox roots", errno.EACCES)
        return fd

    def open_dir(self, real: str, path: object) -> int:
        fd = posix.open(real, posix.O_RDONLY | posix.O_DIRECTORY | posix.O_NOFOLLOW | posix.O_CLOEXEC)
        return self.check_fd(fd, path)

    def parent_fd(self, path: object, follow_last: bool) -> "tuple[int, str]":
        """(dir fd, final name) for ``path``: the parent is resolved and checked."""
        import posixpath  # os.path: imported at the first file operation

        ab = self.absolute(path)
        if follow_last:
            ab = self.resolve(path)
        parent, name = posixpath.split(ab)
        if not name or name in (".", ".."):
            raise Refused("BadRequest", f"{path} names no file", errno.EINVAL)
        real_parent = self.resolve(parent)
        return self.open_dir(real_parent, path), name

    def op_read_file(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        path = req["path"]
        real = self.resolve(path)
        fd = posix.open(real, posix.O_RDONLY | posix.O_NOFOLLOW | posix.O_CLOEXEC | posix.O_NONBLOCK)
        self.check_fd(fd, path)
        try:
            st = posix.fstat(fd)
            if not (st.st_mode & 0o170000 == 0o100000):
                raise OSError(errno.EISDIR if st.st_mode & 0o040000 else errno.EINVAL,
                              f"not a regular file: {path}")
            limit = req.get("max_bytes")
            limit = st.st_size if limit is None else min(int(limit), st.st_size)
            chunks, got = [], 0
            while got < limit:
                data = posix.read(fd, min(limit - got, 1 << 20))
                if not data:
                    break
                chunks.append(data)
                got += len(data)
        finally:
            posix.close(fd)
        return {"size": st.st_size}, b"".join(chunks), ()

    def op_write_file(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        dfd, name = self.parent_fd(req["path"], follow_last=True)
        try:
            mode = req.get("mode")
            # No O_TRUNC: write over the old bytes, then cut the file to the new length.
            # ext4 treats truncate-to-zero followed by a rewrite as a "replace" and flushes
            # it (auto_da_alloc), which costs milliseconds per edit.
            flags = posix.O_WRONLY | posix.O_CREAT | posix.O_NOFOLLOW | posix.O_CLOEXEC
            fd = posix.open(name, flags, 0o644 if mode is None else int(mode), dir_fd=dfd)
            try:
                view = memoryview(blob)
                while view:
                    view = view[posix.write(fd, view) :]
                posix.ftruncate(fd, len(blob))
                if mode is not None:
                    posix.fchmod(fd, int(mode))
            finally:
                posix.close(fd)
        finally:
            posix.close(dfd)
        return {}, b"", ()

    def op_list_dir(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        path = req["path"]
        fd = self.open_dir(self.resolve(path), path)
        entries: list[Message] = []
        try:
            with posix.scandir(fd) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    entries.append({"name": entry.name, "type": file_type(st.st_mode),
                                    "size": st.st_size, "mode": st.st_mode & 0o7777,
                                    "mtime": st.st_mtime})
        finally:
            posix.close(fd)
        entries.sort(key=lambda e: e["name"])
        return {"entries": entries}, b"", ()

    def op_stat(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        path = req["path"]
        real = self.resolve(path)
        try:
            st = posix.stat(real, follow_symlinks=False)
        except FileNotFoundError:
            return {"stat": None}, b"", ()
        return {"stat": {"path": real, "type": file_type(st.st_mode), "size": st.st_size,
                         "mode": st.st_mode & 0o7777, "mtime": st.st_mtime}}, b"", ()

    def op_mkdir(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        import posixpath  # os.path: imported at the first file operation

        path = req["path"]
        real = self.resolve(path)
        parts = []
        base = real
        while not posixpath.lexists(base):
            base, name = posixpath.split(base)
            parts.append(name)
        if not parts:
            if posixpath.isdir(real):
                return {}, b"", ()
            raise OSError(errno.EEXIST, f"exists and is not a directory: {path}")
        if len(parts) > 1 and not req.get("parents", True):
            raise OSError(errno.ENOENT, f"parent directory missing: {path}")
        fd = self.open_dir(self.resolve(base), path)
        try:
            for name in reversed(parts):
                try:
                    posix.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = posix.open(name, posix.O_RDONLY | posix.O_DIRECTORY | posix.O_NOFOLLOW | posix.O_CLOEXEC,
                              dir_fd=fd)
                posix.close(fd)
                fd = self.check_fd(nfd, path)
        finally:
            posix.close(fd)
        return {}, b"", ()

    def op_remove(self, conn: Conn, req: "Message", blob: bytes) -> "Reply | None":
        path = req["path"]
        dfd, name = self.parent_fd(path, follow_last=False)
        try:
            st = posix.stat(name, dir_fd=dfd, follow_symlinks=False)
            if st.st_mode & 0o170000 == 0o040000:
                import shutil

                shutil.rmtree(name, dir_fd=dfd)
            else:
                posix.unlink(name, dir_fd=dfd)
        finally:
            posix.close(dfd)
        return {}, b"", ()


def same_dir(a: str, b: str) -> bool:
    try:
        sa, sb = posix.stat(a), posix.stat(b)
        return sa.st_ino == sb.st_ino and sa.st_dev == sb.st_dev
    except OSError:
        return False


def which(name: str, path: "str | None", cwd: str) -> str:
    """The program ``execvpe`` would run for ``name``, found here rather than in the forked
    child (``os.execvpe`` imports ``warnings`` there: ~2 ms per spawn). A name with a
    slash is taken as it is (relative to ``cwd``); one not found raises ENOENT, one
    found but not executable EACCES, as execvp does."""
    if "/" in name:
        return name if name.startswith("/") else join(cwd, name)
    denied = False
    for folder in (path if path is not None else DEFPATH).split(":"):
        candidate = join(folder or ".", name)
        if not candidate.startswith("/"):
            candidate = join(cwd, candidate)
        if is_file(candidate):
            if posix.access(candidate, posix.X_OK):
                return candidate
            denied = True
    if denied:
        raise Refused("SpawnError", f"[Errno 13] Permission denied: {name!r}", errno.EACCES)
    raise Refused("SpawnError", f"[Errno 2] No such file or directory: {name!r}", errno.ENOENT)


def file_type(mode: int) -> str:
    kind = mode & 0o170000
    if kind == 0o100000:
        return "file"
    if kind == 0o040000:
        return "dir"
    if kind == 0o120000:
        return "symlink"
    return "other"


def wait_for_go() -> bool:
    """A parked image sandbox's helper (argv ``wait``): block until the daemon's ``go``
    line on stdin, the launcher's pipe. False on anything else (EOF: the daemon is gone
    or discarded the spare)."""
    line = b""
    while b"\n" not in line and len(line) < 16:
        chunk = posix.read(0, 16)
        if not chunk:
            break
        line += chunk
    return line == b"go\n"


def null_stdin() -> None:
    null = posix.open(DEVNULL, posix.O_RDONLY)
    if null != 0:
        posix.dup2(null, 0)
        posix.close(null)


def main() -> None:
    stage_calls = None
    if sys.argv[2:3] == ["wait"]:  # parked: load what the open needs, then wait for it
        import resource  # noqa: F401  # rlimits (the launcher's are set before we run)

        import _stage

        stage_calls = _stage.Calls(libc)
        if not wait_for_go():
            posix._exit(0)
    # stdin is the launcher's pipe, or closed (bwrap closes the fd it read its options
    # from): /dev/null there before any fd is made, or the next one would be fd 0.
    null_stdin()
    with open(sys.argv[1], "rb") as f:  # written by the daemon just before the start
        cfg = json.loads(f.read())
    posix.unlink(sys.argv[1])
    if cfg.get("stage") is not None or stage_calls is not None:
        # an image sandbox: its root, then no capability (a parked one must get a root)
        import _stage

        try:
            if cfg.get("stage") is None:
                raise _stage.StageError("a parked image sandbox was given no image root")
            stage_calls = stage_calls or _stage.Calls(libc)
            _stage.enter(cfg["stage"], stage_calls)
            _stage.drop_capabilities(stage_calls)
        except (_stage.StageError, OSError, ValueError) as exc:
            warn(f"cannot set up the sandbox's root: {exc}")
            posix._exit(1)
        null_stdin()  # the sandbox's /dev/null: the staging root's is gone
    for path in cfg.get("sys_path", []):
        sys.path.insert(0, path)
    helper = Helper(cfg)
    helper.start()
    try:
        helper.serve()
    finally:
        try:
            posix.unlink(helper.sock_path)
        except OSError:
            pass
    raise SystemExit(helper.exit_status)


if __name__ == "__main__":
    main()
