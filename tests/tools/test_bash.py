"""The bash tool on a real pty in real sandboxes (bwrap; local for the core cases)."""

from __future__ import annotations

import time

import pytest
import trio

from rolloutd.tools import Toolbox


async def bash(tb: Toolbox, command: str, timeout_s: float = 10.0):
    return await tb.call("bash", {"command": command}, timeout_s=timeout_s)


async def test_round_trip_and_state_persists(toolbox: Toolbox) -> None:
    r = await bash(toolbox, "echo hi")
    assert (r.output, r.ok, r.exit_code, r.timed_out) == ("hi\n", True, 0, False)
    await bash(toolbox, "mkdir -p sub && cd sub && export FOO=bar && greet() { echo hello $1; }")
    r = await bash(toolbox, 'pwd; echo "$FOO"; greet you')
    assert r.output.splitlines()[1:] == ["bar", "hello you"]
    assert r.output.splitlines()[0].endswith("/sub")


async def test_exit_code_and_stderr(toolbox: Toolbox) -> None:
    r = await bash(toolbox, "echo out; echo err >&2; exit_code() { return 3; }; exit_code")
    assert r.exit_code == 3 and not r.ok
    assert r.output == "out\nerr\n"


async def test_heredoc_longer_than_a_tty_line(bwrap_toolbox: Toolbox) -> None:
    body = "\n".join(f"line {i} " + "x" * 60 for i in range(200))  # ~14 KB
    assert len(body) > 4096
    r = await bash(bwrap_toolbox, f"cat > big.txt <<'EOF'\n{body}\nEOF\nwc -c < big.txt")
    assert r.exit_code == 0
    assert int(r.output.strip()) == len(body) + 1
    # and a single line longer than 4096 bytes
    r = await bash(bwrap_toolbox, "echo " + "y" * 6000 + " | wc -c")
    assert r.output.strip() == "6001"


async def test_set_euo_pipefail(toolbox: Toolbox) -> None:
    r = await bash(toolbox, "cd /tmp; set -euo pipefail; echo ok")
    assert r.output == "ok\n" and r.exit_code == 0
    # -e is reset after each call: a failing command does not kill the shell (cwd kept)
    r = await bash(toolbox, "false")
    assert r.exit_code == 1
    r = await bash(toolbox, "pwd")
    assert r.output == "/tmp\n"
    # -u stays on, and an unbound variable is an ordinary error
    r = await bash(toolbox, "echo $surely_unset_var; echo next")
    assert r.exit_code != 0 and "unbound variable" in r.output
    # set -e plus a failure inside one call exits the shell: restarted, the model is told
    r = await bash(toolbox, "set -e; false; echo unreachable")
    assert "unreachable" not in r.output
    assert "new shell has been started" in r.output
    r = await bash(toolbox, "pwd; echo alive")
    assert r.exit_code == 0 and r.output.endswith("alive\n")


async def test_exit_restarts_the_shell(toolbox: Toolbox) -> None:
    await bash(toolbox, "cd /tmp")
    r = await bash(toolbox, "echo bye; exit 7")
    assert r.output.startswith("bye\n") and "The shell exited with status 7" in r.output
    assert r.exit_code == 7
    r = await bash(toolbox, "pwd")
    assert r.output != "/tmp\n" and r.exit_code == 0


async def test_sleep_under_timeout_then_recovers(toolbox: Toolbox) -> None:
    await bash(toolbox, "cd /tmp")
    t0 = time.monotonic()
    r = await bash(toolbox, "echo started; sleep 1000", timeout_s=1.0)
    took = time.monotonic() - t0
    assert r.timed_out and not r.ok
    assert r.output.startswith("started\n")
    assert "timed out after 1 s" in r.output
    assert 0.9 < took < 2.5
    r = await bash(toolbox, "pwd")  # Ctrl-C recovery: same shell, state kept
    assert r.output == "/tmp\n"


async def test_ctrl_c_of_a_builtin_loop(bwrap_toolbox: Toolbox) -> None:
    await bash(bwrap_toolbox, "X=kept")
    r = await bash(bwrap_toolbox, "while :; do :; done", timeout_s=0.5)
    assert r.timed_out
    r = await bash(bwrap_toolbox, "echo $X")
    assert r.output == "kept\n"


@pytest.mark.parametrize("command", ["vim", "vim notes.txt", "less /etc/passwd", "python3",
                                     "read x; echo got:$x", "cat", "top"])
