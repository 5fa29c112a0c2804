"""RUN for a task with ``agent``: the endpoint, the harness, and its end.

INIT (:func:`install_agent`) installs the harness from a wheel directory when the task asks.
RUN (:func:`run_harness`):

1. has the sandbox's helper open a socket listening on ``127.0.0.1:<port>`` of the sandbox's
   own network namespace and hand it over on the control socket (``Sandbox.listen``), and
   serves the rollout's endpoint on it: the daemon accepts the harness's connections itself,
   with no relay, and the sandbox keeps no other network;
2. writes the task's prompt where the harness can read it (``ROLLOUTD_TASK_FILE``, text;
   ``ROLLOUTD_MESSAGES_FILE``, JSON) and starts the command with the endpoint in its
   environment, stdin at EOF, stdout and stderr captured (the tail is kept);
3. waits for it to exit, for ``agent.timeout_s``, or for an infrastructure failure (which
   fails the rollout); the rollout's own deadline and cancel end it as for the built-in loop.

Whatever ended it, the harness's process group is killed before RUN returns (shielded,
bounded), and the endpoint stops with it.
"""

from __future__ import annotations

import json
import math
import secrets
import signal
from typing import TYPE_CHECKING, Any

import trio

from rolloutd.daemon.harness._endpoint import Endpoint
from rolloutd.daemon.harness._errors import HarnessError
from rolloutd.daemon.harness._http import serve_socket
from rolloutd.daemon.harness._spec import AGENT_VENV, WHEELS_DIR, AgentInstall, AgentSpec

if TYPE_CHECKING:
    from rolloutd.daemon.harness._session import Session
    from rolloutd.sandbox import Sandbox

TASK_NAME = "task.md"
MESSAGES_NAME = "messages.json"
OUTPUT_TAIL = 8000
CLEANUP_S = 5.0


def venv_path(sandbox: Sandbox) -> str:
    """Where ``install`` puts the harness (the local backend has no private /tmp)."""
    if sandbox.backend == "local":
        return str(sandbox.workspace.parent / "tmp" / "rolloutd-agent")
    return AGENT_VENV


def wheels_path(sandbox: Sandbox, install: AgentInstall) -> str:
    return install.wheels if sandbox.backend == "local" else WHEELS_DIR


async def install_agent(sandbox: Sandbox, install: AgentInstall) -> None:
    """Make the harness's venv and pip install its packages from the wheel dir (no index)."""
    venv = venv_path(sandbox)
    env = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "PIP_NO_INDEX": "1"}
    steps = [
        [install.python, "-m", "venv", venv],
        [f"{venv}/bin/python", "-m", "pip", "install", "-q", "--no-index", "--find-links",
         wheels_path(sandbox, install), *install.packages],
    ]
    with trio.move_on_after(install.timeout_s) as scope:
        for argv in steps:
            res = await sandbox.run(argv, timeout_s=install.timeout_s, env=env)
            if res.exit_code != 0:
                out = (res.stderr or res.stdout or b"").decode(errors="replace")[-1500:]
                raise HarnessError(f"agent install failed ({' '.join(argv[:4])} ...: exit "
                                   f"{res.exit_code}): {out.strip()}")
    if scope.cancelled_caught:
        raise HarnessError(f"agent install took longer than {install.timeout_s:g} s")


def _write_prompt(sandbox: Sandbox, messages: list[dict[str, Any]]) -> tuple[str, str]:
    """The prompt where the sandbox can read it (the control dir is at the same path inside)."""
    task = next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"), "")
    paths = []
    for name, data in ((TASK_NAME, task.encode()),
                       (MESSAGES_NAME, json.dumps(messages, ensure_ascii=False).encode())):
        path = sandbox.control_dir / name
        path.write_bytes(data)
        path.chmod(0o644)
        paths.append(str(path))
    return paths[0], paths[1]


def harness_env(spec: AgentSpec, sandbox: Sandbox, *, port: int, key: str, task_file: str,
                messages_file: str) -> dict[str, str]:
    base = f"http://127.0.0.1:{port}"
    env = {
        "OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_BASE": f"{base}/v1", "OPENAI_API_KEY": key,
        "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": key,
        "ROLLOUTD_TASK_FILE": task_file, "ROLLOUTD_MESSAGES_FILE": messages_file,
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
    }
    env.update(spec.env)
    return env


def harness_argv(spec: AgentSpec, sandbox: Sandbox) -> list[str]:
    """The command; with ``install``, run with the venv's ``bin`` first on the sandbox's PATH."""
    if spec.install is None:
        return list(spec.command)
    return ["/bin/sh", "-c", 'PATH="$0:$PATH"; export PATH; exec "$@"', f"{venv_path(sandbox)}/bin",
            *spec.command]


async def run_harness(sandbox: Sandbox, spec: AgentSpec, session: Session,
                      messages: list[dict[str, Any]]) -> None:
    info = session.info
    info.command = list(spec.command)
    key = "sk-rollout-" + secrets.token_urlsafe(24)
    task_file, messages_file = await trio.to_thread.run_sync(_write_prompt, sandbox, messages)
    tail = bytearray()
    async with trio.open_nursery() as nursery:
        port, sock = await sandbox.listen()
        await nursery.start(serve_socket, sock, Endpoint(session, key=key, model=spec.model))
        env = harness_env(spec, sandbox, port=port, key=key, task_file=task_file,
                          messages_file=messages_file)
        proc = await sandbox.spawn(harness_argv(spec, sandbox), env=env)
        try:
            assert proc.stdin is not None and proc.stdout is not None
            await proc.stdin.aclose()  # stdin at EOF: a harness must not wait for a person
            nursery.start_soon(_keep_tail, proc.stdout, tail)
            with trio.move_on_after(spec.timeout_s if spec.timeout_s else math.inf):
                async with trio.open_nursery() as race:
                    async def exited() -> None:
                        info.exit_code = await proc.wait()
                        info.ended = "exited"
                        race.cancel_scope.cancel()

                    async def failed() -> None:
                        await session.failed.wait()
                        race.cancel_scope.cancel()

                    race.start_soon(exited)
                    race.start_soon(failed)
            if info.ended is None and session.fatal is None:
                info.ended = "timeout"
        finally:
            if info.ended is None:
                info.ended = "cut"
            with trio.move_on_after(CLEANUP_S, shield=True):
                if proc.returncode is None:
                    try:
                        await proc.signal(signal.SIGKILL)
                    except Exception:  # the sandbox may be gone already (teardown)
                        pass
                    with trio.move_on_after(1.0):
                        await _drain(proc)
                await proc.aclose()
            info.output_tail = tail[-OUTPUT_TAIL:].decode(errors="replace")
            nursery.cancel_scope.cancel()
    if session.fatal is not None:
        raise session.fatal


async def _drain(proc: Any) -> None:
    try:
        await proc.wait()
    except Exception:
        pass


async def _keep_tail(stream: trio.abc.ReceiveStream, tail: bytearray) -> None:
    try:
        while data := await stream.receive_some(65536):
            tail += data
            if len(tail) > 2 * OUTPUT_TAIL:
                del tail[:-OUTPUT_TAIL]
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
