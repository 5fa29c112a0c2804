"""The mini-swe-agent recipe of examples/agents/mini/: the unmodified ``mini`` CLI, run with
the command and environment of its agent.json inside a real bwrap sandbox, against a test
double of the OpenAI-compatible endpoint (_fake_openai.py, scripted replies) started in the
same sandbox, on the sandbox's own loopback (the sandbox has no other network)."""

from __future__ import annotations

import json
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import trio

from rolloutd.sandbox import SandboxSpec, open_backend

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "agents" / "mini"
MINI = Path(sys.executable).parent / "mini"

#: mini-swe-agent is in the dev extra (``agents``): a missing harness fails, never skips.
pytestmark = [pytest.mark.slow]

# A reply without a command block (a format error), one command, then the finish command.
REPLIES = [
    "I should write the file, but I forgot the code block.",
    "THOUGHT: write the answer file.\n\n```mswea_bash_command\necho hello > answer.txt && ls\n```",
    "THOUGHT: done.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
]
TASK = "Write hello into answer.txt."
TOKEN = "rollout-token-123"


@pytest.fixture
def state_dir():
    path = Path(tempfile.mkdtemp(prefix="rld", dir="/tmp"))  # short: the helper's socket path
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_mini_recipe_in_bwrap_sandbox(state_dir):
    agent = json.loads((RECIPE / "agent.json").read_text())
    backend = open_backend("bwrap", state_dir=state_dir, boot_id="t" + secrets.token_hex(5),
                           check=True)
    async with backend.open(SandboxSpec(lifetime_s=240)) as sb:
        await sb.mkdir("/tmp/fake")
        await sb.mkdir("/tmp/rolloutd")
        await sb.write_file("/tmp/fake/server.py", (Path(__file__).parent / "_fake_openai.py").read_bytes())
        await sb.write_file("/tmp/fake/replies.json", json.dumps(REPLIES).encode())
        await sb.write_file("/tmp/rolloutd/task.md", TASK.encode() + b"\n")
        # the recipe's config where the sandbox sees it (a checkout under /tmp is hidden there)
        await sb.write_file("/tmp/fake/mini.yaml", (RECIPE / "mini.yaml").read_bytes())
        server = await sb.spawn([sb.python, "/tmp/fake/server.py", "/tmp/fake/port",
                                 "/tmp/fake/replies.json", "/tmp/fake/log.jsonl"])
        try:
            with trio.fail_after(30):
                while await sb.stat("/tmp/fake/port") is None:
                    await trio.sleep(0.05)
            port = int(await sb.read_file("/tmp/fake/port"))
            env = {
                **agent["env"],
                # what the daemon (or the task) supplies per rollout and per deployment
                "PATH": f"{MINI.parent}:/usr/local/bin:/usr/bin:/bin",
                "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1",
                "OPENAI_API_KEY": TOKEN,
                "ROLLOUTD_TASK_FILE": "/tmp/rolloutd/task.md",
                "MSWEA_CONFIG_DIR": "/tmp/fake",
            }
            result = await sb.run(agent["command"], timeout_s=180, env=env)
        finally:
            await server.signal(15)
            await server.wait()
            await server.aclose()
        out = (result.stdout + result.stderr).decode(errors="replace")
        assert result.exit_code == 0, out[-3000:]
        # The command ran in the workspace; the trajectory and config stay out of it.
        assert [e.name for e in await sb.list_dir(sb.workdir)] == ["answer.txt"], out[-3000:]
        assert await sb.read_file(f"{sb.workdir}/answer.txt") == b"hello\n"
        traj = json.loads(await sb.read_file("/tmp/mini.traj.json"))
        assert traj["info"]["exit_status"] == "Submitted"
        log = [json.loads(line) for line in (await sb.read_file("/tmp/fake/log.jsonl")).splitlines()]

    assert len(log) == 3
    for request in log:
        assert request["path"] == "/v1/chat/completions"
        assert request["headers"]["authorization"] == f"Bearer {TOKEN}"
        # text mode: no tools, no sampling parameters unless model_kwargs add them
        assert sorted(request["body"]) == ["messages", "model"]
        assert request["body"]["model"] == "policy"
    first, second, third = (r["body"]["messages"] for r in log)
    assert [m["role"] for m in first] == ["system", "user"]
    assert TASK in first[1]["content"]
    # A format error drops the model's reply: the next prompt is the old one plus a user turn.
    assert second[:2] == first
    assert [m["role"] for m in second] == ["system", "user", "user"]
    assert "Format error" in second[2]["content"]
    # A valid action extends the history with the reply, verbatim, and its observation.
    assert third[:3] == second
    assert third[3] == {"role": "assistant", "content": REPLIES[1]}
    assert third[4]["role"] == "user"
    assert "<returncode>0</returncode>" in third[4]["content"]
    assert "answer.txt" in third[4]["content"]