async def test_interactive_programs_do_not_hang(bwrap_toolbox: Toolbox, command: str) -> None:
    t0 = time.monotonic()
    r = await bash(bwrap_toolbox, command, timeout_s=1.0)
    assert time.monotonic() - t0 < 2.5, r
    r2 = await bash(bwrap_toolbox, "echo usable")
    assert r2.output == "usable\n", (r, r2)


async def test_stdin_is_dev_null(bwrap_toolbox: Toolbox) -> None:
    r = await bash(bwrap_toolbox, "read x; echo status=$?")
    assert r.output == "status=1\n"


async def test_background_jobs(bwrap_toolbox: Toolbox) -> None:
    t0 = time.monotonic()
    r = await bash(bwrap_toolbox, "sleep 30 &")
    assert r.exit_code == 0 and time.monotonic() - t0 < 1.0
    r = await bash(bwrap_toolbox, "(sleep 0.2; echo done > bg.txt) & wait $!; cat bg.txt")
    assert r.output.rstrip().endswith("done")
    # a background job keeps the pty open when the shell exits: still detected
    r = await bash(bwrap_toolbox, "sleep 60 & exit 4", timeout_s=5)
    assert r.exit_code == 4 and "new shell" in r.output
    assert (await bash(bwrap_toolbox, "echo ok")).output == "ok\n"


async def test_ansi_invalid_utf8_and_nul(bwrap_toolbox: Toolbox) -> None:
    r = await bash(bwrap_toolbox, r"printf '\033[31mred\033[0m \xff\xfe ok\000nul é\n'")
    assert r.output == "red \ufffd\ufffd oknul é\n"
    # a multi-byte character split across writes survives
    r = await bash(bwrap_toolbox, r"printf '\xc3'; sleep 0.05; printf '\xa9\n'")
    assert r.output == "é\n"


async def test_progress_bars_keep_the_last_state(bwrap_toolbox: Toolbox) -> None:
    r = await bash(bwrap_toolbox, r"printf '10%%\r50%%\r100%%\ndone\n'")
    assert r.output == "100%\ndone\n"


@pytest.mark.slow
async def test_100_mb_of_output(bwrap_toolbox: Toolbox) -> None:
    t0 = time.monotonic()
    r = await bash(bwrap_toolbox,
                   "head -c 100000000 /dev/zero | tr '\\0' a | fold -w 100; echo END",
                   timeout_s=120)
    took = time.monotonic() - t0
    assert r.exit_code == 0, r.output[-500:]
    assert len(r.output) < 12_000
    assert "omitted from the middle" in r.output
    assert r.output.startswith("a" * 100 + "\n") and r.output.endswith("END\n")
    print(f"100 MB through the pty in {took:.1f} s")


async def test_restart_argument_and_empty_command(bwrap_toolbox: Toolbox) -> None:
    await bash(bwrap_toolbox, "cd /tmp")
    r = await bwrap_toolbox.call("bash", {"command": "", "restart": True}, timeout_s=5)
    assert "restarted" in r.output
    assert (await bash(bwrap_toolbox, "pwd")).output != "/tmp\n"
    r = await bash(bwrap_toolbox, "   ")
    assert not r.ok


async def test_cancelled_call_leaves_a_usable_shell(bwrap_toolbox: Toolbox) -> None:
    with trio.move_on_after(0.3):
        await bash(bwrap_toolbox, "sleep 100", timeout_s=50)
    r = await bash(bwrap_toolbox, "echo fine")
    assert "previous command was cancelled" in r.output
    assert r.output.endswith("fine\n") and r.exit_code == 0


async def test_prompt_variables_do_not_leak(toolbox: Toolbox) -> None:
    """PS1, PS0, PS2 and PROMPT_COMMAND (a string, then an array) set by the model used to
    print between commands, into every later output."""
    r = await bash(toolbox, "PS1='P1>'; PS0='P0>'; PS2='P2>'; PROMPT_COMMAND='echo PC'")
    assert r.output == "" and r.exit_code == 0
    assert (await bash(toolbox, "echo a")).output == "a\n"
    assert (await bash(toolbox, "echo b")).output == "b\n"
    await bash(toolbox, "PROMPT_COMMAND=('echo PC1' 'echo PC2'); PS1='\\u@\\h$ '")
    assert (await bash(toolbox, "echo c")).output == "c\n"
    # the shell still works as a shell (a multi-line command: PS2 is never printed)
    r = await bash(toolbox, "for i in 1 2\ndo\n  echo $i\ndone")
    assert r.output == "1\n2\n"


