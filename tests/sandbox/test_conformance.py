"""One conformance suite, run against every backend available here (bwrap and local in
CI; apptainer where its binary is). Real processes, real ptys, real namespaces."""

from __future__ import annotations

import errno
import os
import signal
import sys

import pytest
import trio

from rolloutd.sandbox import PathEscapeError, SandboxClosed, SandboxError, SandboxSpec

from .conftest import marked_pids


async def read_pty_until(fd: int, needle: bytes, timeout_s: float = 10.0) -> bytes:
    stream = trio.lowlevel.FdStream(os.dup(fd))
    out = b""
    try:
        with trio.fail_after(timeout_s):
            while needle not in out:
                try:
                    chunk = await stream.receive_some(4096)
                except trio.BrokenResourceError:  # EIO: the pty's other side is gone
                    break
                if not chunk:
                    break
                out += chunk
    finally:
        await stream.aclose()
    return out


# ----- run ---------------------------------------------------------------------------


async def test_run_captures_exit_code_stdout_stderr(backend, base_spec):
    async with backend.open(base_spec) as sb:
        r = await sb.run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout_s=10)
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"out\n", b"err\n")
        assert not r.truncated and not r.timed_out and r.duration_s > 0
        r = await sb.run(["cat"], timeout_s=10, stdin=b"fed through stdin")
        assert r.stdout == b"fed through stdin"
        r = await sb.run(["sh", "-c", "pwd; echo $FOO"], timeout_s=10, env={"FOO": "bar"})
        assert r.stdout == f"{sb.workdir}\nbar\n".encode()
        await sb.mkdir("sub")
        r = await sb.run(["pwd"], timeout_s=10, cwd="sub")
        assert r.stdout.decode().strip() == f"{sb.workdir}/sub"
        r = await sb.run(["sh", "-c", "kill -TERM $$"], timeout_s=10)
        assert r.exit_code == -signal.SIGTERM
        with pytest.raises(FileNotFoundError):
            await sb.run(["/no/such/binary"], timeout_s=10)


#: A command's pid, session id and signal state. The masks are read by the command itself
#: (exec'd grep): dash blocks every signal while it waits for a child, so a child of the
#: shell reading the shell's status saw that some of the time.
PROBE = ["sh", "-c", "echo $$; cut -d' ' -f6 /proc/$$/stat; "
         "exec grep -E '^Sig(Ign|Blk)' /proc/self/status"]


async def test_commands_start_clean_in_both_spawn_paths(backend, base_spec):
    """In the workdir (posix_spawn) or elsewhere (fork+exec), a command leads its own
    session with no standard signal ignored or blocked (posix_spawn leaves glibc's internal
    signals 32 and 33 ignored, as it does for every process it starts) and the sandbox's
    rlimits, and a missing or non-executable program is the matching OSError."""
    probe = PROBE
    # a signal the daemon ignores (nohup, a CI runner) is not passed on to commands
    old = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        async with backend.open(base_spec) as sb:
            await _check_clean_starts(sb, probe)
    finally:
        signal.signal(signal.SIGUSR1, old)


async def _check_clean_starts(sb, probe):
    await sb.mkdir("sub")
    await sb.write_file("sub/script", b"#!/bin/sh\necho hi\n", mode=0o644)
    for cwd in (None, "sub"):
        r = await sb.run(probe, timeout_s=10, cwd=cwd)
        pid, sid, *masks = r.stdout.decode().split()
        masks = dict(zip(masks[::2], (int(m, 16) for m in masks[1::2]), strict=True))
        standard = 0x7FFFFFFF  # signals 1-31 (bit n-1 for signal n)
        assert masks["SigIgn:"] & standard == 0, (cwd, r.stdout)
        assert masks["SigBlk:"] == 0, (cwd, r.stdout)
        assert sid == pid, (cwd, r.stdout)  # a session of its own
        r = await sb.run(["sh", "-c", "ulimit -n; ulimit -c"], timeout_s=10, cwd=cwd)
        assert r.stdout == b"4096\n0\n"  # RLIMIT_NOFILE and RLIMIT_CORE for every process
        with pytest.raises(FileNotFoundError):
            await sb.run(["no-such-program"], timeout_s=10, cwd=cwd)
        with pytest.raises(PermissionError):
            await sb.run([f"{sb.workdir}/sub/script"], timeout_s=10, cwd=cwd)


