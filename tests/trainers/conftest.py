"""A real ``rolloutd serve`` child over loopback for the trainer adapters (blocking clients
need a real socket). Its LLM backend is the scripted test double: it replays a calculator
call and an answer, so ``calc`` tasks get real trajectories (real tokenizer, real tool)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 392"}}\n</tool_call>'
REPLIES = [CALL, "1889832"]


def calc(expression: str = "4821 * 392") -> dict:
    return {"kind": "calc", "expression": expression, "examples": 0}  # examples=0: the script counts turns


@pytest.fixture
def daemon_url(tmp_path) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "ROLLOUTD_LOG_LEVEL": "warning",
           "ROLLOUTD_BACKENDS": json.dumps([{"kind": "scripted", "replies": REPLIES, "id": "policy"}])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rolloutd.daemon.cli", "serve", "--port", str(port), "--state-dir",
         str(tmp_path / "state"), "--sandbox-backend", "local"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "rolloutd serve did not become ready"
            time.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        proc.stderr.close()