async def test_aliases_of_the_wrappers_words(toolbox: Toolbox) -> None:
    """The tool's own line is typed into the shell: an alias the model defined for one of its
    words (`eval`, ...) used to be expanded there, and every later call hung to its timeout."""
    await bash(toolbox, "alias eval='echo pwned'; alias builtin=false; alias __rd_done=true")
    r = await bash(toolbox, "set -x; echo a", timeout_s=5)
    assert r.output == "++ echo a\na\n" and not r.timed_out
    r = await bash(toolbox, "echo b", timeout_s=5)
    assert r.output == "++ echo b\nb\n"


async def test_xtrace_shows_only_the_models_commands(toolbox: Toolbox) -> None:
    """`set -x` traces the model's commands, never the tool's own wrapper (which used to show
    as `+ eval ...`, `+ __rd_done 0 <nonce>`, `+ builtin printf ...`)."""
    r = await bash(toolbox, "set -x")
    assert r.output == ""
    r = await bash(toolbox, "echo c")  # inside the tool's eval: one more `+` of nesting
    assert r.output == "++ echo c\nc\n"
    r = await bash(toolbox, "printf abc")  # output without a final newline is kept
    assert r.output == "++ printf abc\nabc"
    r = await bash(toolbox, "PS4='+ $LINENO: '; echo d")
    assert r.output.endswith("d\n") and "__rd" not in r.output
    r = await bash(toolbox, "PS4='[$RANDOM]> '; echo e")  # expands differently each time
    assert r.output.endswith("e\n") and "__rd" not in r.output
    r = await bash(toolbox, "echo f")
    assert r.output.endswith("> echo f\nf\n") and r.output.count("\n") == 2
    r = await bash(toolbox, "set +x; set -v")
    assert "__rd" not in r.output
    r = await bash(toolbox, "echo g")  # verbose echoes lines it reads: not the tool's line
    assert r.output == "g\n"
    r = await bash(toolbox, "set +v; echo h")
    assert r.output == "h\n"
    assert (await bash(toolbox, "echo i")).output == "i\n"


async def test_job_notices_stay_out_of_later_calls(bwrap_toolbox: Toolbox) -> None:
    """bash reports ended background jobs ("[1]+  Done  sleep 0.2") after whichever later
    command is running when it notices; those notices are dropped. Job control still works
    across calls."""
    r = await bash(bwrap_toolbox, "sleep 0.2 &")
    assert r.output.startswith("[1] ") and r.output.count("\n") == 1
    r = await bash(bwrap_toolbox, "sleep 0.5; echo e")  # the job ends during this call
    assert r.output == "e\n"
    await bash(bwrap_toolbox, "sleep 0.1 & (sleep 0.1; exit 3) & sleep 30 & kill %3")
    await trio.sleep(0.3)  # they end between calls
    assert (await bash(bwrap_toolbox, "echo f")).output == "f\n"
    assert (await bash(bwrap_toolbox, "echo g")).output == "g\n"
    await bash(bwrap_toolbox, "sleep 30 &")
    r = await bash(bwrap_toolbox, "jobs; kill %1; wait %1; echo status=$?")
    assert r.output.splitlines() == ["[1]+  Running                 sleep 30 &", "status=143"]
    assert (await bash(bwrap_toolbox, "echo h")).output == "h\n"


async def test_python_and_pip_run_the_sandbox_interpreter(bwrap_sandbox) -> None:
    """`python` used to be "command not found" in a bwrap sandbox (the host has only
    python3, and the sandbox's interpreter is not on the PATH); `pip` was the host's pip."""
    from rolloutd.tools import open_toolbox

    async with open_toolbox(bwrap_sandbox, ["bash"]) as tb:
        r = await bash(tb, "python -c 'import sys; print(sys.executable)'")
        assert r.output == bwrap_sandbox.python + "\n", r.output
        r = await bash(tb, "pip --version", timeout_s=30)
        assert r.ok, r.output
        r2 = await bash(tb, "python -m pip --version", timeout_s=30)
        assert r.output == r2.output
        # after a restart too
        await tb.call("bash", {"command": "", "restart": True}, timeout_s=10)
        assert (await bash(tb, "python -c 'print(6*7)'")).output == "42\n"
    assert not (bwrap_sandbox.control_dir / "bin").exists()  # removed with the shell