async def test_set_env_reaches_later_processes(backend, base_spec):
    async with backend.open(base_spec) as sb:
        await sb.set_env({"ACTIVATED": "yes", "PATH": "/opt/env/bin:/usr/bin:/bin"}, unset=["LANG"])
        r = await sb.run(["sh", "-c", 'echo "$ACTIVATED|$PATH|${LANG-unset}|$ROLLOUTD_X"'],
                         timeout_s=10, env={"ROLLOUTD_X": "call"})
        assert r.stdout == b"yes|/opt/env/bin:/usr/bin:/bin|unset|call\n", r
        proc = await sb.spawn(["sh", "-c", 'test "$ACTIVATED" = yes'])
        assert await proc.wait() == 0
        with pytest.raises(SandboxError, match="bad environment variable"):
            await sb.set_env({"A=B": "x"})
        with pytest.raises(SandboxError, match="the sandbox's own variable"):
            await sb.set_env({"ROLLOUTD_RUN": "1.1"})  # it marks what each run leaves behind


async def test_listen_hands_the_daemon_a_port_of_the_sandbox(backend, base_spec, leak_check):
    """A sandbox with no network reaches one daemon endpoint: the helper opens a listening
    socket on the sandbox's loopback and hands it over; the daemon accepts on it."""
    async with backend.open(base_spec) as sb:
        port, sock = await sb.listen()

        async def echo(stream: trio.SocketStream) -> None:
            async with stream:
                while data := await stream.receive_some(65536):
                    await stream.send_all(data.upper())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, echo, [trio.SocketListener(sock)])
            client = ("import socket,sys\n"
                      "s=socket.create_connection(('127.0.0.1',int(sys.argv[1])))\n"
                      "for w in (b'one', b'x'*200000):\n"
                      "    s.sendall(w); got=b''\n"
                      "    while len(got)<len(w): got+=s.recv(65536)\n"
                      "    print(len(got), got[:3].decode())\n")
            r = await sb.run([sys.executable, "-c", client, str(port)], timeout_s=20)
            assert r.stdout == b"3 ONE\n200000 XXX\n", r
            nursery.cancel_scope.cancel()


async def test_kill_all_ends_every_process_but_the_helper(backend, base_spec, leak_check):
    async with backend.open(base_spec) as sb:
        beat = "while :; do date +%s%N > beat; sleep 0.05; done"
        # a spawned shell leaves a loop in a session of its own, as an agent's shell can
        shell = await sb.spawn(["sh", "-c", f"setsid sh -c '{beat}' </dev/null >/dev/null 2>&1 & "
                                "exec sleep 300"])
        await trio.sleep(0.3)
        await sb.kill_all()
        with trio.fail_after(10):
            assert await shell.wait() != 0
        await shell.aclose()
        last = await sb.read_file("beat")
        await trio.sleep(0.3)
        assert await sb.read_file("beat") == last  # the detached loop is gone too
        assert (await sb.run(["true"], timeout_s=10)).exit_code == 0  # the sandbox goes on


async def test_run_timeout_kills_the_whole_tree(backend, base_spec, leak_check):
    async with backend.open(base_spec) as sb:
        r = await sb.run(["sh", "-c", "setsid sleep 300 & sleep 300 & echo started; sleep 300"],
                         timeout_s=0.5)
        assert r.timed_out and r.exit_code is None
        assert r.stdout == b"started\n"
        assert r.duration_s < 5
        await trio.sleep(0.1)
        assert marked_pids(leak_check.tag) == []


async def test_run_kills_what_the_command_leaves_behind(backend, base_spec, leak_check):
    """setsid and double-fork escapees are killed once the command returns."""
    async with backend.open(base_spec) as sb:
        script = "setsid sleep 300 & (sleep 301 &) & nohup sleep 302 >/dev/null 2>&1 & echo ok"
        r = await sb.run(["sh", "-c", script], timeout_s=10)
        assert r.exit_code == 0 and r.stdout == b"ok\n" and not r.timed_out
        assert r.duration_s < 5  # the escapees held no pipe open long
        with trio.move_on_after(3):  # killed ones may take a moment to exit on a busy host
            while marked_pids(leak_check.tag):
                await trio.sleep(0.05)
        assert marked_pids(leak_check.tag) == []


