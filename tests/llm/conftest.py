"""Fixtures for rolloutd.daemon.llm tests: the real tokenizer (fast), the real tiny model (loaded once
per session, tests marked ``model``), and model-server processes (scripted or real)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import trio

from rolloutd.daemon.llm.chat import ChatRenderer, load_embedded_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_embedded_tokenizer()


@pytest.fixture(scope="session")
def renderer(tokenizer) -> ChatRenderer:
    return ChatRenderer.for_tokenizer(tokenizer, "chatml")


@pytest.fixture(scope="session")
def model_backend():
    """The embedded SmolLM2 backend, loaded once (blocking load outside any trio run)."""
    from rolloutd.daemon.llm.transformers import TransformersBackend

    backend = TransformersBackend()
    backend._gen = backend._load_sync()
    return backend


@dataclass
class ServerProc:
    url: str
    proc: trio.Process

    def kill(self) -> None:
        if self.proc.returncode is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


@asynccontextmanager
async def open_model_server(*args: str) -> AsyncIterator[ServerProc]:
    """A ``python -m rolloutd.daemon.llm.model_server --port 0 ARGS`` child; killed and reaped on exit."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "rolloutd.daemon.llm.model_server", "--port", "0", *args],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        buf = b""
        with trio.fail_after(120):
            while b"\n" not in buf:
                chunk = await proc.stdout.receive_some()
                if not chunk:
                    raise RuntimeError(f"model-server exited early ({await proc.wait()})")
                buf += chunk
        assert buf.startswith(b"READY "), buf
        yield ServerProc(buf.split()[1].decode(), proc)
    finally:
        with trio.move_on_after(10, shield=True):
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGTERM)
                with trio.move_on_after(5):
                    await proc.wait()
                if proc.returncode is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            await proc.stdout.aclose()