async def test_run_output_is_bounded_head_and_tail(backend, base_spec):
    async with backend.open(base_spec) as sb:
        script = "echo HEAD; head -c 3000000 /dev/zero | tr '\\0' x; echo; echo TAIL"
        r = await sb.run(["sh", "-c", script], timeout_s=20, max_output_bytes=10_000)
        assert r.truncated and r.exit_code == 0
        assert len(r.stdout) < 10_200
        assert r.stdout.startswith(b"HEAD\n") and r.stdout.endswith(b"TAIL\n")
        assert b"bytes truncated" in r.stdout


async def test_run_is_cancellable(backend, base_spec, leak_check):
    async with backend.open(base_spec) as sb:
        with trio.move_on_after(0.5) as scope:
            await sb.run(["sleep", "300"], timeout_s=60)
        assert scope.cancelled_caught
        with trio.fail_after(5):
            while marked_pids(leak_check.tag):
                await trio.sleep(0.05)


# ----- spawn, pty, wait, signal ------------------------------------------------------


async def test_spawn_on_pty(backend, base_spec):
    async with backend.open(base_spec) as sb:
        proc = await sb.spawn(["bash", "--norc", "--noprofile", "-i"], pty=True, rows=30, cols=100)
        try:
            assert proc.pty_fd is not None and proc.stdin is None
            os.write(proc.pty_fd, b"stty size; echo $((6*7))MARK; tty\n")
            out = await read_pty_until(proc.pty_fd, b"42MARK")
            assert b"30 100" in out
            os.write(proc.pty_fd, b"exit 5\n")
            with trio.fail_after(10):
                assert await proc.wait() == 5
            assert proc.returncode == 5
        finally:
            os.close(proc.pty_fd)


async def test_spawn_on_pipes(backend, base_spec):
    async with backend.open(base_spec) as sb:
        proc = await sb.spawn(["sh", "-c", "cat; echo err >&2"])
        assert proc.pty_fd is None and proc.stdin and proc.stdout
        await proc.stdin.send_all(b"hello\n")
        await proc.stdin.aclose()
        out = b""
        with trio.fail_after(10):
            while chunk := await proc.stdout.receive_some(1024):
                out += chunk
            assert await proc.wait() == 0
        assert out == b"hello\nerr\n"  # stderr merged into stdout
        await proc.aclose()


async def test_wait_is_cancellable_and_signal_reaches_the_group(backend, base_spec, leak_check):
    async with backend.open(base_spec) as sb:
        proc = await sb.spawn(["sh", "-c", "sleep 300 & sleep 300; wait"])
        with trio.move_on_after(0.3) as scope:
            await proc.wait()
        assert scope.cancelled_caught and proc.returncode is None
        await proc.signal(signal.SIGKILL)  # group: the shell and both sleeps
        with trio.fail_after(10):
            assert await proc.wait() == -signal.SIGKILL
        await proc.aclose()
        with trio.fail_after(5):
            while marked_pids(leak_check.tag):
                await trio.sleep(0.05)
        with pytest.raises(OSError) as info:
            await sb.signal(1, signal.SIGKILL)  # not a process the sandbox owns
        assert info.value.errno == errno.ESRCH


# ----- files ---------------------------------------------------------------------------


async def test_file_operations(backend, base_spec):
    async with backend.open(base_spec) as sb:
        await sb.mkdir("a/b/c")
        await sb.write_file("a/b/c/f.txt", b"\x00binary\xff", mode=0o600)
        assert await sb.read_file("a/b/c/f.txt") == b"\x00binary\xff"
        assert await sb.read_file(f"{sb.workdir}/a/b/c/f.txt", max_bytes=3) == b"\x00bi"
        assert (sb.workspace / "a/b/c/f.txt").read_bytes() == b"\x00binary\xff"  # host view
        st = await sb.stat("a/b/c/f.txt")
        assert st is not None and st.type == "file" and st.size == 8 and st.mode == 0o600
        assert await sb.stat("missing") is None
        assert (await sb.stat("a")).type == "dir"
        names = [(e.name, e.type) for e in await sb.list_dir("a/b/c")]
        assert names == [("f.txt", "file")]
        r = await sb.run(["cat", "a/b/c/f.txt"], timeout_s=10)
        assert r.stdout == b"\x00binary\xff"
        with pytest.raises(FileNotFoundError):
            await sb.read_file("nope.txt")
        with pytest.raises(IsADirectoryError):
            await sb.read_file("a")
        with pytest.raises(FileNotFoundError):
            await sb.mkdir("x/y/z", parents=False)
        tmpdir = (await sb.run(["sh", "-c", "echo $TMPDIR"], timeout_s=10)).stdout.decode().strip()
        await sb.write_file(f"{tmpdir}/t.txt", b"TMPDIR is a file root too")
        assert await sb.read_file(f"{tmpdir}/t.txt") == b"TMPDIR is a file root too"
        await sb.remove("a")
        assert await sb.stat("a") is None
        await sb.write_file("big.bin", os.urandom(3 << 20))
        assert len(await sb.read_file("big.bin")) == 3 << 20


async def test_paths_cannot_escape(backend, base_spec):
    async with backend.open(base_spec) as sb:
        r = await sb.run(["sh", "-c", "ln -s /etc/passwd out.txt; ln -s /etc d; "
                          "echo in > real.txt; ln -s real.txt inner.txt"], timeout_s=10)
        assert r.exit_code == 0
        for bad in ("../../../etc/passwd", "/etc/passwd", "out.txt", "d/hostname"):
            with pytest.raises(PathEscapeError):
                await sb.read_file(bad)
        with pytest.raises(PathEscapeError):
            await sb.write_file("d/evil", b"x")
        with pytest.raises(PathEscapeError):
            await sb.write_file("out.txt", b"x")
        with pytest.raises(PathEscapeError):
            await sb.list_dir("d")
        with pytest.raises(PathEscapeError):
            await sb.mkdir("d/newdir")
        with pytest.raises(PermissionError):  # PathEscapeError is a PermissionError too
            await sb.stat("out.txt")
        assert await sb.read_file("inner.txt") == b"in\n"  # a symlink inside is fine
        entries = {e.name: e.type for e in await sb.list_dir(".")}
        assert entries["out.txt"] == "symlink"
        await sb.remove("d")  # removes the link, not /etc
        assert os.path.isdir("/etc") and await sb.stat("d") is None


# ----- limits, lifetime, teardown ---------------------------------------------------------


async def test_limits_are_enforced_and_reported(backend, base_spec):
    spec = base_spec.model_copy(update={"memory_mb": 64, "pids_max": 64})
    async with backend.open(spec) as sb:
        assert set(sb.limits) >= {"memory", "pids", "cpu", "disk", "lifetime"}
        r = await sb.run(["python3", "-c", "b = bytearray(256 << 20); print('allocated')"],
                         timeout_s=20)
        assert r.stdout != b"allocated\n" and r.exit_code != 0
        if sb.limits["pids"].startswith("cgroup"):
            r = await sb.run(["sh", "-c", "for i in $(seq 200); do sleep 2 & done; wait"],
                             timeout_s=20)
            assert b"fork" in r.stderr.lower() or r.exit_code != 0


async def test_lifetime_ends_the_sandbox(backend, base_spec, leak_check):
    spec = base_spec.model_copy(update={"lifetime_s": 1.0})
    async with backend.open(spec) as sb:
        proc = await sb.spawn(["sleep", "300"])
        await proc.aclose()
        with trio.fail_after(10):
            with pytest.raises(SandboxClosed, match="lifetime"):
                while True:
                    await sb.run(["true"], timeout_s=5)
                    await trio.sleep(0.1)
        with trio.fail_after(5):
            while marked_pids(leak_check.tag):
                await trio.sleep(0.05)


async def test_lifetime_is_the_reason_however_late_the_open_returns(backend, base_spec,
                                                                    leak_check, monkeypatch):
    """The helper's lifetime runs from its own start, before the open returns; a daemon
    slow to come back from the open (CPU load) still reports the lifetime, not a helper
    gone. Stand-in for the load: the open stalls after READY until the helper has ended
    its lifetime (its socket is gone), and then returns the sandbox."""
    ready = backend._wait_ready

    async def ready_then_stall(handle):
        await ready(handle)
        with trio.fail_after(10):
            while os.path.exists(handle.dirs.socket_path):
                await trio.sleep(0.01)

    monkeypatch.setattr(backend, "_wait_ready", ready_then_stall)
    spec = base_spec.model_copy(update={"lifetime_s": 0.5})
    async with backend.open(spec) as sb:
        with pytest.raises(SandboxClosed, match="lifetime of 0.5 s expired"):
            await sb.run(["true"], timeout_s=5)
        assert sb.closed_reason == "lifetime of 0.5 s expired"


async def test_teardown_kills_everything_and_removes_dirs(backend, base_spec, leak_check):
    async with backend.open(base_spec) as sb:
        proc = await sb.spawn(["sh", "-c", "setsid sleep 300 & sleep 300"], pty=True)
        os.close(proc.pty_fd)
        await sb.run(["sh", "-c", "echo x > f"], timeout_s=10)
        workspace, control = sb.workspace, sb.control_dir
        assert marked_pids(leak_check.tag)
        assert control.is_dir() and (control / "h.sock").exists()
    assert not workspace.exists() and not control.exists()
    assert marked_pids(leak_check.tag) == []
    with pytest.raises(SandboxClosed):
        await sb.run(["true"], timeout_s=5)


async def test_teardown_is_shielded_when_cancelled(backend, base_spec, leak_check):
    # Cancelled once the sandbox is busy, however long the open and the spawn took (a
    # fixed deadline from the start cancelled the open itself on a loaded machine).
    fds = []
    with trio.CancelScope() as scope:
        async with backend.open(base_spec) as sb:
            proc = await sb.spawn(["sh", "-c", "setsid sleep 300 & sleep 300"], pty=True)
            fds.append(proc.pty_fd)
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    os.close(fds[0])
    assert marked_pids(leak_check.tag) == []  # torn down although cancelled


@pytest.mark.slow
async def test_open_close_cycles_leak_nothing(backend, base_spec, leak_check):
    for _ in range(15):
        async with backend.open(base_spec) as sb:
            r = await sb.run(["sh", "-c", "sleep 300 & echo $$"], timeout_s=10)
            assert r.exit_code == 0
            proc = await sb.spawn(["sleep", "300"], pty=True)
            os.close(proc.pty_fd)
    # the leak_check fixture asserts: no processes, fds, dirs or mounts left


async def test_control_dir_path_is_the_same_inside(backend, base_spec):
    async with backend.open(base_spec) as sb:
        r = await sb.run(["ls", str(sb.control_dir)], timeout_s=10)
        assert r.exit_code == 0 and b"h.sock" in r.stdout
        r = await sb.run([sb.python, "-c", "print(1 + 1)"], timeout_s=20)
        assert r.stdout == b"2\n"


async def test_spec_backend_mismatch_is_refused(backend, base_spec):
    other = "local" if backend.name != "local" else "bwrap"
    from rolloutd.sandbox import SandboxStartError

    with pytest.raises(SandboxStartError):
        async with backend.open(base_spec.model_copy(update={"backend": other})):
            pass


def test_spec_validation():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        SandboxSpec(workdir="relative")
    with pytest.raises(ValidationError):
        SandboxSpec(memory_mb=0)
    with pytest.raises(ValidationError):
        SandboxSpec(unknown=1)


async def test_write_file_replaces_longer_content(backend, base_spec):
    """Files are rewritten in place (no O_TRUNC): a shorter write must not keep old bytes."""
    async with backend.open(base_spec) as sb:
        await sb.write_file("f.txt", b"a much longer first version\n")
        await sb.write_file("f.txt", b"short\n")
        assert await sb.read_file("f.txt") == b"short\n"
        await sb.write_file("f.txt", b"")
        assert await sb.read_file("f.txt") == b""
